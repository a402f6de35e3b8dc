"""The GPU's draw of one token per row (``baton_kernels.triton.sample``): the token its PyTorch
reference picks from the same uniforms, tokens distributed as the probabilities, and a row's
token a function of its seed and probabilities alone (not of the batch, its row, or how many
slices its row was split into).

Without a GPU the kernel runs under Triton's interpreter at small shapes (TRITON_INTERPRET is set
before the kernel module is imported); with one, compiled on the device at Qwen's vocabulary.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from baton_kernels.triton import sample
from baton_kernels.triton.sample import exponential_race, ref_exponential_race

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.type == "cuda"
VOCAB = 151936 if GPU else 3000  # (3 slices of 1,024 tokens for a lone row on the CPU)


def _seeds(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << 62, (n,), generator=gen).to(DEVICE)


@pytest.mark.parametrize("one_slice", [False, True])
def test_the_race_picks_the_references_token(
    one_slice: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows split into slices, and each row in one program (several blocks a program)."""
    if one_slice:
        monkeypatch.setattr(sample, "TARGET_PROGRAMS", 1)
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, VOCAB, generator=gen) * 3, dim=1)
    probs[1, : VOCAB // 2] = 0.0  # masked tokens
    probs[2] = 0.0
    probs[2, VOCAB - 1] = 1.0  # one token left: the last one
    probs[3] = float("nan")  # no valid distribution: still a token id
    probs[4] *= 7.0  # rows need not sum to 1
    probs = probs.to(DEVICE)
    seeds = _seeds(6, 1)
    got = exponential_race(probs, seeds)
    assert got.dtype == torch.int64 and got.shape == (6,)
    assert torch.equal(got, ref_exponential_race(probs, seeds))
    assert int(got[2]) == VOCAB - 1 and int(got[1]) >= VOCAB // 2
    assert 0 <= int(got[3]) < VOCAB


def test_tokens_are_distributed_as_the_probabilities() -> None:
    rows, vocab = (4000, VOCAB) if GPU else (400, 1100)
    p = torch.zeros(vocab)
    where = (3, 1030, vocab - 2)  # (two blocks of 1,024 on the CPU)
    p[list(where)] = torch.tensor([0.5, 0.3, 0.2])
    tokens = exponential_race(p.to(DEVICE).repeat(rows, 1), _seeds(rows, 2)).cpu()
    freq = torch.tensor([(tokens == t).double().mean().item() for t in where])
    assert float(freq.sum()) == 1.0
    # within 4 standard deviations (0.5: 0.1 at 400 rows)
    sd = (torch.tensor([0.25, 0.21, 0.16]) / rows).sqrt()
    assert ((freq - torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)).abs() < 4 * sd).all()


def test_a_rows_token_depends_on_its_seed_and_probabilities_alone() -> None:
    """A row alone (its vocabulary split among several programs) and among many (one program a
    row), at another row: the same token for the same seed; another seed, other tokens."""
    gen = torch.Generator().manual_seed(3)
    many = 128 if GPU else 64
    probs = torch.softmax(torch.randn(many, VOCAB, generator=gen), dim=1).to(DEVICE)
    seeds = _seeds(many, 4)
    together = exponential_race(probs, seeds)
    alone = [int(exponential_race(probs[i : i + 1], seeds[i : i + 1])) for i in range(0, many, 9)]
    assert alone == together[::9].tolist()
    flipped = exponential_race(probs.flip(0), seeds.flip(0))
    assert torch.equal(flipped.flip(0), together)
    others = exponential_race(probs, seeds + 1)
    assert (others != together).float().mean() > 0.9  # (flat rows: a new seed, a new token)


def test_bad_input_is_refused() -> None:
    probs = torch.rand(2, 64, device=DEVICE)
    seeds = _seeds(2, 5)
    with pytest.raises(ValueError, match="float32"):
        exponential_race(probs.half(), seeds)
    with pytest.raises(ValueError, match="seeds"):
        exponential_race(probs, seeds[:1])
    with pytest.raises(ValueError, match="seeds"):
        exponential_race(probs, seeds.int())
