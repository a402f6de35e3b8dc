"""Read one dense tensor from ``torch.save`` bytes without importing torch.

vLLM clients send ``prompt_embeds`` as base64 of ``torch.save(tensor)``. The gateway must never
import torch, yet it has to know the tensor's shape and dtype to validate the request and forward
the raw element bytes to the workers. A ``torch.save`` file is a zip holding ``<archive>/data.pkl``
(a pickle that rebuilds the tensor) and one ``<archive>/data/<key>`` entry per storage. We replay
that pickle with a restricted unpickler that maps the few globals a plain tensor needs to local
stand-ins and refuses everything else, so a malicious pickle can never import or call anything.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import zipfile
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

ACCEPTED_DTYPES = ("float32", "float16", "bfloat16")
_ACCEPTED = ", ".join(ACCEPTED_DTYPES)
# numpy views of the little-endian storage; bfloat16 is moved as its raw 16-bit patterns.
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}
# torch's legacy typed storage classes (``torch.FloatStorage``...) -> dtype names.
_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "DoubleStorage": "float64",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
_REFUSED_REBUILDS = {
    "_rebuild_sparse_tensor": "sparse tensors are not supported; send t.to_dense()",
    "_rebuild_sparse_csr_tensor": "sparse tensors are not supported; send t.to_dense()",
    "_rebuild_qtensor": "quantized tensors are not supported; send t.dequantize()",
    "_rebuild_nested_tensor": "nested tensors are not supported; send one dense tensor",
    "_rebuild_tensor_v3": f"unsupported tensor dtype (float8, uint16...); accepted: {_ACCEPTED}",
    "_rebuild_meta_tensor_no_storage": "meta tensors have no data; send a CPU tensor",
    "_rebuild_parameter": "nn.Parameter is not supported; send t.detach()",
}
# Legacy (non-zip) torch.save files start with this magic number, pickled as a long.
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_NOT_TORCH_SAVE = "prompt embeddings must be the bytes of torch.save(tensor)"


class _Refused(ValueError):
    """A ValueError with a message written for the user (others get wrapped into one)."""


@dataclass(frozen=True)
class RawTensor:
    """A dense tensor: C-contiguous row-major little-endian elements (bfloat16 as raw bits)."""

    dtype: str  # "float32" | "float16" | "bfloat16"
    shape: tuple[int, ...]
    data: bytes  # len == prod(shape) * itemsize


@dataclass(frozen=True, slots=True)
class _StorageType:
    """Stand-in for a ``torch.<Name>Storage`` class named by the pickle."""

    dtype: str


@dataclass(frozen=True, slots=True)
class _Storage:
    dtype: str
    data: bytes


@dataclass(frozen=True, slots=True)
class _TensorRef:
    """What ``torch._utils._rebuild_tensor_v2`` would have rebuilt, unchecked."""

    storage: object
    offset: object
    shape: object
    stride: object


def _rebuild_tensor_v2(
    storage: object, offset: object, shape: object, stride: object, *_ignored: object
) -> _TensorRef:
    # The ignored arguments are requires_grad, backward_hooks and optional metadata.
    return _TensorRef(storage, offset, shape, stride)


def _empty_hooks() -> dict[Any, Any]:
    """Stand-in for ``collections.OrderedDict()`` (torch always saves backward hooks empty)."""
    return {}


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, pkl: bytes, zf: zipfile.ZipFile, prefix: str, budget: int) -> None:
        super().__init__(io.BytesIO(pkl))
        self._zf = zf
        self._prefix = prefix
        # Each storage is read once, and all of them together never hold more bytes than the
        # file (entries of a hostile zip could overlap).
        self._storages: dict[str, _Storage] = {}
        self._budget = budget

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "collections" and name == "OrderedDict":
            return _empty_hooks
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch._utils" and name in _REFUSED_REBUILDS:
            raise _Refused(_REFUSED_REBUILDS[name])
        raise _Refused(
            f"the torch.save pickle refers to {f'{module}.{name}'!r}, which is not allowed; "
            "send one plain dense tensor"
        )

    def persistent_load(self, pid: Any) -> _Storage:
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
        ):
            raise _Refused(f"{_NOT_TORCH_SAVE}: unexpected persistent id in the pickle")
        dtype, key, numel = pid[1].dtype, pid[2], pid[4]
        if dtype not in _NUMPY_DTYPES:
            return _Storage(dtype, b"")  # refused in _materialize if a tensor uses it
        if key not in self._storages:
            data = _read_entry(self._zf, f"{self._prefix}/data/{key}", self._budget)
            self._budget -= len(data)
            if type(numel) is not int or len(data) != numel * _NUMPY_DTYPES[dtype].itemsize:
                raise _Refused(f"{_NOT_TORCH_SAVE}: storage {key!r} does not match its size")
            self._storages[key] = _Storage(dtype, data)
        if self._storages[key].dtype != dtype:
            raise _Refused(f"{_NOT_TORCH_SAVE}: storage {key!r} is read with two dtypes")
        return self._storages[key]


def _read_entry(zf: zipfile.ZipFile, name: str, budget: int) -> bytes:
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise _Refused(f"{_NOT_TORCH_SAVE}: the zip has no {name!r} entry") from None
    if info.compress_type != zipfile.ZIP_STORED:  # torch.save never compresses; no zip bombs
        raise _Refused(f"{_NOT_TORCH_SAVE}: zip entry {name!r} is compressed")
    if max(info.file_size, info.compress_size) > budget:
        raise _Refused(f"{_NOT_TORCH_SAVE}: zip entry {name!r} is larger than the file")
    return zf.read(info)


def _is_index_tuple(value: object) -> TypeGuard[tuple[int, ...]]:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)


def _materialize(ref: _TensorRef) -> RawTensor:
    storage, offset, shape, stride = ref.storage, ref.offset, ref.shape, ref.stride
    if not isinstance(storage, _Storage):
        raise _Refused(f"{_NOT_TORCH_SAVE}: the tensor has no storage")
    if storage.dtype not in _NUMPY_DTYPES:
        raise _Refused(f"unsupported tensor dtype {storage.dtype}; accepted: {_ACCEPTED}")
    if not (
        type(offset) is int
        and offset >= 0
        and _is_index_tuple(shape)
        and _is_index_tuple(stride)
        and len(shape) == len(stride)
    ):
        raise _Refused(f"{_NOT_TORCH_SAVE}: invalid tensor offset, shape or strides")
    np_dtype = _NUMPY_DTYPES[storage.dtype]
    numel = len(storage.data) // np_dtype.itemsize
    count = math.prod(shape)
    if count == 0:
        return RawTensor(storage.dtype, shape, b"")
    end = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1
    if end > numel:
        raise _Refused(
            f"{_NOT_TORCH_SAVE}: the tensor view needs {end} elements but its storage has {numel}"
        )
    if count > numel:  # overlapping views (expand()) could turn a few bytes into gigabytes
        raise _Refused(
            "views with more elements than their storage (e.g. from expand()) are not supported; "
            "send t.contiguous()"
        )
    flat = np.frombuffer(storage.data, dtype=np_dtype)[offset:]
    # The stride of a size-1 dimension is never used; it may be any (huge) number.
    strides = [s * np_dtype.itemsize if n > 1 else 0 for n, s in zip(shape, stride, strict=True)]
    view = np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides, writeable=False)
    return RawTensor(storage.dtype, shape, np.ascontiguousarray(view).tobytes())


def _load(data: bytes) -> object:
    """Replay ``data.pkl`` of a torch.save zip with the restricted unpickler."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = zf.namelist()
        prefix = names[0].split("/", 1)[0] if names and "/" in names[0] else ""
        if not prefix:
            raise _Refused(f"{_NOT_TORCH_SAVE}; the zip has no top-level archive folder")
        if f"{prefix}/byteorder" in names:
            byteorder = _read_entry(zf, f"{prefix}/byteorder", 16).decode("ascii", "replace")
            byteorder = byteorder.strip()
            if byteorder != "little":
                raise _Refused(
                    f"the tensor was saved with {byteorder!r} byte order; "
                    "only little-endian is supported"
                )
        pkl = _read_entry(zf, f"{prefix}/data.pkl", len(data))
        for _ in pickletools.genops(pkl):  # check every length before the C unpickler allocates
            pass
        return _TensorUnpickler(pkl, zf, prefix, len(data) - len(pkl)).load()


def read_tensor(data: bytes) -> RawTensor:
    """Parse ``torch.save(tensor)`` bytes; raise ValueError (a one-line, user-facing reason)."""
    if not data.startswith(b"PK\x03\x04"):  # a zip's first local file header
        if _LEGACY_MAGIC in data[:16]:
            raise _Refused(
                "prompt embeddings must be saved with torch.save's default zip format, "
                "not the legacy one (_use_new_zipfile_serialization=False)"
            )
        raise _Refused(f"{_NOT_TORCH_SAVE}; these bytes are not a torch.save zip file")
    try:
        obj = _load(data)
        if not isinstance(obj, _TensorRef):
            kind = "storage" if isinstance(obj, _Storage) else type(obj).__name__
            raise _Refused(
                f"prompt embeddings must be one tensor saved with torch.save (got {kind})"
            )
        return _materialize(obj)
    except _Refused:
        raise
    except Exception as e:  # corrupt zips and malformed or hostile pickles fail in many ways
        detail = " ".join(str(e).split())[:200]
        raise ValueError(
            f"{_NOT_TORCH_SAVE}; unreadable file ({type(e).__name__}: {detail})"
        ) from e
