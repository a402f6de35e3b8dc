"""n-gram speculative decoding on the default model: greedy requests get the tokens they get
without drafts (while drafts are proposed and kept), through chunked prompts, a token budget
that cuts drafts, preemptions and prefix-cache hits on blocks that held rejected drafts, with
penalties, bad words, logprobs (each kept draft's), stop strings and structured output;
sampled requests run with drafts, seeded ones with the tokens they get without; requests it
must not touch (prompt logprobs) are served as without it; and ``LLM(speculative_config=...)``
as in vLLM, on the CPU's default kernels."""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import pytest
from test_async_scheduling import SYSTEM, add_all, make_core, run, summary

from baton_engine.core.engine_core import EngineCore
from baton_engine.core.outputs import EngineCoreOutput
from baton_engine.sampling_params import SamplingParams, StructuredOutputsParams

# Prompts that repeat a run of tokens: the model tends to continue the pattern, which n-gram
# drafts then predict.
LOOP = list(range(1000, 1012)) * 3
PAIRS = [1000, 1001] * 16
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def batch_of_kinds(probe: list[int]) -> list[tuple[list[int], SamplingParams]]:
    """Greedy requests of several lengths and kinds, a seeded sampled one, and the kind
    speculation leaves alone."""
    stop = next(t for t in probe[8:] if t not in probe[:8])
    return [
        (LOOP, GREEDY),
        (LOOP[:30], replace(GREEDY, max_tokens=1)),
        (LOOP[5:], replace(GREEDY, max_tokens=2)),
        (LOOP[3:], replace(GREEDY, max_tokens=7)),
        (LOOP, replace(GREEDY, stop_token_ids=[stop])),  # stops inside kept drafts, likely
        (LOOP[1:], replace(GREEDY, min_tokens=5, ignore_eos=False)),
        (LOOP[2:], replace(GREEDY, logit_bias={probe[3]: 2.0})),  # greedy through the sampler
        (LOOP[9:], replace(GREEDY, logprobs=3)),  # (each kept draft's)
        ([*SYSTEM, *LOOP[:20]], replace(GREEDY, prompt_logprobs=2)),  # (no drafts)
        # (drafted: each token drawn with the seed of its index, the tokens of no drafts)
        (LOOP, SamplingParams(temperature=0.7, top_k=50, seed=7, max_tokens=20)),
        # penalties and bad words: each draft's row penalized by the output and drafts before it
        (LOOP[4:], replace(GREEDY, repetition_penalty=1.3)),
        (LOOP[6:], replace(GREEDY, frequency_penalty=0.4, presence_penalty=0.3)),
        # a loop of period 2: the drafts repeat tokens, which a row's history must count
        # (0.8 and 1.5 leave the loop at a draft's row: tokens change if that row's history
        # lacks the drafts before it)
        *[(PAIRS, replace(GREEDY, frequency_penalty=f)) for f in (0.5, 0.8, 1.5, -0.5)],
        (PAIRS, replace(GREEDY, presence_penalty=0.8)),
        (LOOP[7:], replace(GREEDY, bad_words_token_ids=[probe[4:6]])),
    ]


Kinds = tuple[list[tuple[list[int], SamplingParams]], dict[str, list[EngineCoreOutput]]]


@pytest.fixture(scope="module")
def kinds(default_model_dir: Path) -> Kinds:
    """``batch_of_kinds`` and its outputs without drafts (one pass a step, synchronous)."""
    reference = make_core(default_model_dir, False)
    reference.add_request("probe", LOOP, GREEDY)
    probe = summary(run(reference))["probe"][0]
    batch = batch_of_kinds(probe)
    add_all(reference, batch, "a")
    return batch, run(reference)


def test_greedy_tokens_are_those_without_drafts(default_model_dir: Path, kinds: Kinds) -> None:
    batch, outputs = kinds
    want = summary(outputs)
    assert want["a4"][1] == "stop"
    # a small token budget: prompts in chunks beside decodes, drafts cut to fit
    core = make_core(default_model_dir, False, speculative_config=SPEC, max_num_batched_tokens=24)
    add_all(core, batch, "a")
    got = run(core)
    assert summary(got) == want
    want_lp, got_lp = (
        [lp for o in outs["a7"] for lp in o.new_logprobs or ()] for outs in (outputs, got)
    )
    assert len(got_lp) == 40 and [lp.token_ids for lp in got_lp] == [lp.token_ids for lp in want_lp]
    values = [[v for lp in lps for v in lp.logprobs] for lps in (got_lp, want_lp)]
    assert values[0] == pytest.approx(values[1], abs=1e-4)
    assert [lp.rank for lp in got_lp] == [lp.rank for lp in want_lp]
    sched = core.scheduler
    assert sched.num_accepted_tokens > 20 and sched.num_draft_tokens > sched.num_accepted_tokens
    assert core.num_generated_tokens == sum(len(t) for t, _ in want.values())
    stats = core.stats()
    assert stats.num_accepted_tokens == sched.num_accepted_tokens
    assert sum(stats.num_accepted_per_pos) == stats.num_accepted_tokens


@pytest.mark.parametrize("budget", [None, 24])
def test_async_scheduling_drafts_after_the_pending_token(
    default_model_dir: Path, kinds: Kinds, budget: int | None
) -> None:
    """With async scheduling a decoding request's last token is still on the device when its
    next step is scheduled: its drafts follow a guess of that token (what followed its latest
    n-gram match), its first row takes the token from the device, and the step after is not
    run ahead of it. Every kind of request gets the tokens of a synchronous run without
    drafts (whole steps and a budget that chunks prompts and cuts drafts)."""
    batch, outputs = kinds
    core = make_core(
        default_model_dir, True, speculative_config=SPEC, max_num_batched_tokens=budget
    )
    add_all(core, batch, "a")
    assert summary(run(core)) == summary(outputs)
    sched = core.scheduler
    assert sched.num_guessed_drafts > 0 and sched.num_accepted_tokens > 20
    # only requests that never wait for the host (the kinds above that do keep steps
    # synchronous while they run): several pending at once, each with its drafts
    plain = [(LOOP[i:], replace(GREEDY, max_tokens=12 + 5 * i)) for i in range(6)]
    reference = make_core(default_model_dir, False)
    add_all(reference, plain, "p")
    add_all(core, plain, "p")
    guessed = sched.num_guessed_drafts
    assert summary(run(core)) == summary(run(reference))
    assert sched.num_guessed_drafts > guessed


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemptions_and_prefix_hits_keep_the_tokens(
    default_model_dir: Path, async_scheduling: bool
) -> None:
    """A pool too small for the batch: requests are preempted and recomputed (with async
    scheduling too, drafts then following pending tokens); then the same batch again,
    whose prompts hit the blocks the first run left in the prefix cache (blocks that held
    rejected drafts included): the tokens of a run without drafts, both times (seeded
    sampled requests among them: a resumed one draws each token by its index)."""
    batch = [(LOOP[i:], replace(GREEDY, max_tokens=32)) for i in range(6)]
    seeded = [
        (p, replace(sp, temperature=0.6, top_k=50, seed=i)) for i, (p, sp) in enumerate(batch[1::2])
    ]
    batch[1::2] = seeded
    small = {"num_gpu_blocks_override": 20}
    reference = make_core(default_model_dir, False, **small)
    add_all(reference, batch, "a")
    want = summary(run(reference))
    assert reference.scheduler.num_preemptions > 0
    core = make_core(default_model_dir, async_scheduling, speculative_config=SPEC, **small)
    for tag in ("a", "b"):
        add_all(core, batch, tag)
        got = summary(run(core))
        assert got == {tag + k[1:]: v for k, v in want.items()}
    assert core.scheduler.num_preemptions > 0 and core.scheduler.num_accepted_tokens > 0
    assert core.kv.num_prefix_hits > 0
    assert (core.scheduler.num_guessed_drafts > 0) == async_scheduling


def test_sampled_requests_run_with_drafts(default_model_dir: Path) -> None:
    """Temperature, top-k, top-p, min-p and a penalty with drafts: each request gets its max_tokens,
    near-greedy sampling keeps most drafts, and a seeded request gets the tokens it gets
    without speculation."""
    core = make_core(default_model_dir, False, speculative_config=SPEC)
    kinds = [
        SamplingParams(temperature=0.3, max_tokens=40, ignore_eos=True),
        SamplingParams(
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            presence_penalty=0.5,
            max_tokens=40,
            ignore_eos=True,
        ),
        SamplingParams(temperature=1.0, min_p=0.1, max_tokens=40, ignore_eos=True),
    ]
    # (top_k: a draw landing in the vocabulary's tail, tokens of ~1e-7 each, picks among
    # neighbours whose boundaries move with the logits' last bits, which differ between the
    # batch shapes with and without drafts on some CPUs' float32 kernels)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=30, ignore_eos=True)
    batch = [(LOOP, params) for params in kinds] + [(LOOP, seeded)]
    add_all(core, batch, "s")
    got = summary(run(core))
    assert all(len(tokens) == 40 for tokens, _ in list(got.values())[:3])
    sched = core.scheduler
    assert sched.num_accepted_tokens > sched.num_draft_tokens / 4
    alone = make_core(default_model_dir, False)
    add_all(alone, [(LOOP, seeded)], "s")
    assert summary(run(alone))["s0"] == got["s3"]


def test_llm_takes_vllms_speculative_config(default_model_dir: Path) -> None:
    """On the CPU's defaults (bf16, the C++ decode layers, which run a step of drafts as one
    decode row per token): the greedy tokens of an engine without drafts; a stop string that
    a token in the middle of a step's tokens completes ends the output at that token, text and
    tokens as without drafts."""
    from baton_engine.llm import LLM

    prompts = [{"prompt_token_ids": LOOP[i:]} for i in range(3)]
    llms = [
        LLM(str(default_model_dir), max_model_len=256, speculative_config=spec)
        for spec in (None, SPEC)
    ]
    core: EngineCore = llms[1].engine.core
    assert core.scheduler.proposer is not None and not core.async_scheduling
    # the drafted engine's steps for the first prompt: a token inside one of several tokens
    core.add_request("probe", LOOP, GREEDY)
    steps = [o.new_token_ids for o in run(core)["probe"]]
    tokens = [t for step in steps for t in step]
    ends = list(accumulate(len(step) for step in steps))
    inside = next(e - 2 for e, step in zip(ends, steps, strict=True) if len(step) > 1 and e > 8)
    text = llms[0].generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].text
    cut = len(llms[0].get_tokenizer().decode(tokens[: inside + 1]))
    # the last 3 characters of the text up to that token, where they first occur
    stop = next(text[i - 3 : i] for i in range(cut, 3, -1) if text.find(text[i - 3 : i]) == i - 3)
    stopped = replace(GREEDY, stop=[stop])
    results = []
    for llm in llms:
        outs = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        outs += [o.outputs[0] for o in llm.generate(prompts[:1], stopped, use_tqdm=False)]
        results.append([(list(o.token_ids), o.text, o.finish_reason, o.stop_reason) for o in outs])
    assert results[1] == results[0]
    assert results[0][0][0] == tokens
    assert results[0][3][2:] == ("stop", stop) and len(results[0][3][0]) == inside + 1
    assert core.scheduler.num_accepted_tokens > 0


def test_drafts_follow_the_grammar(default_model_dir: Path, tokenizer: object) -> None:
    """Structured output with drafts: the drafts its grammar forbids are cut before the step,
    each draft's row is masked as after the drafts before it: greedy requests get the tokens
    of a run without drafts, sampled ones output that follows the grammar."""
    import json
    import re

    colors = {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 6,
        "maxItems": 8,
    }
    schema = {"type": "object", "properties": {"colors": colors}, "required": ["colors"]}
    pattern = r"(ab|cd){6,20}x"
    constraints = [
        StructuredOutputsParams(regex=pattern),
        StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        StructuredOutputsParams(choice=["one two one two one two", "three"]),
    ]
    batch = [
        (LOOP[i:], replace(GREEDY, max_tokens=48, ignore_eos=False, structured_outputs=so))
        for i, so in enumerate(constraints)
    ]
    sampled = SamplingParams(temperature=0.8, max_tokens=48, structured_outputs=constraints[0])
    want = summary(run_core(make_core(default_model_dir, False), batch))
    core = make_core(default_model_dir, False, speculative_config=SPEC)
    got = run_core(core, [*batch, (LOOP, sampled)])
    assert {k: v for k, v in summary(got).items() if k != "a3"} == want
    decode = tokenizer.decode  # type: ignore[attr-defined]
    assert re.fullmatch(pattern, decode(want["a0"][0], skip_special_tokens=True))
    assert len(json.loads(decode(want["a1"][0], skip_special_tokens=True))["colors"]) >= 6
    assert re.fullmatch(pattern, decode(summary(got)["a3"][0], skip_special_tokens=True))
    assert core.scheduler.num_accepted_tokens > 0


def run_core(
    core: EngineCore, batch: list[tuple[list[int], SamplingParams]]
) -> dict[str, list[EngineCoreOutput]]:
    add_all(core, batch, "a")
    return run(core)
