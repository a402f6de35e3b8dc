"""Rotary position embeddings (Hugging Face's rotate-half layout), with the static scalings of
transformers' ``rope_type``: ``llama3``, ``linear``, ``yarn`` and ``longrope`` (whose attention
factors scale the cos/sin table, so that every path that reads the table applies them).

``longrope`` (Phi-3's 128k models, Phi-3.5) has two sets of per-frequency factors: transformers
takes the short set while a sequence fits the original context and the long set beyond (and
recomputes the whole cache when a sequence crosses it). As vLLM, one set serves every sequence
of an engine: the long set where ``max_model_len`` exceeds the original context, else the short
set. Every sequence then matches transformers where the engine serves only the original
context, and a prompt longer than it where the engine serves more; a shorter prompt on such an
engine gets the long set's rotations, where transformers would use the short set's.

A partial rotation (Phi-4-mini: 96 of a head's 128 dimensions) turns pairs ``(i, i + R/2)`` of
the first ``R`` dimensions and leaves the rest; the kernels turn pairs ``(i, i + D/2)`` of the
whole head. Loading the weights reorders each q and k head's dimensions
(``partial_rotation_order``: the turned pairs to ``(i, i + D/2)``, the others between), which
changes no dot product of q and k, and the table turns the others by angle 0 (cos 1, sin 0, no
attention factor), so every kernel computes the partial rotation unchanged."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], head_dim: int, theta: float
) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies (interpolated below its correction range, extrapolated above, a
    linear ramp between) and its attention factor, as transformers computes them."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(float(scaling.get("beta_fast") or 32))
    high = correction_dim(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    blended = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return blended, float(attention)


def _longrope_inv_freq(
    scaling: dict[str, Any], head_dim: int, theta: float, max_positions: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE's frequencies (the long or the short factors: the module docstring) and its
    attention factor, as transformers computes them (``short_mscale`` / ``long_mscale``, as
    vLLM reads them, override the attention factor)."""
    original = int(scaling["original_max_position_embeddings"])
    long = max_positions > original
    name = "long_factor" if long else "short_factor"
    ext = scaling.get(name)
    if not isinstance(ext, list) or len(ext) != head_dim // 2:
        raise ValueError(
            f"longrope's {name} must list {head_dim // 2} factors (half the head size), not {ext!r}"
        )
    factor = float(scaling["factor"])
    attention = scaling.get("long_mscale" if long else "short_mscale")
    if attention is None:
        attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**shape)
    return inv_freq, float(attention)


def partial_rotation_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """For a rotation of a head's first ``rotary_dim`` dimensions, the order in which loading
    puts each q and k head's dimensions (``order[j]``: the checkpoint's dimension at ``j``):
    the turned pairs ``(i, i + R/2)`` at ``(i, i + D/2)``, the unturned dimensions in the
    slots between, half after each half of the pairs."""
    half, turned = head_dim // 2, rotary_dim // 2
    rest = list(range(rotary_dim, head_dim))
    order = [*range(turned), *rest[: half - turned], *range(turned, rotary_dim),
             *rest[half - turned :]]  # fmt: skip
    return torch.tensor(order, device="cpu")  # (on the host, also where models are built on meta)


def reorder_heads(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``[heads * D, ...]``: a projection's rows, a bias, or one head's norm
    weight ``[D]``) with each head's ``D`` rows in ``order``."""
    heads = tensor.view(-1, order.numel(), *tensor.shape[1:])
    return heads[:, order.to(tensor.device)].reshape(tensor.shape)


class RotaryEmbedding(torch.nn.Module):
    cos_sin: torch.Tensor  # [max_positions, 2, head_dim], float32

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int = 0,
    ) -> None:
        """``rotary_dim``: the dimensions of each head turned (0: all), in the order
        ``partial_rotation_order`` loads them."""
        super().__init__()
        self._args = (head_dim, max_positions, theta, scaling, rotary_dim or head_dim)
        if torch.get_default_device().type == "meta":
            # (a model built on "meta" gets its table from ``reset``: arithmetic on meta tensors
            # runs torch's Python references, whose first use imported torch._dynamo, 1.1 s of
            # every engine's start on a 2-core CPU)
            table = torch.empty((max_positions, 2, head_dim))
        else:
            table = self._build()
        self.register_buffer("cos_sin", table, persistent=False)

    def reset(self, device: torch.device | str = "cpu") -> None:
        """Recompute the table in float32 (after the module was built on "meta" or cast)."""
        self.cos_sin = self._build().to(device)

    def _build(self) -> torch.Tensor:
        head_dim, max_positions, theta, scaling, turned = self._args
        # (the frequencies of the turned dimensions, all of a head's but for a partial rotation)
        inv_freq = 1.0 / (theta ** (torch.arange(0, turned, 2, dtype=torch.int64).float() / turned))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        attention = 1.0
        if scaling is None or rope_type in (None, "default"):
            pass
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif rope_type == "yarn":
            inv_freq, attention = _yarn_inv_freq(inv_freq, scaling, turned, theta)
        elif rope_type == "longrope":
            inv_freq, attention = _longrope_inv_freq(scaling, turned, theta, max_positions)
        else:
            raise ValueError(
                f"unsupported rope scaling {rope_type!r} (supported: llama3, linear, yarn, "
                "longrope)"
            )
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        if turned < head_dim:  # (a partial rotation: the other pairs turn by angle 0)
            still = freqs.new_zeros(max_positions, (head_dim - turned) // 2)
            freqs = torch.cat([freqs, still], dim=1)
        emb = torch.cat([freqs, freqs], dim=-1)
        table = torch.stack([emb.cos(), emb.sin()], dim=1)
        if attention != 1.0:
            table *= attention
            if turned < head_dim:  # (unturned: cos 1, sin 0, unscaled)
                table[:, :, turned // 2 : head_dim // 2] = torch.tensor([[1.0], [0.0]])
                table[:, :, (head_dim + turned) // 2 :] = torch.tensor([[1.0], [0.0]])
        return table

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The tables for one step's ``positions``, computed once and shared by every layer."""
        cos_sin = self.cos_sin[positions].to(dtype)  # [T, 2, D]
        return RopeTables(cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1))


class RopeTables(NamedTuple):
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D]

    def apply_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(q), self.apply(k)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]``."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin


class FusedRope(NamedTuple):
    """The same rotation by one fused kernel that rotates q and k in place, reading the table
    at each token's position (``baton_kernels.fused``)."""

    positions: torch.Tensor  # [T]
    cos_sin: torch.Tensor  # [max_positions, 2, D] float32

    def apply_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from baton_kernels import fused

        fused.rotary_embedding_(q, k, self.positions, self.cos_sin)
        return q, k
