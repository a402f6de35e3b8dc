"""n-gram speculative decoding without a model: the drafts proposed, the scheduler's drafts and
their rollback, the check of drafts (greedy: the argmax's prefix; sampled: rejection sampling
that leaves each token distributed as the model's), and vLLM's --speculative-config."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from baton_engine.config import EngineConfig, SpeculativeConfig
from baton_engine.core.outputs import ModelRunnerOutput
from baton_engine.core.scheduler import Scheduler
from baton_engine.errors import InvalidRequestError
from baton_engine.kv_cache import KVCacheManager
from baton_engine.request import Request
from baton_engine.sampler import draw, draw_seed
from baton_engine.sampling_params import SamplingParams
from baton_engine.spec_decode import NgramProposer, draft_rows, kept_tokens, propose_ngram, verify


def ngram(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    return propose_ngram(np.asarray(tokens, dtype=np.int64), lo, hi, k)


def test_drafts_follow_the_latest_earlier_copy_of_the_longest_suffix() -> None:
    # suffix [2, 3] occurred at 1..2 (then 9) and 5..6 (then 4, 2): the latest wins
    assert ngram([1, 2, 3, 9, 5, 2, 3, 4, 2, 3], 1, 3, 2) == [4, 2]
    # the 3-gram [1, 2, 3] occurred only early: longer beats later
    assert ngram([1, 2, 3, 7, 8, 0, 2, 3, 5, 1, 2, 3], 1, 3, 3) == [7, 8, 0]
    # but not beyond prompt_lookup_max: the 2-gram's latest copy then
    assert ngram([1, 2, 3, 7, 8, 0, 2, 3, 5, 1, 2, 3], 1, 2, 3) == [5, 1, 2]
    # fewer than k tokens follow the match: those there are
    assert ngram([5, 6, 5], 1, 2, 4) == [6, 5]
    # no suffix of prompt_lookup_min tokens occurred before
    assert ngram([1, 2, 3, 4, 3], 2, 3, 2) == []
    assert ngram([1, 2, 3, 4, 3], 1, 3, 2) == [4, 3]
    assert ngram([7], 1, 1, 3) == []


def test_the_proposer_follows_a_request_as_it_grows() -> None:
    request = Request("r", [4, 5, 6, 4], SamplingParams(max_tokens=20), max_tokens=20)
    proposer = NgramProposer(1, 2, 3)
    assert proposer.propose(request, 8) == [5, 6, 4]
    assert proposer.propose(request, 1) == [5]  # capped by the caller's room
    request.output_token_ids += [5, 6, 9, *range(100, 180)]  # its buffer must grow
    request.output_token_ids += [5, 6]
    assert proposer.propose(request, 8) == [9, 100, 101]
    proposer.forget("r")
    assert proposer.propose(request, 0) == []


def test_draft_rows_place_each_requests_drafts_after_its_token() -> None:
    starts, rows = draft_rows([2, 0, 3])
    assert starts.tolist() == [0, 3, 4, 8]
    assert rows.tolist() == [0, 1, 4, 5, 6]


def test_greedy_keeps_the_drafts_the_argmax_agrees_with_then_the_argmax() -> None:
    drafts = [[11, 12, 13], [21], [31, 32]]
    #           rows:  0   1   2   3 | 4   5 | 6   7   8
    argmax = torch.tensor([11, 12, 99, 77, 5, 6, 30, 1, 2])
    _, rows = draft_rows([len(d) for d in drafts])
    accept, target = verify(
        torch.tensor([t for d in drafts for t in d]), torch.from_numpy(rows), argmax, None
    )
    tokens = kept_tokens(drafts, accept.tolist(), target.tolist())
    assert tokens == [[11, 12, 99], [5], [30]]


def test_rejection_sampling_gives_the_models_distribution() -> None:
    """Each of N requests drafts token 1 then token 2 at two positions with distributions p
    and r, and a third position (after both) with distribution s. The first token must be
    distributed as p whatever the draft, the draft kept with probability p[1], and the second
    token, given the first, as r (and the one after two kept drafts as s): within 4 standard
    errors of N = 200,000 draws."""
    torch.manual_seed(0)
    n = 200_000
    p = torch.tensor([0.1, 0.5, 0.15, 0.25])
    r = torch.tensor([0.3, 0.05, 0.6, 0.05])
    s = torch.tensor([0.7, 0.1, 0.1, 0.1])
    probs = torch.stack([p, r, s]).repeat(n, 1)
    drafts = torch.tensor([1, 2]).repeat(n)
    _, rows = draft_rows([2] * n)
    accept, target = verify(drafts, torch.from_numpy(rows), None, probs.clone(), None)
    tokens = kept_tokens([[1, 2]] * n, accept.tolist(), target.tolist())
    first = torch.tensor([t[0] for t in tokens])
    assert_distributed(first, p)
    kept_first = torch.tensor([len(t) > 1 for t in tokens])
    assert abs(kept_first.float().mean().item() - p[1].item()) < 4 * (0.25 / n) ** 0.5
    second = torch.tensor([t[1] for t in tokens if t[0] == 1])  # (only after a kept draft)
    assert_distributed(second, r)
    third = torch.tensor([t[2] for t in tokens if len(t) == 3])
    assert_distributed(third, s)


def assert_distributed(draws: torch.Tensor, probs: torch.Tensor) -> None:
    freq = torch.bincount(draws, minlength=len(probs)).double() / len(draws)
    err = (probs.double() * (1 - probs.double()) / len(draws)).sqrt()
    assert ((freq - probs.double()).abs() <= 4 * err + 1e-9).all(), (freq, probs)


def test_greedy_rows_among_sampled_ones_stay_greedy() -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
    greedy_ids = torch.tensor([2, 0, 2, 2])
    greedy_rows = torch.tensor([False, False, True, True])
    drafts = [[1], [2]]  # request 0 samples (its draft certain), request 1 is greedy
    _, rows = draft_rows([1, 1])
    accept, target = verify(
        torch.tensor([1, 2]), torch.from_numpy(rows), greedy_ids, probs, greedy_rows
    )
    tokens = kept_tokens(drafts, accept.tolist(), target.tolist())
    assert tokens[0][0] == 1 and len(tokens[0]) == 2  # p(draft) = 1: always kept
    assert tokens[1] == [2, 2]


def test_seeded_rows_keep_the_tokens_they_draw_without_drafts() -> None:
    """A seeded request's rows draw with the seeds of their tokens' indices: the drafts it
    keeps and the token after them are the tokens it samples without drafts, one at a time,
    whichever drafts are proposed (each one right, then one wrong)."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(4, 50, generator=gen), dim=1)  # positions 5..8
    seeds = {j: draw_seed(99, 5 + j) for j in range(4)}
    alone = [int(draw(probs[j : j + 1].clone(), {0: seeds[j]})) for j in range(4)]
    _, rows = draft_rows([3])
    for right in range(4):
        drafts = alone[:3]
        if right < 3:
            drafts[right] = (drafts[right] + 1) % 50
        accept, target = verify(
            torch.tensor(drafts), torch.from_numpy(rows), None, probs.clone(), None, seeds
        )
        (tokens,) = kept_tokens([drafts], accept.tolist(), target.tolist())
        assert tokens == alone[: right + 1]


# --- the scheduler ------------------------------------------------------------------------------


def spec_scheduler(budget: int = 512, **spec: int) -> Scheduler:
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, **spec})
    return Scheduler(
        KVCacheManager(64, 4),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=256,
        speculative=config,
    )


def test_the_scheduler_drafts_within_max_tokens_and_rolls_back_rejected_drafts() -> None:
    sched = spec_scheduler(prompt_lookup_min=1, prompt_lookup_max=2)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    request = Request("r", prompt, SamplingParams(max_tokens=6), max_tokens=6)
    sched.add_request(request)
    so = sched.schedule()  # the prompt
    assert so.spec_token_ids == {} and so.num_scheduled_tokens == {"r": 8}
    sched.update_from_output(so, ModelRunnerOutput({"r": 4}))
    so = sched.schedule()  # [.., 2, 3, 4]: [3, 4] occurred before, followed by 5, 1, 2
    assert so.spec_token_ids == {"r": [5, 1, 2]} and so.num_scheduled_tokens == {"r": 4}
    assert request.num_computed_tokens == 12
    # the model kept 5, rejected 1 and gave 9 instead
    (out,) = sched.update_from_output(so, ModelRunnerOutput({}, spec_token_ids={"r": [5, 9]}))
    assert out.new_token_ids == [5, 9] and not out.finished
    assert request.output_token_ids == [4, 5, 9] and request.num_computed_tokens == 10
    so = sched.schedule()  # 9 is new: no draft
    assert so.spec_token_ids == {} and so.num_scheduled_tokens == {"r": 1}
    sched.update_from_output(so, ModelRunnerOutput({"r": 4}))
    # [.., 9, 4]: 4 occurred, followed by 5, 9; with 2 tokens left, one draft and one more
    so = sched.schedule()
    assert so.spec_token_ids == {"r": [5]}
    (out,) = sched.update_from_output(so, ModelRunnerOutput({}, spec_token_ids={"r": [5, 6]}))
    assert out.new_token_ids == [5, 6] and out.finish_reason == "length"
    assert sched.num_draft_tokens == 4 and sched.num_accepted_tokens == 2
    assert sched.num_accepted_per_pos == [2, 0, 0]
    sched.check_invariants()


def test_drafts_fit_the_token_budget_and_stop_at_a_stop_token() -> None:
    """The prompt's last token (its chunk of one) already takes drafts; the kept ones after a
    stop token are dropped."""
    sched = spec_scheduler(budget=3, prompt_lookup_min=1, prompt_lookup_max=1)
    params = SamplingParams(max_tokens=50, stop_token_ids=[8])
    request = Request("r", [6, 7, 8, 6], params, max_tokens=50)
    sched.add_request(request)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 3}
    sched.update_from_output(so, ModelRunnerOutput({}))
    so = sched.schedule()  # 6 occurred, followed by 7, 8, 6: two fit the budget of 3
    assert so.spec_token_ids == {"r": [7, 8]} and so.num_scheduled_tokens == {"r": 3}
    (out,) = sched.update_from_output(so, ModelRunnerOutput({}, spec_token_ids={"r": [7, 8, 1]}))
    assert out.new_token_ids == [7, 8] and out.finish_reason == "stop" and out.stop_reason == 8
    sched.check_invariants()
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


def test_no_drafts_for_prompt_logprobs_or_below_min_tokens() -> None:
    sched = spec_scheduler(prompt_lookup_min=1, prompt_lookup_max=1, disable_by_batch_size=3)
    kinds = {
        "plain": SamplingParams(max_tokens=9, temperature=0.8),
        "logprobs": SamplingParams(max_tokens=9, logprobs=2),
        "prompt_logprobs": SamplingParams(max_tokens=9, prompt_logprobs=2),
        "penalty": SamplingParams(max_tokens=9, repetition_penalty=1.2),
        "seeded": SamplingParams(max_tokens=9, temperature=0.8, seed=3),
        "stop_str": SamplingParams(max_tokens=9, stop=["x"]),
        "min_tokens": SamplingParams(max_tokens=9, min_tokens=5),
    }
    for req_id, params in kinds.items():
        sched.add_request(Request(req_id, [3, 4, 3], params, max_tokens=9))
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(dict.fromkeys(kinds, 4)))
    so = sched.schedule()
    assert so.spec_token_ids == {}  # 6 running >= disable_by_batch_size 3
    sched.speculative = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1}
    )
    sched.update_from_output(so, ModelRunnerOutput(dict.fromkeys(kinds, 3)))
    so = sched.schedule()
    # (a penalty's rows read their histories; logprobs are each row's; stop strings are
    # matched above the engine, token by token; a seed draws each token by its index)
    assert set(so.spec_token_ids) == {"plain", "penalty", "logprobs", "stop_str", "seeded"}


# --- the configuration --------------------------------------------------------------------------


def test_vllms_speculative_config_forms() -> None:
    parse = SpeculativeConfig.parse
    assert parse(None) is None and parse("") is None
    assert parse('{"method": "ngram", "num_speculative_tokens": 4}') == SpeculativeConfig(4, 5, 5)
    assert parse({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3}) == (
        SpeculativeConfig(2, 3, 3)
    )
    assert parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}) == (
        SpeculativeConfig(2, 2, 2)
    )
    # a draft model: vLLM's method "draft_model", inferred from a model that is no n-gram
    draft = SpeculativeConfig(3, method="draft_model", model="/models/small")
    assert parse({"model": "/models/small", "num_speculative_tokens": 3}) == draft
    assert parse(
        {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 3,
         "draft_tensor_parallel_size": 2}
    ) == dataclasses.replace(draft, draft_tensor_parallel_size=2)  # fmt: skip
    for bad, message in [
        ({"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, "EAGLE, Medusa"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
        ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "'ngram' only"),
        ({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0}, "whole"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "a draft model only",
        ),
        ({"model": "d"}, "num_speculative_tokens must be"),
        ({"num_speculative_tokens": 2}, "no method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "at least 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": True}, "whole"),
        ("[1]", "must be a JSON object"),
        ("{", "not valid JSON"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            parse(bad)  # type: ignore[arg-type]


def test_speculation_keeps_async_scheduling_as_without_it() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert EngineConfig(device="cuda", speculative_config=spec).resolved_async_scheduling()
    assert not EngineConfig(device="cpu", speculative_config=spec).resolved_async_scheduling()
    off = EngineConfig(device="cuda", speculative_config=spec, async_scheduling=False)
    assert not off.resolved_async_scheduling()
    asked = EngineConfig(speculative_config=spec, async_scheduling=True)
    asked.validate()
    assert asked.resolved_async_scheduling()
    with pytest.raises(InvalidRequestError, match="cannot be combined"):
        EngineConfig(speculative_config=spec, num_scheduler_steps=2).validate()


def test_a_draft_model_turns_async_scheduling_off() -> None:
    """Its drafts follow each step's known tokens: off by default on GPUs too, an error when
    asked for, as is a pooling runner or a draft split otherwise than the model."""
    spec = {"model": "/models/small", "num_speculative_tokens": 2}
    assert not EngineConfig(device="cuda", speculative_config=spec).resolved_async_scheduling()
    EngineConfig(device="cuda", speculative_config=spec).validate()
    EngineConfig(speculative_config=spec, tensor_parallel_size=2).validate()
    split = {**spec, "draft_tensor_parallel_size": 2}
    EngineConfig(speculative_config=split, tensor_parallel_size=2).validate()
    for overrides, message in (
        ({"async_scheduling": True}, "async scheduling"),
        ({"speculative_config": split}, "split as the model is"),
        ({"runner": "pooling"}, "generation only"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            EngineConfig(**{"speculative_config": spec, **overrides}).validate()  # type: ignore[arg-type]
