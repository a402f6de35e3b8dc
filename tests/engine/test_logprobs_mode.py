"""vLLM's ``--logprobs-mode`` on the default model: ``processed_logprobs`` report the
distribution each token is drawn from (a top-k of 5 leaves five tokens that carry all of it; a
logit bias that forces a token gives it all of it), through speculative decoding's kept drafts
as without drafts; ``raw_logits`` report the model's logits; the tokens are those of the default
mode in every mode; ``LLM(logprobs_mode=...)`` takes it as vLLM's does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_async_scheduling import add_all, make_core, run, summary

from baton import LLM
from baton_engine.core.outputs import EngineCoreOutput
from baton_engine.sampling_params import SamplingParams

LOOP = list(range(1000, 1012)) * 3
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}  # fmt: skip
BIASED = 4321  # (a token the model does not pick by itself after LOOP)
BATCH = [
    (LOOP, SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=12, logprobs=5)),
    (
        LOOP[2:],
        SamplingParams(temperature=0.0, logit_bias={BIASED: 100.0}, max_tokens=4, logprobs=1),
    ),
    (
        LOOP[4:],
        SamplingParams(
            temperature=0.0, repetition_penalty=1.5, max_tokens=16, ignore_eos=True, logprobs=3
        ),
    ),
]
Outputs = dict[str, list[EngineCoreOutput]]


def _run(model_dir: Path, **overrides: object) -> Outputs:
    core = make_core(model_dir, False, **overrides)
    add_all(core, BATCH, "r")
    return run(core)


def _logprobs(outputs: Outputs, req_id: str) -> list[tuple[list[int], list[float]]]:
    return [(lp.token_ids, lp.logprobs) for o in outputs[req_id] for lp in o.new_logprobs or ()]


@pytest.fixture(scope="module")
def raw(default_model_dir: Path) -> Outputs:
    return _run(default_model_dir)


@pytest.fixture(scope="module")
def processed(default_model_dir: Path) -> Outputs:
    return _run(default_model_dir, logprobs_mode="processed_logprobs")


def test_processed_logprobs_are_the_distribution_tokens_are_drawn_from(
    raw: Outputs, processed: Outputs
) -> None:
    assert summary(processed) == summary(raw)
    # top-k 5: the five tokens kept hold all the probability (the model's own, a fraction)
    for outputs, total in ((processed, 1.0), (raw, None)):
        for ids, values in _logprobs(outputs, "r0"):
            assert ids[0] in ids[1:]
            mass = sum(math.exp(v) for v in values[1:])
            if total is None:
                assert mass < 0.999
            else:
                assert mass == pytest.approx(total, abs=1e-4)
    # a bias of +100: the token is certain after it, not in the model's own distribution
    assert summary(raw)["r1"][0] == [BIASED] * 4
    assert all(values[0] > -1e-4 for _, values in _logprobs(processed, "r1"))
    assert all(values[0] < -1.0 for _, values in _logprobs(raw, "r1"))
    # the penalty changes the reported values of the greedy tokens
    pairs = zip(_logprobs(processed, "r2"), _logprobs(raw, "r2"), strict=True)
    gaps = [abs(a - b) for (_, p), (_, r) in pairs for a, b in zip(p, r, strict=True)]
    assert max(gaps) > 1e-2


def test_kept_drafts_report_the_processed_logprobs_of_no_drafts(
    default_model_dir: Path, processed: Outputs
) -> None:
    core = make_core(
        default_model_dir, False, logprobs_mode="processed_logprobs", speculative_config=SPEC
    )
    add_all(core, BATCH, "r")
    drafted = run(core)
    assert summary(drafted) == summary(processed)
    assert core.scheduler.num_accepted_tokens > 5
    for req_id in ("r0", "r1", "r2"):  # (the seeded one draws each token as without drafts)
        got, want = _logprobs(drafted, req_id), _logprobs(processed, req_id)
        assert [ids for ids, _ in got] == [ids for ids, _ in want]
        assert [v for _, vs in got for v in vs] == pytest.approx(
            [v for _, vs in want for v in vs], abs=1e-4
        )


def test_raw_logits_are_the_logprobs_before_normalizing(
    default_model_dir: Path, raw: Outputs
) -> None:
    logits = _run(default_model_dir, logprobs_mode="raw_logits")
    assert summary(logits) == summary(raw)
    for (ids, values), (raw_ids, raw_values) in zip(
        _logprobs(logits, "r2"), _logprobs(raw, "r2"), strict=True
    ):
        assert ids == raw_ids
        # logit - logprob is the same for every token of a position: log of the partition sum
        shifts = [v - r for v, r in zip(values, raw_values, strict=True)]
        assert max(shifts) - min(shifts) < 1e-3 and min(shifts) > 1.0


def test_llm_takes_vllms_logprobs_mode(default_model_dir: Path) -> None:
    """``LLM(..., logprobs_mode="processed_logprobs")`` as in vLLM: a top-k of 3 leaves three
    tokens, each entry's logprobs sum to one."""
    llm = LLM(str(default_model_dir), max_model_len=256, kv_cache_memory=64 << 20,
              logprobs_mode="processed_logprobs")  # fmt: skip
    params = SamplingParams(temperature=1.0, top_k=3, seed=1, max_tokens=4, logprobs=3)
    (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    entries = out.outputs[0].logprobs
    assert entries is not None and len(entries) == 4
    for token_id, entry in zip(out.outputs[0].token_ids, entries, strict=True):
        assert token_id in entry
        assert sum(math.exp(lp.logprob) for lp in entry.values()) == pytest.approx(1.0, abs=1e-4)
