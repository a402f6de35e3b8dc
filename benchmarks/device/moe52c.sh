# Fifty-second session, third part (not run: device time ran out): the GPU tests of what the
# session built (the MoE and q/k-norm kernels in CUDA mode; the engine's MoE and Qwen3 tests on
# the GPU's defaults, a lone request's GEMV layers included; Gemma 3's, whose q/k norms take
# the new kernel too), then a lone request of a mixture of experts with its layers' attention
# projections as GEMVs (use_gemv_decode now takes q/k norms and experts) against cuBLAS's
# (GEMV_ROWS = 0), Qwen3-30B-A3B at batch 1, each in a fresh process. TESTS=0 skips the tests.
#     bash benchmarks/device/moe52c.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout 120 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/unit/test_triton_moe.py \
      tests/gpu/test_moe_gpu.py tests/unit/test_triton_fused_ops.py 2>&1 | tail -4
  timeout 300 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
      -k "mixture_of_experts or qwen3 or gemma3" 2>&1 | tail -4
  echo "tests ended $(date +%T)"
fi
export -f ab_variant
export ab_tmp
for v in gemv cublas; do
  patch=""
  [ $v = cublas ] && patch="import baton_engine.runner.model_runner as r; r.GEMV_ROWS = 0"
  timeout "${RUN_S:-70}" bash -c 'ab_variant "$@"' _ "moe-b1-$v" "$patch" \
      --shapes qwen3moe --batches 1 --num-prompts 2 --output-len 128 \
      --gpu-memory-utilization 0.9
done
echo "ended $(date +%T)"
