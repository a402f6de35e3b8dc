"""Regenerate the gRPC stubs from ``protos/`` (``make protos``), with the pinned grpcio-tools."""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "libs" / "baton"  # stubs land in libs/baton/baton/v1
GRPC_TOOLS_VERSION = "1.76.0"


def generate(out_dir: Path) -> list[Path]:
    """Generate every stub under ``out_dir``; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    version = getattr(grpc_tools, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    if version != GRPC_TOOLS_VERSION:
        raise SystemExit(f"grpcio-tools {GRPC_TOOLS_VERSION} is required, found {version}")
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = str(resources.files("grpc_tools") / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in out_dir.rglob("*_pb2*.py*"))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        for f in files:
            dest = OUT_DIR / f.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
            print(f"wrote {dest.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
