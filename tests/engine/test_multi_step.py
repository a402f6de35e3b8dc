"""Multi-step scheduling (``--num-scheduler-steps``): a step whose requests are all plain decodes
runs several forward passes, each pass's input the token the pass before sampled. Whatever the
requests ask for, the tokens must equal those of one pass a step; stops inside a run drop the
later passes' tokens; a request that could be admitted is not held back by a run; the pool ends
whole."""

from __future__ import annotations

import argparse
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import pytest
from test_async_scheduling import SYSTEM, add_all, make_core, run, summary, workload

from baton_engine.arg_utils import add_engine_args, engine_kwargs_from_args
from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.outputs import EngineCoreOutput
from baton_engine.errors import InvalidRequestError
from baton_engine.sampling_params import SamplingParams


def test_every_kind_of_request_gives_the_tokens_of_single_steps(default_model_dir: Path) -> None:
    """The async-scheduling workload (stop token mid-way, max_tokens 1, seeded top-p sampling,
    a repetition penalty, logprobs, min_tokens, EOS), plain greedy requests of several
    lengths and a long seeded sampled one: the requests that read their tokens on the host
    run single steps while they are there, the rest then multi-steps; with async scheduling
    and without."""
    reference = make_core(default_model_dir, False)
    probe_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference.add_request("probe", [*SYSTEM, 10], probe_params)
    probe = summary(run(reference))["probe"][0]
    # request 2 stops on a token that first comes late (inside a run, most likely)
    at = next(i for i in range(9, 24) if probe[i] not in probe[:i])
    batch = workload(probe[at])
    batch += [
        ([*SYSTEM, 60 + i], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for i, n in enumerate((1, 2, 5, 17, 30))
    ]
    # greedy, but through the sampler: its logits reshaped the same in every pass
    reshaped = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    batch += [
        ([*SYSTEM, 70], replace(reshaped, logit_bias={probe[2]: 4.0, probe[5]: -3.0})),
        ([*SYSTEM, 71], replace(reshaped, allowed_token_ids=probe[:6])),
    ]
    # seeded sampling through runs: each pass draws with the seed of its token's index (top-k:
    # the inverse CDF's draw in the tail of ~1e-7 tokens would flip with the last bits of
    # logits that differ between batches)
    params = SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=30)
    batch.append(([*SYSTEM, 72], params))
    # the probe's prompt with probe[k] banned right after probe[k - 1], late (when the requests
    # that read their tokens on the host are done): bad words read the output on the host,
    # which a pass of a run, or a step run ahead, would not have
    k = next(i for i in range(19, 4, -1) if probe[i - 1 : i + 1] not in _pairs(probe[:i]))
    banned = replace(reshaped, bad_words_token_ids=[probe[k - 1 : k + 1]])
    batch.append(([*SYSTEM, 10], banned))
    add_all(reference, batch, "a")
    want = summary(run(reference))
    assert want["a2"] == (probe[: at + 1], "stop")
    bad = want[f"a{len(batch) - 1}"][0]
    assert bad[:k] == probe[:k] and bad[k] != probe[k]
    for async_scheduling in (False, True):
        core = make_core(default_model_dir, async_scheduling, num_scheduler_steps=4)
        add_all(core, batch, "a")
        got = run(core)
        assert summary(got) == want
        assert core.scheduler.num_multi_steps > 0
        assert core.num_generated_tokens == sum(len(tokens) for tokens, _ in want.values())


def _pairs(tokens: list[int]) -> list[list[int]]:
    return [tokens[i : i + 2] for i in range(len(tokens) - 1)]


def test_tokens_come_k_at_a_time_and_a_stop_drops_the_rest(default_model_dir: Path) -> None:
    """One greedy request alone: after its prompt's token, steps of 4 passes bring 4 tokens
    each, the last step the remainder of max_tokens; a stop token in the middle of a run ends
    the request there and its later tokens are not reported."""
    params = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    core = make_core(default_model_dir, False, num_scheduler_steps=4)
    core.add_request("g", [*SYSTEM, 70], params)
    outs = run(core)["g"]
    assert [len(o.new_token_ids) for o in outs] == [1, 4, 4, 4, 2]
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    tokens = [t for o in outs for t in o.new_token_ids]
    at = next(i for i in range(6, 15) if i % 4 != 0 and tokens[i] not in tokens[:i])
    stop = SamplingParams(
        temperature=0.0, max_tokens=15, stop_token_ids=[tokens[at]], ignore_eos=True
    )
    for async_scheduling in (False, True):
        core = make_core(default_model_dir, async_scheduling, num_scheduler_steps=4)
        core.add_request("s", [*SYSTEM, 70], stop)
        got = summary(run(core))["s"]
        assert got == (tokens[: at + 1], "stop")


def test_a_request_that_can_be_admitted_does_not_wait_for_a_run(
    default_model_dir: Path,
) -> None:
    """With room in the batch, a new request is admitted at the next step (one pass); with the
    batch full, waiting requests do not stop the running ones from multi-stepping."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    core = make_core(default_model_dir, False, num_scheduler_steps=8, max_num_seqs=2)
    core.add_request("a", [*SYSTEM, 80], params)
    core.step()  # its prompt
    core.step()
    assert core.scheduler.num_multi_steps == 1
    core.add_request("b", [*SYSTEM, 81], params)
    outs = {o.req_id: o for o in core.step()}
    assert len(outs["b"].new_token_ids) == 1 and len(outs["a"].new_token_ids) == 1
    core.add_request("c", [*SYSTEM, 82], params)  # the batch is full: c waits
    outs = {o.req_id: o for o in core.step()}
    assert "c" not in outs
    assert [len(outs[r].new_token_ids) for r in "ab"] == [8, 8]
    got = summary(run(core))
    assert [len(got[r][0]) for r in "abc"] == [40 - 18, 40 - 9, 40]


def test_aborts_and_preemption_give_the_tokens_of_single_steps(default_model_dir: Path) -> None:
    """Requests aborted between runs and a pool too small for every request at once (runs
    stop while blocks are short; requests are preempted and recomputed): the tokens equal one
    pass a step's."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = []
    for steps in (1, 4):
        core = make_core(
            default_model_dir, True, num_gpu_blocks_override=18, num_scheduler_steps=steps
        )
        for i in range(6):
            core.add_request(f"c{i}", [40 + i, 41, 42] * 12, params)
        results.append(summary(run(core)))
        assert core.scheduler.num_preemptions > 0
        assert (core.scheduler.num_multi_steps > 0) == (steps > 1)
    assert results[1] == results[0]
    abort = {"b1": 3, "b3": 9}
    params = replace(params, max_tokens=16)
    aborted: list[dict[str, list[EngineCoreOutput]]] = []
    for steps in (1, 4):
        core = make_core(default_model_dir, True, num_scheduler_steps=steps)
        for i in range(4):
            core.add_request(f"b{i}", [*SYSTEM, 30 + i], params)
        aborted.append(run(core, abort))
    want, got = summary(aborted[0]), summary(aborted[1])
    for req_id in ("b0", "b2"):
        assert got[req_id] == want[req_id]
    for req_id, n in abort.items():  # ended by the abort: both prefixes of one sequence
        a, b = got[req_id][0], want[req_id][0]
        assert a[: len(b)] == b[: len(a)]
        assert len(a) >= n and got[req_id][1] is None


def test_a_stop_string_inside_a_run_ends_the_output_there(default_model_dir: Path) -> None:
    """Stop strings run multi-steps too: ``LLM`` matches them token by token in a step's
    several tokens and ends the output at the token that completes one (text, tokens, reason
    and matched string as with one pass a step), here one completed inside a run of 4."""
    from baton_engine.llm import LLM

    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = {"prompt_token_ids": [*SYSTEM, 77]}
    llms = [
        LLM(str(default_model_dir), max_model_len=256, num_scheduler_steps=steps)
        for steps in (1, 4)
    ]
    core: EngineCore = llms[1].engine.core
    core.add_request("probe", [*SYSTEM, 77], greedy)
    steps = [o.new_token_ids for o in run(core)["probe"]]
    assert [len(step) for step in steps] == [1, 4, 4, 4, 4, 3]
    tokens = [t for step in steps for t in step]
    inside = 6  # the third token of the second run of 4
    text = llms[0].generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
    cut = len(llms[0].get_tokenizer().decode(tokens[: inside + 1]))
    # the last 3 characters of the text up to that token, where they first occur
    stop = next(text[i - 3 : i] for i in range(cut, 3, -1) if text.find(text[i - 3 : i]) == i - 3)
    stopped = replace(greedy, stop=[stop])
    results = []
    for llm in llms:
        multi = llm.engine.core.scheduler.num_multi_steps
        out = llm.generate([prompt], stopped, use_tqdm=False)[0].outputs[0]
        results.append((list(out.token_ids), out.text, out.finish_reason, out.stop_reason))
        assert (llm.engine.core.scheduler.num_multi_steps > multi) == (llm is llms[1])
    assert results[1] == results[0]
    assert results[0][2:] == ("stop", stop) and tokens[: len(results[0][0])] == results[0][0]
    assert len(results[0][0]) <= inside + 1 and text.startswith(results[0][1])
    assert len(results[0][0]) not in accumulate(len(step) for step in steps)  # inside a run


def test_host_bound_sampling_runs_one_pass_a_step(default_model_dir: Path) -> None:
    """Penalties and logprobs read the request's tokens on the host: such requests never run
    several passes."""
    core = make_core(default_model_dir, True, num_scheduler_steps=4)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=12, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True),
    ]
    for i, params in enumerate(kinds):
        core.add_request(f"h{i}", [*SYSTEM, 90 + i], params)
        outs = run(core)[f"h{i}"]
        assert all(len(o.new_token_ids) == 1 for o in outs)
    assert core.scheduler.num_multi_steps == 0


def test_num_scheduler_steps_flag_and_validation() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--num-scheduler-steps", "8"])
    assert engine_kwargs_from_args(args)["num_scheduler_steps"] == 8
    assert EngineConfig().num_scheduler_steps == 1
    with pytest.raises(InvalidRequestError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=0).validate()


def test_engine_core_rejects_zero_steps(default_model_dir: Path) -> None:
    with pytest.raises(InvalidRequestError):
        EngineCore(EngineConfig(model=str(default_model_dir), num_scheduler_steps=0))
