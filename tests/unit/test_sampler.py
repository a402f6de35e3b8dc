"""Sampler: greedy, seeded determinism, raw logprobs and the other modes, penalties, truncation,
suppression, T."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from baton_engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p,
    ban_bad_words,
    draw,
    draw_seed,
)
from baton_engine.sampling_params import SamplingParams

VOCAB = 1000
# the CPU's draws (inverse CDF) and a GPU's (exponential race)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def _logits(rows: int, scale: float = 3.0, seed: int | None = None) -> torch.Tensor:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * scale


def _meta(
    params: Sequence[SamplingParams],
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    seeds: dict[int, int] | None = None,
    suppressed: Sequence[Sequence[int]] | None = None,
) -> SamplingMetadata:
    empty: list[list[int]] = [[] for _ in params]
    return SamplingMetadata.from_params(
        params,
        empty if prompts is None else prompts,
        empty if outputs is None else outputs,
        seeds or {},
        suppressed,
    )


def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    return Sampler()(logits, meta).sampled_token_ids


# 1. greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    logits = _logits(6)
    greedy = _sample(logits, _meta([SamplingParams(temperature=0.0)] * 6))
    assert greedy.dtype == torch.int64 and greedy.device == logits.device
    assert torch.equal(greedy, logits.argmax(dim=1))

    top1 = _meta([SamplingParams(temperature=1.0, top_k=1)] * 6)
    assert top1.all_greedy  # from_params: top_k 1 is greedy, as SamplingParams.is_greedy says
    assert torch.equal(_sample(logits, top1), greedy)
    # Built by hand as random rows, top_k 1 must still come out as argmax, over many draws.
    forced = replace(
        top1,
        all_greedy=False,
        all_random=True,
        temperature=torch.ones(6),
        top_k=torch.ones(6, dtype=torch.int64),
    )
    for _ in range(5):
        assert torch.equal(_sample(logits, forced), greedy)


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = _logits(4, scale=0.5)  # flat: random rows would rarely hit the argmax
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    meta = _meta(params)
    assert not meta.all_greedy and not meta.all_random
    out = _sample(logits, meta)
    assert torch.equal(out[[0, 2]], logits[[0, 2]].argmax(dim=1))


def test_bf16_logits_and_input_untouched() -> None:
    logits = _logits(3).to(torch.bfloat16)
    before = logits.clone()
    meta = _meta(
        [SamplingParams(temperature=0.7, repetition_penalty=1.3, logprobs=2)] * 3,
        outputs=[[1, 2]] * 3,
        suppressed=[[5]] * 3,
    )
    out = Sampler()(logits, meta)
    assert torch.equal(logits, before)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is not None and out.logprobs.logprobs.dtype == torch.float32


# 2. seeded determinism -------------------------------------------------------------------------

_TARGET = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=42)


def _run_seeded(batch: int, target_row: int, order_seed: int | None, steps: int = 20) -> list[int]:
    """Run ``steps`` steps with the target request at ``target_row``; return its tokens."""
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=7),
        SamplingParams(temperature=0.5, top_k=20, min_p=0.05),
        SamplingParams(temperature=1.0, top_p=0.5, seed=9),
        SamplingParams(temperature=0.8, presence_penalty=0.5),
        SamplingParams(temperature=1.1),
    ][: batch - 1]
    tokens: list[int] = []
    rng = torch.Generator().manual_seed(order_seed or 0)
    for step in range(steps):
        params = list(others)
        params.insert(target_row, _TARGET)
        # each seeded row draws with its seed and its token's index
        seeds = {i: draw_seed(p.seed, step) for i, p in enumerate(params) if p.seed is not None}
        # The target's logits are the same at each step in every scenario; others are noise.
        rows = [
            _logits(1, scale=1.0, seed=1000 + step)[0]
            if i == target_row
            else torch.randn(VOCAB) * 2
            for i in range(len(params))
        ]
        outputs: list[list[int]] = [[] for _ in params]
        outputs[target_row] = list(tokens)
        perm = list(range(len(params)))
        if order_seed is not None:
            perm = torch.randperm(len(params), generator=rng).tolist()
        inv = {old: new for new, old in enumerate(perm)}
        meta = _meta(
            [params[i] for i in perm],
            outputs=[outputs[i] for i in perm],
            seeds={inv[i]: seed for i, seed in seeds.items()},
        )
        out = _sample(torch.stack([rows[i] for i in perm]), meta)
        tokens.append(int(out[inv[target_row]]))
    return tokens


def test_seeded_row_independent_of_batch() -> None:
    alone = _run_seeded(batch=1, target_row=0, order_seed=None)
    in_batch = _run_seeded(batch=8, target_row=3, order_seed=None)
    shuffled = _run_seeded(batch=8, target_row=3, order_seed=5)
    assert alone == in_batch == shuffled
    assert len(set(alone)) > 1
    # The target's logits are flat enough that the seed matters: not just the argmax each step.
    argmaxes = [int(_logits(1, scale=1.0, seed=1000 + s).argmax()) for s in range(20)]
    assert alone != argmaxes


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_draws_follow_the_seed_and_index_alone(device: str) -> None:
    """A seeded request's draw for its token ``i`` depends on its seed and ``i`` alone (a run
    resumed at token ``i``, by another worker or after a preemption, draws what an unbroken
    one does), and its draws over its tokens sample the distribution (the seeds spread)."""
    probs = torch.tensor([[0.5, 0.3, 0.2]], device=device).repeat(3000, 1)
    for seed in (0, 7, 2**40 + 3, -5):
        seeds = {i: draw_seed(seed, i) for i in range(3000)}
        assert all(0 <= s < 2**63 for s in seeds.values())
        tokens = draw(probs.clone(), seeds)
        # a resumed run: the same tokens from index 1000 on, in rows of its own
        resumed = draw(probs[1000:].clone(), {i - 1000: s for i, s in seeds.items() if i >= 1000})
        assert torch.equal(resumed, tokens[1000:])
        freq = torch.bincount(tokens.cpu(), minlength=3).double() / 3000
        # (the binomial's standard deviation is below 0.01 at n 3000)
        assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.04)
    # seeds differ between tokens and between requests, in their low 32 bits too (all that
    # the CPU's generator keeps)
    keys = {draw_seed(seed, i) for seed in range(50) for i in range(200)}
    assert len({key & 0xFFFFFFFF for key in keys}) == 50 * 200


# 3. logprobs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num", [0, 1, 5])
def test_logprobs_from_raw_logits(num: int) -> None:
    logits = _logits(5)
    params = [
        SamplingParams(temperature=0.0, logprobs=num),
        # a penalty that leaves its top 4 tokens no real chance (raw top logit ~9 -> ~2, against
        # ~7.5 for the 5th), whatever the random draw
        SamplingParams(temperature=0.5, logprobs=num, repetition_penalty=5.0),
        SamplingParams(temperature=2.0, frequency_penalty=2.0, presence_penalty=2.0),
        SamplingParams(temperature=1.0, top_k=3, logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.2, logprobs=num),
    ]
    outputs = [[int(t) for t in logits[i].topk(4).indices] for i in range(5)]
    meta = _meta(params, outputs=outputs, suppressed=[[], [], [int(logits[2].argmax())], [], []])
    out = Sampler()(logits, meta)
    lp = out.logprobs
    assert lp is not None
    sampled = out.sampled_token_ids
    ref = torch.log_softmax(logits, dim=1)
    assert lp.token_ids.shape == lp.logprobs.shape == (5, 1 + num)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], ref.gather(1, sampled[:, None])[:, 0])
    top = ref.topk(num, dim=1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    order = ref.argsort(dim=1, descending=True)
    expected_ranks = [int((order[i] == sampled[i]).nonzero()) + 1 for i in range(5)]
    assert lp.ranks.tolist() == expected_ranks
    assert lp.ranks[0] == 1  # greedy row, no penalties: the argmax
    assert lp.ranks[1] > 1  # its top tokens were penalised away, and its raw rank says so

    # Same logits without any processing: the reported distribution is identical.
    plain = Sampler()(logits, _meta([SamplingParams(temperature=0.0, logprobs=num)] * 5))
    assert plain.logprobs is not None
    assert torch.equal(plain.logprobs.logprobs[:, 1:], lp.logprobs[:, 1:])


def _processed(logits: torch.Tensor, outputs: list[list[int]]) -> torch.Tensor:
    """``test_logprobs_modes``' rows processed by hand: a bias; a repetition penalty (2.0 on
    the output's tokens, greedy); a temperature of 0.5; the top 3 kept (the rest -inf)."""
    want = logits.clone()
    want[0, 17] += 4.0
    seen = want[1, outputs[1]]
    want[1, outputs[1]] = torch.where(seen > 0, seen / 2.0, seen * 2.0)
    want[2] /= 0.5
    cut = want[3] < want[3].topk(3).values[-1]
    want[3] = want[3].masked_fill(cut, float("-inf"))
    return want


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_modes(device: str) -> None:
    """What logprobs report (vLLM's --logprobs-mode): the raw logits' log-probabilities or the
    logits themselves, or the log-probabilities or logits of the processed rows (bias,
    penalty, temperature, top-k) a token is drawn from; the tokens the same in every mode."""
    logits = _logits(4, seed=3).to(device)
    outputs = [[], [int(t) for t in logits[1].topk(2).indices], [], []]
    params = [
        SamplingParams(temperature=0.0, logit_bias={17: 4.0}, logprobs=5),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=5),
        SamplingParams(temperature=0.5, seed=1, logprobs=5),
        SamplingParams(temperature=1.0, top_k=3, seed=2, logprobs=5),
    ]
    meta = _meta(params, outputs=outputs, seeds={2: 11, 3: 12})
    want = {
        "raw_logprobs": logits.log_softmax(dim=1),
        "raw_logits": logits,
        "processed_logprobs": _processed(logits, outputs).log_softmax(dim=1),
        "processed_logits": _processed(logits, outputs),
    }
    tokens = None
    for mode, values in want.items():
        sampler = Sampler(mode)
        out = sampler(logits, meta)
        lp = out.logprobs
        assert lp is not None
        sampled = out.sampled_token_ids
        tokens = sampled if tokens is None else tokens
        assert torch.equal(sampled, tokens), mode
        torch.testing.assert_close(lp.logprobs[:, 0], values.gather(1, sampled[:, None])[:, 0])
        top = values.topk(5, dim=1)
        assert torch.equal(lp.token_ids[:, 1:], top.indices), mode
        torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
        assert lp.ranks.tolist() == [int((values[i] >= values[i, sampled[i]]).sum()) for i in
                                     range(4)]  # fmt: skip
        torch.testing.assert_close(sampler.reported(logits, meta), values)
        # the greedy rows alone (a batch that never reaches the sampling steps)
        greedy = sampler(logits[:2], _meta(params[:2], outputs=outputs[:2])).logprobs
        assert greedy is not None
        torch.testing.assert_close(greedy.logprobs, lp.logprobs[:2])
    processed = want["processed_logprobs"].exp()
    assert processed[3].sum().item() == pytest.approx(1.0) and (processed[3] > 0).sum() == 3
    with pytest.raises(ValueError, match="raw_logprobs, raw_logits, processed_logprobs"):
        Sampler("logits")


def test_no_logprobs_when_not_requested() -> None:
    assert Sampler()(_logits(2), _meta([SamplingParams()] * 2)).logprobs is None


# 4. penalties ----------------------------------------------------------------------------------


def test_penalty_rules_on_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.5, 3.0, -1.0, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0)]
    # Token 0 (positive) in the prompt, token 1 (negative) in the output; 2 in neither.
    out = apply_penalties(logits, _meta(params, prompts=[[0, 9999]], outputs=[[1]]))
    assert out.tolist()[0][:3] == [1.0, -4.0, 1.0]
    assert torch.equal(out[0, 3:], logits[0, 3:])
    assert torch.equal(logits[0, :2], torch.tensor([2.0, -2.0]))  # input not modified

    freq = _meta([SamplingParams(frequency_penalty=0.5)], prompts=[[3, 3]], outputs=[[3, 3, 3, 4]])
    out = apply_penalties(logits, freq)
    torch.testing.assert_close(out[0, 3:5], torch.tensor([0.5 - 1.5, 0.5 - 0.5]))
    assert torch.equal(out[0, :3], logits[0, :3])  # prompt tokens do not count for frequency

    pres = _meta([SamplingParams(presence_penalty=0.5)], prompts=[[5]], outputs=[[3, 3, 3, 4]])
    out = apply_penalties(logits, pres)
    torch.testing.assert_close(out[0, 3:5], torch.tensor([0.0, 0.0]))  # count-independent
    assert out[0, 5] == 3.0


def test_repetition_penalty_lowers_seen_tokens_on_random_logits() -> None:
    logits = _logits(2)
    prompt, output = [3, 10, 500], [7, 7, 999]
    seen = sorted({*prompt, *output})
    meta = _meta(
        [SamplingParams(repetition_penalty=1.5), SamplingParams()],
        prompts=[prompt, prompt],
        outputs=[output, output],
    )
    out = apply_penalties(logits, meta)
    assert (out[0, seen] < logits[0, seen]).all()
    unseen = torch.ones(VOCAB, dtype=torch.bool)
    unseen[seen] = False
    assert torch.equal(out[0, unseen], logits[0, unseen])
    assert torch.equal(out[1], logits[1])  # row without penalties is untouched
    # Every seen logit fell and no other moved, so the seen tokens' total mass must fall (a single
    # seen token's probability may rise when a dominant seen token loses mass to the rest).
    assert out.softmax(1)[0, seen].sum() < logits.softmax(1)[0, seen].sum()


def test_huge_presence_penalty_greedy_never_repeats() -> None:
    logits = torch.rand(1, VOCAB)  # logits in [0, 1): a presence penalty of 2 outweighs any gap
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0)]
    produced: list[int] = []
    for _ in range(40):
        produced.append(int(_sample(logits, _meta(params, outputs=[produced]))[0]))
    assert len(set(produced)) == len(produced)
    assert produced[:3] == logits[0].topk(3).indices.tolist()


# 5. truncation ---------------------------------------------------------------------------------


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int = 2000) -> set[int]:
    batch = logits_row.expand(n, -1).contiguous()
    return set(_sample(batch, _meta([params] * n)).tolist())


def test_top_k_allowed_set() -> None:
    row = _logits(1, scale=1.5)[0]  # no token dominates: the allowed sets are wide
    allowed = set(row.topk(5).indices.tolist())
    got = _draws(row, SamplingParams(temperature=1.5, top_k=5))
    assert got <= allowed and len(got) > 1


def test_top_p_allowed_set_and_tiny_p_is_argmax() -> None:
    row = _logits(1, scale=1.5)[0]  # no token dominates: the allowed sets are wide
    for p, temperature in ((0.5, 1.0), (0.8, 0.7)):
        probs = (row / temperature).softmax(0)
        ordered = probs.argsort(descending=True)
        before = probs[ordered].cumsum(0) - probs[ordered]  # mass strictly above each token
        allowed = set(ordered[before < p + 1e-4].tolist())
        got = _draws(row, SamplingParams(temperature=temperature, top_p=p))
        assert got <= allowed and len(got) > 1
    assert _draws(row, SamplingParams(temperature=1.0, top_p=1e-6)) == {int(row.argmax())}
    # 1 - 1e-9 rounds to 1.0 in float32: without "keep at least one" every token would be cut.
    assert _draws(row, SamplingParams(temperature=1.0, top_p=1e-9), n=50) == {int(row.argmax())}


def test_top_k_top_p_without_a_full_sort_masks_as_the_sort_does() -> None:
    # On CPUs the nucleus is found in each row's topk of 256, else of 4096, else by sorting the
    # row. Rows here need each of the three: peaked, flat and near-uniform logits, with top-k off,
    # inside either width and beyond both, and top-p from off to tiny.
    vocab = 5000
    scales, ks, ps = (8.0, 1.0, 0.05), (0, 10, 300, 4500), (1.0, 0.9, 0.5, 1e-6)
    combos = [(s, k, p) for s in scales for k in ks for p in ps if (k, p) != (0, 1.0)]
    gen = torch.Generator().manual_seed(7)
    logits = torch.cat([torch.randn(1, vocab, generator=gen) * s for s, _, _ in combos])
    top_k = torch.tensor([k for _, k, _ in combos])
    top_p = torch.tensor([p for _, _, p in combos])

    got = apply_top_k_top_p(logits.clone(), top_k, top_p)
    # The reference: sort each row, then take the top-k and the top-p cuts from the sorted order.
    want = torch.full_like(logits, float("-inf"))
    widths = []
    for i in range(len(combos)):
        values, order = logits[i].sort(descending=True)
        k = int(top_k[i]) or vocab
        probs = values[:k].softmax(0)
        above = probs.cumsum(0) - probs
        n = k if top_p[i] >= 1.0 else max(1, int((above < top_p[i]).sum()))
        want[i, order[:n]] = logits[i, order[:n]]
        widths.append(n)
    assert torch.equal(got, want)
    # The rows did need each path: nuclei within 256, within 4096 and wider.
    assert min(widths) == 1 and any(256 < n <= 4096 for n in widths) and max(widths) > 4096


def test_min_p_allowed_set() -> None:
    row = _logits(1, scale=1.5)[0]  # no token dominates: the allowed sets are wide
    probs = row.softmax(0)
    allowed = set((probs >= 0.1 * probs.max()).nonzero()[:, 0].tolist())
    got = _draws(row, SamplingParams(temperature=1.0, min_p=0.1))
    assert got <= allowed and len(got) > 1


def test_combined_truncation_in_mixed_batch() -> None:
    row = _logits(1)[0]
    n = 1500
    params = [
        SamplingParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=1.0, top_k=3),
    ] * (n // 2)
    out = _sample(row.expand(n, -1).contiguous(), _meta(params))
    top10, top3 = set(row.topk(10).indices.tolist()), set(row.topk(3).indices.tolist())
    assert set(out[0::2].tolist()) <= top10
    assert set(out[1::2].tolist()) <= top3


# 6. suppression --------------------------------------------------------------------------------


def test_suppressed_tokens_never_sampled() -> None:
    logits = _logits(4)
    top3 = [logits[i].topk(3).indices.tolist() for i in range(4)]
    suppressed = [top3[0][:1], top3[1][:2], [], [*top3[3], VOCAB + 5]]  # out-of-range id ignored
    greedy = _sample(logits, _meta([SamplingParams(temperature=0.0)] * 4, suppressed=suppressed))
    assert greedy.tolist() == [top3[0][1], top3[1][2], top3[2][0], int(logits[3].topk(4)[1][3])]

    row = logits[0] * 2  # the suppressed argmax would win most draws
    n = 2000
    out = _sample(
        row.expand(n, -1).contiguous(),
        _meta([SamplingParams(temperature=1.0)] * n, suppressed=[top3[0][:1]] * n),
    )
    assert top3[0][0] not in set(out.tolist())


def test_allowed_token_ids_and_logit_bias() -> None:
    """A row with allowed_token_ids samples only those; a row's logit_bias shifts its logits
    (+100 makes a token the argmax, -100 removes the argmax); other rows are untouched; the
    reported logprobs stay the raw model's."""
    logits = _logits(4)
    raw_top = logits.argmax(dim=1).tolist()
    low = [int(logits[i].argmin()) for i in range(4)]
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=[low[0], 7]),
        SamplingParams(temperature=0.0, logit_bias={low[1]: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={raw_top[2]: -100.0}, logprobs=1),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits, _meta(params))
    allowed_best = low[0] if logits[0, low[0]] > logits[0, 7] else 7
    second = int(logits[2].topk(2).indices[1])
    assert out.sampled_token_ids.tolist() == [allowed_best, low[1], second, raw_top[3]]
    assert out.logprobs is not None
    assert int(out.logprobs.token_ids[2, 1]) == raw_top[2]  # the raw top-1, before the bias

    n = 2000
    row = logits[0].expand(n, -1).contiguous()
    allowed = [low[0], low[1], 42]
    drawn = _sample(row, _meta([SamplingParams(temperature=1.0, allowed_token_ids=allowed)] * n))
    assert set(drawn.tolist()) <= set(allowed) and len(set(drawn.tolist())) > 1
    flat = torch.zeros(n, VOCAB)  # uniform; a +6 bias makes token 5 e^6 times as likely
    biased = _sample(flat, _meta([SamplingParams(temperature=1.0, logit_bias={5: 6.0})] * n))
    share = (biased == 5).float().mean().item()
    expected = torch.e**6 / (torch.e**6 + VOCAB - 1)  # 0.29 (std of the share: 0.01)
    assert abs(share - expected) < 0.04, (share, expected)


def test_bad_words() -> None:
    """vLLM's bad_words: a one-token sequence bans its token; a longer one bans its last token
    only when the rest of it ends the row's output (a prompt that ends so does not count);
    rows without bad words are untouched; the reported logprobs stay the raw model's."""
    logits = _logits(6)
    top = [logits[i].topk(2).indices.tolist() for i in range(6)]
    low = int(logits[4].argmin())
    sequences = [
        [[top[0][0]]],
        [[7, 8, top[1][0]]],
        [[7, 8, top[2][0]]],  # its output has 7, 8, but not at the end
        [[8, top[3][0]], [1, 8, 9, top[3][0]]],  # 8 ends its prompt; longer than output + 1
        [[low], [8, top[4][0]]],
        None,
    ]
    outputs = [[3], [7, 8], [7, 8, 9], [], [9, 8], [7, 8]]
    prompts = [[1, 2]] * 3 + [[1, 8]] * 3

    masked = logits.clone()
    ban_bad_words(masked, sequences, outputs)
    want = [[0, top[0][0]], [1, top[1][0]], [4, low], [4, top[4][0]]]
    assert sorted(torch.isinf(masked).nonzero().tolist()) == sorted(want)

    params = [SamplingParams(temperature=0.0, bad_words_token_ids=b) for b in sequences]
    params[0] = replace(params[0], logprobs=1)
    out = Sampler()(logits, _meta(params, prompts=prompts, outputs=outputs))
    banned = [True, True, False, False, True, False]
    assert out.sampled_token_ids.tolist() == [t[b] for t, b in zip(top, banned, strict=True)]
    assert out.logprobs is not None
    assert int(out.logprobs.token_ids[0, 1]) == top[0][0]  # the raw top-1, though banned

    n = 2000  # at a temperature too: the banned token (most draws' without the ban) never comes
    row = (logits[0] * 2).expand(n, -1).contiguous()
    ban = SamplingParams(temperature=1.0, bad_words_token_ids=[[top[0][0]]])
    assert top[0][0] not in set(_sample(row, _meta([ban] * n)).tolist())


# 7. temperature --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    row = _logits(1, scale=1.5)[0]
    n = 4000
    out = _sample(
        row.expand(n, -1).contiguous(), _meta([SamplingParams(temperature=temperature)] * n)
    )
    counts = torch.bincount(out, minlength=VOCAB).double()

    def chi2(t: float) -> float:
        # Top 10 tokens as their own bins, the rest as one: every bin expects many draws.
        expected = (row.double() / t).softmax(0) * n
        top = expected.topk(10).indices
        rest = torch.ones(VOCAB, dtype=torch.bool)
        rest[top] = False
        obs = torch.cat([counts[top], counts[rest].sum()[None]])
        exp = torch.cat([expected[top], expected[rest].sum()[None]])
        return float(((obs - exp) ** 2 / exp).sum())

    assert chi2(temperature) < 45.0  # 10 dof: p ~ 1e-6 for a correct sampler
    wrong = temperature * 1.6
    assert chi2(wrong) > chi2(temperature)


# 8. constraints that leave no token ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_with_every_token_masked_still_gets_a_token_id(device: str) -> None:
    """Constraints can contradict each other (allowed_token_ids all banned, a grammar that
    allows none of them): the row's token is then meaningless, but it must be a token id, not
    the vocabulary size, which failed the whole step (every request in it) and, three times in
    a row, the engine. Other rows sample as usual."""
    nothing = {"allowed_token_ids": [5], "bad_words_token_ids": [[5]]}
    for params in (
        SamplingParams(temperature=1.0, **nothing),  # type: ignore[arg-type]
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, logprobs=2, **nothing),  # type: ignore[arg-type]
        SamplingParams(temperature=0.0, **nothing),  # type: ignore[arg-type]
    ):
        logits = _logits(2).to(device)
        rows = [params, SamplingParams(temperature=0.0)]
        meta = SamplingMetadata.from_params(rows, [[], []], [[], []], {}, device=device)
        token, other = Sampler()(logits, meta).sampled_token_ids.tolist()
        assert 0 <= token < VOCAB, params
        assert other == int(logits[1].argmax())
