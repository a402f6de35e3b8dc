"""vLLM's custom logits processors (``--logits-processors``) on the default model: a request's
``extra_args`` turn a processor on for it alone (the others' tokens are those of an engine
without processors), through recompute preemption and async scheduling; per-request functions
(``AdapterLogitsProcessor``) read the prompt's and output's ids; argmax-invariant processors
shape sampled requests only; a processor refuses a request's arguments before it is queued."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_logits_processors import ArgmaxOnly, NoRepeats, TargetToken
from test_async_scheduling import add_all, make_core, run, summary

from baton import LLM
from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.outputs import EngineCoreOutput
from baton_engine.errors import InvalidRequestError
from baton_engine.sampling_params import SamplingParams

LOOP = list(range(1000, 1012)) * 3
BY_NAME = ("example_logits_processors:TargetToken", "example_logits_processors.NoRepeats")


def _batch() -> list[tuple[list[int], SamplingParams]]:
    def params(**kw: object) -> SamplingParams:
        return SamplingParams(max_tokens=24, ignore_eos=True, **kw)  # type: ignore[arg-type]

    return [
        (LOOP, params(temperature=0.0)),
        (LOOP[1:], params(temperature=0.0, extra_args={"target_token": 42})),
        (LOOP[2:], params(temperature=1.0, seed=5, extra_args={"target_token": 7})),
        (LOOP[3:], params(temperature=0.8, seed=3)),
        (LOOP[4:], params(temperature=0.0, extra_args={"no_repeats": True})),
        (LOOP[5:], params(temperature=0.0, extra_args={"other": "ignored"})),
    ] * 2


def test_a_processor_changes_only_the_requests_that_ask_for_it(default_model_dir: Path) -> None:
    """Processors by name, with async scheduling: requests 1 and 2 (greedy and seeded) sample
    only their target token; 4 repeats no token of its prompt or output (the model without it
    continues the loop); 0, 3 and 5 get an engine without processors' tokens. With a KV cache
    that preempts, the tokens are the same."""
    plain = summary(_outputs(make_core(default_model_dir, True)))
    core = make_core(default_model_dir, True, logits_processors=BY_NAME)
    with_processors = summary(_outputs(core))
    tight = make_core(
        default_model_dir,
        False,
        logits_processors=BY_NAME,
        max_model_len=64,  # (4 blocks a request, 8 in the cache: 12 requests take turns)
        kv_cache_memory=6 << 20,
    )
    preempted = summary(_outputs(tight))
    assert tight.scheduler.num_preemptions > 0
    assert preempted == with_processors
    for i, (prompt, _) in enumerate(_batch()):  # (each kind twice)
        tokens, _ = with_processors[f"r{i}"]
        assert len(tokens) == 24
        kind = i % 6
        if kind == 1:
            assert tokens == [42] * 24
        elif kind == 2:
            assert tokens == [7] * 24
        elif kind == 4:
            assert len(set(tokens)) == 24 and not set(tokens) & set(prompt), tokens
            assert set(plain[f"r{i}"][0]) & set(prompt), "the model alone repeats the loop"
        else:
            assert tokens == plain[f"r{i}"][0], i


def _outputs(core: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    add_all(core, _batch(), "r")
    return run(core)


def test_argmax_invariant_processors_shape_sampled_requests_only(
    default_model_dir: Path,
) -> None:
    """``ArgmaxOnly`` (argmax-invariant) leaves sampled rows their argmax, so requests at a
    temperature get the greedy tokens; a batch of greedy requests never calls it
    (``LLM(logits_processors=[class])``)."""
    llm = LLM(
        str(default_model_dir), max_model_len=256, dtype="float32", logits_processors=[ArgmaxOnly]
    )
    prompts = [{"prompt_token_ids": LOOP[i:]} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    ArgmaxOnly.calls = 0
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert ArgmaxOnly.calls == 0
    sampled = [SamplingParams(temperature=1.5, seed=s, max_tokens=12) for s in range(3)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)]
    assert ArgmaxOnly.calls >= 12
    assert got == want


def test_processors_refuse_requests_and_configurations(default_model_dir: Path) -> None:
    core = make_core(default_model_dir, False, logits_processors=[TargetToken, NoRepeats])
    with pytest.raises(InvalidRequestError, match="TargetToken: target_token must be a token"):
        core.add_request("bad", LOOP, SamplingParams(extra_args={"target_token": "x"}))
    assert not core.has_unfinished_requests()
    for overrides in (
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        {"num_scheduler_steps": 4},
    ):
        config = EngineConfig(model="m", logits_processors=("a.B",), **overrides)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="neither speculative decoding nor multi"):
            config.validate()
    with pytest.raises(InvalidRequestError, match="does not import"):
        make_core(default_model_dir, False, logits_processors=["no_such_module.Processor"])
