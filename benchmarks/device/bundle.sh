#!/usr/bin/env bash
# Pack what a GPU host without package access needs to run the Baton stack from this tree:
# the serving stack's wheels that its image lacks (versions pinned to this checkout's) and NIXL
# for CUDA 13, trimmed to the UCX backend (the wheel's expert-parallel torch extensions alone are
# 94 MB). Output: .whl/ (git-ignored), unpacked there by benchmarks/device/setup.sh.
#
#     bash benchmarks/device/bundle.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.whl
rm -rf "$out" && mkdir -p "$out"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
ver() { python3 -m pip show "$1" 2>/dev/null | awk '/^Version/{print $2}'; }
pkgs=()
for p in fastapi starlette uvicorn pydantic pydantic_core annotated_types typing_inspection \
         typing_extensions grpcio grpcio-health-checking protobuf opentelemetry-api \
         opentelemetry-sdk opentelemetry-semantic-conventions \
         opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common \
         opentelemetry-proto googleapis-common-protos redis gguf anyio xgrammar apache-tvm-ffi \
         compressed-tensors loguru; do
    pkgs+=("$p==$(ver "$p")")
done
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out" "${pkgs[@]}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" nixl-cu13==1.5.1 nixl==1.5.1
mkdir "$tmp/site"
for w in "$tmp"/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
(cd "$tmp/site" && rm -rf nixl_ep_cu13 nixl_cu13.scripts nixl_cu13.libs/ucx/libucx_perftest_cuda*
 for d in nixl_cu13.libs/nixl .nixl_cu13.mesonpy.libs/plugins; do
     find "$d" -name 'libplugin_*' ! -name 'libplugin_UCX.so' ! -name 'libplugin_POSIX.so' -delete
 done)
tar -C "$tmp/site" -cf - . | xz -9 -T0 > "$out/nixl-cu13-ucx.tar.xz"
du -sh "$out"
