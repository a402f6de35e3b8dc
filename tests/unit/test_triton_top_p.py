"""The GPU's top-p cut (``baton_kernels.triton.top_p``) against the cut from sorting each row,
and the sampler's top-p through it on a GPU.

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

from baton_engine.sampler import Sampler, SamplingMetadata
from baton_engine.sampling_params import SamplingParams
from baton_kernels.triton.top_p import ref_top_p_threshold, top_p_threshold

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 151936 if DEVICE.type == "cuda" else 1000


def _mass_above(logits: torch.Tensor) -> torch.Tensor:
    """Per token, the probability (float64) of the tokens with larger logits."""
    values, order = logits.double().sort(dim=1, descending=True)
    probs = values.softmax(dim=1)
    return torch.empty_like(probs).scatter_(1, order, probs.cumsum(dim=1) - probs)


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0])  # flat to peaked rows
def test_the_cut_keeps_the_nucleus(scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale * 10))
    logits = (torch.randn(7, VOCAB, generator=gen) * scale).to(DEVICE)
    logits[1, : VOCAB // 3] = float("-inf")  # suppressed or masked tokens hold no mass
    top_p = torch.tensor([0.9, 0.95, 0.5, 1e-6, 1.0, 0.999, 0.1], device=DEVICE)
    kept = logits >= top_p_threshold(logits, top_p).unsqueeze(1)
    want = logits >= ref_top_p_threshold(logits, top_p).unsqueeze(1)
    # Where float32 sums cannot tell (a token whose mass above is within rounding of p), the
    # cut may fall one way or the other; nowhere else.
    differ = kept != want
    near = (_mass_above(logits) - top_p.double().unsqueeze(1)).abs() < 1e-5
    assert not (differ & ~near).any(), f"{int((differ & ~near).sum())} tokens cut wrongly"
    assert int(differ.sum()) <= 0.001 * int(want.sum()) + 2
    assert kept[4].all()  # p = 1 keeps everything
    assert int(kept[3].sum()) == 1 and kept[3, logits[3].argmax()]  # a tiny p: the argmax alone


def test_bad_input_is_refused() -> None:
    logits = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        top_p_threshold(logits.half(), torch.tensor([0.9, 0.9], device=DEVICE))
    with pytest.raises(ValueError, match="top_p"):
        top_p_threshold(logits, torch.tensor([0.9], device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampler_top_p_on_the_gpu_draws_inside_the_nucleus() -> None:
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(VOCAB, generator=gen) * 3
    rows = 256
    logits = row.expand(rows, -1).contiguous().cuda()
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * rows
    meta = SamplingMetadata.from_params(params, [[]] * rows, [[]] * rows, {}, device="cuda")
    drawn = set(Sampler()(logits, meta).sampled_token_ids.tolist())
    probs = row.softmax(0)
    order = probs.argsort(descending=True)
    above = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[above < 0.5].tolist())
    assert drawn <= nucleus and len(drawn) > 1
