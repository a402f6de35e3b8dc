"""Speculative decoding with a draft model (``--speculative-config '{"model": PATH,
"num_speculative_tokens": K}'``), on the default model. Two drafts: the model itself (its
drafts are the target's own greedy tokens, so nearly all are kept) and an early exit of it
(its first layers, its norm and head: most drafts rejected). Either way greedy requests get
exactly the tokens of an engine without drafts, through chunked prompts, a token budget that
cuts drafts, preemptions, prefix-cache hits and the host KV tier; seeded sampled requests get
the tokens they get without drafts (each position drawn as without them). The draft's KV
follows the target's blocks: with the model as its own draft, drafts stay kept after a
preemption, on prefix-cache hits and after the host tier brought a prefix back."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file
from test_async_scheduling import add_all, make_core, run, summary
from test_spec_decode import GREEDY, LOOP, batch_of_kinds

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.outputs import EngineCoreOutput
from baton_engine.errors import InvalidRequestError
from baton_engine.sampling_params import SamplingParams


def early_exit(model_dir: Path, folder: Path, layers: int, **config: object) -> Path:
    """A draft made of ``model_dir``'s first ``layers`` layers (with its embeddings, final norm
    and head), its config changed by ``config``."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, **config)
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def drafts(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("drafts")
    return {
        "itself": str(default_model_dir),
        "early-exit": str(early_exit(default_model_dir, folder / "exit", 12)),
    }


def spec(model: str, k: int = 3) -> dict[str, object]:
    return {"model": model, "num_speculative_tokens": k}


def engine(model_dir: Path, **overrides: Any) -> EngineCore:
    """``make_core``'s engine (float32, the torch backend, synchronous), any of its settings
    overridden."""
    settings: dict[str, Any] = {
        "dtype": "float32", "max_model_len": 256, "kv_cache_memory": 32 << 20,
        "attention_backend": "torch", **overrides,
    }  # fmt: skip
    return EngineCore(EngineConfig(model=str(model_dir), **settings))


def acceptance(core: EngineCore) -> float:
    sched = core.scheduler
    assert sched.num_draft_tokens > 0
    return sched.num_accepted_tokens / sched.num_draft_tokens


@pytest.fixture(scope="module")
def kinds(default_model_dir: Path) -> tuple[list[tuple[list[int], SamplingParams]], dict]:
    reference = make_core(default_model_dir, False)
    reference.add_request("probe", LOOP, GREEDY)
    batch = batch_of_kinds(summary(run(reference))["probe"][0])
    add_all(reference, batch, "a")
    return batch, summary(run(reference))


@pytest.mark.parametrize("draft", ["itself", "early-exit"])
def test_greedy_and_seeded_tokens_are_those_without_drafts(
    default_model_dir: Path, drafts: dict[str, str], kinds: tuple, draft: str
) -> None:
    """Requests of every kind (penalties, bad words, logprobs, a stop token, min_tokens, a
    logit bias, a seeded sampled one, one with prompt logprobs, which takes no drafts), with a
    budget of 24 tokens a step: the tokens of an engine without drafts."""
    batch, want = kinds
    core = make_core(
        default_model_dir, False, speculative_config=spec(drafts[draft]),
        max_num_batched_tokens=24,
    )  # fmt: skip
    assert not core.async_scheduling
    add_all(core, batch, "a")
    assert summary(run(core)) == want
    if draft == "itself":
        # (its drafts are greedy and unpenalized: the rows with penalties, a bias, bad words
        # or sampling reject some; plain greedy ones keep all, the tests below)
        assert acceptance(core) > 0.6
    else:
        assert acceptance(core) < 0.5


@pytest.mark.parametrize("draft", ["itself", "early-exit"])
def test_preemptions_and_prefix_hits_keep_the_tokens_and_the_drafts(
    default_model_dir: Path, drafts: dict[str, str], draft: str
) -> None:
    """A pool too small for the batch (preempted requests recomputed, the draft's KV with
    them), then the batch again, its prompts found in the prefix cache: the tokens of a run
    without drafts both times; the model as its own draft keeps its drafts in both."""
    batch = [(LOOP[i:], replace(GREEDY, max_tokens=32)) for i in range(6)]
    batch[1::2] = [
        (p, replace(sp, temperature=0.6, top_k=50, seed=i)) for i, (p, sp) in enumerate(batch[1::2])
    ]
    small = {"num_gpu_blocks_override": 20}
    reference = make_core(default_model_dir, False, **small)
    add_all(reference, batch, "a")
    want = summary(run(reference))
    assert reference.scheduler.num_preemptions > 0
    core = make_core(default_model_dir, False, speculative_config=spec(drafts[draft]), **small)
    sched = core.scheduler
    for tag in ("a", "b"):
        drafted, accepted = sched.num_draft_tokens, sched.num_accepted_tokens
        add_all(core, batch, tag)
        assert summary(run(core)) == {tag + k[1:]: v for k, v in want.items()}
        if draft == "itself":  # (the sampled half rejects some)
            kept = (sched.num_accepted_tokens - accepted) / (sched.num_draft_tokens - drafted)
            assert kept > 0.6, (tag, kept)
    assert core.scheduler.num_preemptions > 0 and core.kv.num_prefix_hits > 0


def test_the_host_tier_brings_the_drafts_kv_back(default_model_dir: Path) -> None:
    """A pool of one prompt's blocks and a host tier: A, B, then A again, found in the tier;
    the tier copies the draft's KV of each block with the target's, so the model as its own
    draft still has its drafts kept on the third request."""
    first = LOOP * 5 + list(range(3000, 3200))
    second = list(range(4000, 4300))
    core = engine(
        default_model_dir, speculative_config=spec(str(default_model_dir)),
        max_model_len=448, num_gpu_blocks_override=30, kv_offloading_size=0.05,
    )  # fmt: skip
    params = replace(GREEDY, max_tokens=24)
    outs = []
    for i, prompt in enumerate((first, second, first)):
        sched = core.scheduler
        drafted, accepted = sched.num_draft_tokens, sched.num_accepted_tokens
        core.add_request(f"r{i}", prompt, params)
        outs.append(summary(run(core))[f"r{i}"][0])
        kept = (sched.num_accepted_tokens - accepted) / (sched.num_draft_tokens - drafted)
        assert kept > 0.8, (i, kept)
    assert outs[2] == outs[0]
    assert core.kv.num_host_hits >= 160  # (10 blocks of its 24)


def test_llm_on_the_cpus_defaults(default_model_dir: Path, drafts: dict[str, str]) -> None:
    """``LLM(speculative_config={"model": ...})`` as in vLLM, on the CPU's defaults (bf16, the
    C++ decode layers for the draft's passes too): the greedy tokens and text of an LLM
    without drafts; the draft model is inferred from the model key."""
    from baton_engine.llm import LLM

    prompts = [{"prompt_token_ids": LOOP[i:]} for i in range(3)]
    prompts.append({"prompt_token_ids": list(range(2000, 2030))})
    results = []
    for config in (None, spec(drafts["itself"], k=4)):
        llm = LLM(str(default_model_dir), max_model_len=256, speculative_config=config)
        try:
            outs = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            results.append([(list(o.token_ids), o.text) for o in outs])
            core: EngineCore = llm.engine.core
        finally:
            llm.shutdown()
    assert results[1] == results[0]
    assert acceptance(core) > 0.8


def test_a_draft_runs_to_the_end_of_the_context(
    default_model_dir: Path, drafts: dict[str, str]
) -> None:
    """Requests that reach ``max_model_len``: drafts stop at the last position (their KV's
    room ends there) and the tokens are those without drafts."""
    batch = [(LOOP[i:], replace(GREEDY, max_tokens=200)) for i in range(3)]
    reference = engine(default_model_dir, max_model_len=64)
    add_all(reference, batch, "a")
    want = summary(run(reference))
    assert {finish for _, finish in want.values()} == {"length"}
    core = engine(default_model_dir, max_model_len=64, speculative_config=spec(drafts["itself"], 5))
    add_all(core, batch, "a")
    assert summary(run(core)) == want


def test_no_drafts_while_the_batch_is_large(default_model_dir: Path) -> None:
    """``disable_by_batch_size``: while that many requests run, nothing is drafted (the
    draft does not run); once fewer run, the draft catches up with the tokens it missed and
    drafts again; the tokens are those without drafts."""
    batch = [(LOOP[i:], replace(GREEDY, max_tokens=8 + 24 * (i == 0))) for i in range(3)]
    reference = make_core(default_model_dir, False)
    add_all(reference, batch, "a")
    want = summary(run(reference))
    config = {**spec(str(default_model_dir)), "disable_by_batch_size": 2}
    core = make_core(default_model_dir, False, speculative_config=config)
    add_all(core, batch, "a")
    outputs: dict[str, list[EngineCoreOutput]] = {}
    steps = 0
    while core.scheduler.num_draft_tokens == 0:  # (the three run together: no drafts)
        assert core.has_unfinished_requests()
        for out in core.step():
            outputs.setdefault(out.req_id, []).append(out)
        steps += 1
    assert steps >= 8 and len(core.scheduler.running) == 1
    for req_id, outs in run(core).items():
        outputs.setdefault(req_id, []).extend(outs)
    assert summary(outputs) == want
    assert acceptance(core) > 0.8  # (a0's draft caught up with the tokens it missed)


def test_a_draft_that_cannot_serve_is_refused(default_model_dir: Path, tmp_path: Path) -> None:
    """A draft with a larger vocabulary than the model's, or fewer positions than
    ``max_model_len``; async scheduling, or a draft split otherwise than the model: clear
    errors."""
    bigger = early_exit(default_model_dir, tmp_path / "vocab", 2, vocab_size=50000)
    shorter = early_exit(default_model_dir, tmp_path / "short", 2, max_position_embeddings=128)
    for draft, message in ((bigger, "vocabulary"), (shorter, "max_position_embeddings")):
        with pytest.raises(InvalidRequestError, match=message):
            make_core(default_model_dir, False, speculative_config=spec(str(draft)))
    whole = {**spec(str(bigger)), "draft_tensor_parallel_size": 1}
    for async_scheduling, tp, config, message in (
        (True, 1, spec(str(bigger)), "async scheduling"),
        (False, 2, whole, "split as the model is"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            make_core(
                default_model_dir, async_scheduling, speculative_config=config,
                tensor_parallel_size=tp,
            )  # fmt: skip
