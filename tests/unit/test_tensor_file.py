"""baton_gateway.tensor_file against real torch.save output (and hostile variants of it)."""

from __future__ import annotations

import builtins
import io
import os
import pickle
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from baton_gateway.tensor_file import RawTensor, read_tensor

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
GATEWAY_DIR = Path(__file__).resolve().parents[2] / "services" / "gateway"


def saved(obj: object, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    return (torch.rand(*shape, generator=g) + 0.5).to(dtype)  # non-zero everywhere


def expected_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def assert_matches(raw: RawTensor, t: torch.Tensor) -> None:
    assert raw.dtype == DTYPES[t.dtype]
    assert raw.shape == tuple(t.shape)
    assert raw.data == expected_bytes(t)
    assert len(raw.data) == t.numel() * t.element_size()


def rewrite_zip(data: bytes, edit: Callable[[str, bytes], tuple[str, bytes]]) -> bytes:
    """Copy a torch.save zip, passing each (name, content) through ``edit``."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            dst.writestr(*edit(name, src.read(name)))
    return out.getvalue()


def replace_entry(data: bytes, suffix: str, content: bytes) -> bytes:
    return rewrite_zip(data, lambda n, c: (n, content if n.endswith(suffix) else c))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.values())
@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 8)], ids=["2d", "3d"])
def test_dense_tensors(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = rand(*shape, dtype=dtype)
    assert_matches(read_tensor(saved(t)), t)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.values())
def test_view_with_storage_offset(dtype: torch.dtype) -> None:
    batch = rand(3, 4, 8, dtype=dtype)
    view = batch[1]
    assert view.storage_offset() == 32
    assert_matches(read_tensor(saved(view)), view)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES.values())
def test_non_contiguous_views(dtype: torch.dtype) -> None:
    x = rand(6, 10, dtype=dtype)
    for view in (x.t(), x[1:5:2, ::3], x[0].expand(3, 10)):
        assert not view.is_contiguous()
        assert_matches(read_tensor(saved(view)), view)


def test_requires_grad() -> None:
    t = rand(4, 8).requires_grad_()
    assert_matches(read_tensor(saved(t)), t)


def test_scalar_and_empty_tensors() -> None:
    assert_matches(read_tensor(saved(torch.tensor(1.5))), torch.tensor(1.5))
    raw = read_tensor(saved(torch.empty(0, 8)))
    assert (raw.dtype, raw.shape, raw.data) == ("float32", (0, 8), b"")


def test_archive_folder_of_any_name() -> None:
    t = rand(3, 5)
    renamed = rewrite_zip(saved(t), lambda n, c: ("embeds" + n.removeprefix("archive"), c))
    assert_matches(read_tensor(renamed), t)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (os.urandom(256), "not a torch.save zip file"),
        (b"", "not a torch.save zip file"),
        (saved(rand(2, 3), _use_new_zipfile_serialization=False), "default zip format"),
        (saved({"embeds": rand(2, 3)}), "one tensor saved with torch.save \\(got dict\\)"),
        (saved([rand(2, 3)]), "got list"),
        (saved(7), "got int"),
        (saved(rand(2, 3).to_sparse()), "sparse tensors are not supported"),
        (saved(torch.nn.Parameter(rand(2, 3))), "nn.Parameter"),
        (saved(torch.zeros(4, dtype=torch.float8_e4m3fn)), "unsupported tensor dtype"),
        (saved(rand(3).expand(4, 3)), "more elements than their storage"),
    ],
    ids=[
        "random",
        "empty",
        "legacy",
        "dict",
        "list",
        "int",
        "sparse",
        "parameter",
        "float8",
        "expand",
    ],
)
def test_refused(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        read_tensor(data)
    assert "\n" not in str(info.value)


@pytest.mark.filterwarnings("ignore::UserWarning")  # both are deprecated or prototype APIs
def test_refused_quantized_and_nested() -> None:
    with pytest.raises(ValueError, match="quantized tensors are not supported"):
        read_tensor(saved(torch.quantize_per_tensor(rand(2, 3), 0.1, 0, torch.qint8)))
    with pytest.raises(ValueError, match="nested tensors are not supported"):
        read_tensor(saved(torch.nested.nested_tensor([rand(2), rand(3)])))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bool])
def test_unsupported_dtype_is_named(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError) as info:
        read_tensor(saved(torch.ones(2, 3, dtype=dtype)))
    assert f"dtype {name}" in str(info.value)
    assert "float32, float16, bfloat16" in str(info.value)


def test_big_endian_refused() -> None:
    data = replace_entry(saved(rand(2, 3)), "/byteorder", b"big")
    with pytest.raises(ValueError, match="'big' byte order"):
        read_tensor(data)


def test_storage_shorter_than_view() -> None:
    data = saved(torch.zeros(2, 3))
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        pkl = zf.read("archive/data.pkl")
    shape_2x3 = b"K\x02K\x03\x86"  # BININT1 2, BININT1 3, TUPLE2
    assert pkl.count(shape_2x3) == 1
    data = replace_entry(data, "/data.pkl", pkl.replace(shape_2x3, b"K\x04K\x03\x86"))
    with pytest.raises(ValueError, match="needs 12 elements but its storage has 6"):
        read_tensor(data)


def test_storage_entry_truncated() -> None:
    data = replace_entry(saved(rand(2, 3)), "/data/0", b"\x00" * 8)
    with pytest.raises(ValueError, match="does not match its size"):
        read_tensor(data)


def test_compressed_entries_refused() -> None:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved(rand(2, 3)))) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name), compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(ValueError, match="is compressed"):
        read_tensor(out.getvalue())


class _SystemCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class _EvalCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize("payload", [_SystemCall, _EvalCall], ids=["os.system", "eval"])
def test_malicious_pickle_is_not_run(tmp_path: Path, payload: type) -> None:
    marker = tmp_path / "pwned"
    evil = pickle.dumps(payload(marker), protocol=2)
    pickle.loads(evil)  # the payload works when unpickled normally...
    assert marker.exists()
    marker.unlink()
    data = replace_entry(saved(rand(2, 3)), "/data.pkl", evil)
    with pytest.raises(ValueError, match="not allowed"):
        read_tensor(data)
    assert not marker.exists()  # ...but not here


def test_module_does_not_import_torch() -> None:
    pythonpath = [str(GATEWAY_DIR), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in pythonpath if p)}
    code = "import sys; import baton_gateway.tensor_file; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
