# Llama-3.1-8B at batch 1 with its qkv projection (6144 x 4096, the input norm inside) on the
# tensor-core GEMV too (issue 5): alone it read 3,026 GB/s there against the CUDA-core kernel's
# 3,081 (thirty-first session), but in the layer stack the Triton kernels' PDL overlap and the
# L2 prefetch before the wait may turn that around. Fresh processes, ROUNDS rounds (default 1).
#     bash benchmarks/device/ab_qkv_dot.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
g="import baton_kernels.triton.gemv as g"
for round in $(seq ${ROUNDS:-1}); do
  ab_variant default "" --shapes llama --batches 1
  ab_variant qkv_dot "$g
g.DOT_LAUNCHES[(6144, 4096)] = (64, 256, 4, 4, 1)" --shapes llama --batches 1
  ab_variant qkv_dot_split2 "$g
g.DOT_LAUNCHES[(6144, 4096)] = (64, 256, 4, 4, 2)" --shapes llama --batches 1
done
echo "ended $(date +%T)"
