# Source on the GPU host, from the tree's root, after benchmarks/device/bundle.sh packed .whl/:
# installs the carried wheels and NIXL into /tmp/site, exports PYTHONPATH for them and this
# tree's libraries, and sets the environment multi-GPU runs need (NVLink multicast off; NIXL
# READs over CUDA IPC instead of a silent TCP fallback).
#
#     source benchmarks/device/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
xz -dc .whl/nixl-cu13-ucx.tar.xz | tar -C /tmp/site -xf - || return 1
export PYTHONPATH=/tmp/site:$PWD/libs/baton:$PWD/libs/engine:$PWD/libs/kernels:$PWD/libs/kvtransfer:$PWD/services/gateway:$PWD/services/decode:$PWD/services/prefill:$PWD/services/kvstore
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
