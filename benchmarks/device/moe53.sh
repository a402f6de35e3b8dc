# Fifty-third session: PART=tests (default) runs the GPU tests of the fifty-second session's
# kernels and paths (moe52c.sh's: the MoE and q/k-norm kernels in CUDA mode, the engine's MoE,
# Qwen3 and Gemma 3 tests on the GPU's defaults) and the layer benchmark's alignment rows (the
# one-program alignment with atomic cursors against the several programs' it replaces up to
# ALIGN_ONE pairs); PART=ab the whole Qwen3-30B-A3B, each variant in a fresh process: batch 1
# with the attention's projections as GEMVs against cuBLAS's (GEMV_ROWS = 0), batch 64 with
# the one-program alignment against the several programs' (ALIGN_ONE = 0).
#     bash benchmarks/device/moe53.sh; PART=ab bash benchmarks/device/moe53.sh   (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${PART:-tests}" = tests ]; then
  timeout 150 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/unit/test_triton_moe.py \
      tests/gpu/test_moe_gpu.py tests/unit/test_triton_fused_ops.py 2>&1 | tail -4
  timeout 60 python3 benchmarks/bench_moe_gpu.py --forms align --tokens 1,8,64,256,512,1024
  timeout 330 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
      -k "mixture_of_experts or qwen3 or gemma3" 2>&1 | tail -4
  echo "tests ended $(date +%T)"
  exit 0
fi
export -f ab_variant
export ab_tmp
for v in gemv cublas; do
  patch=""
  [ $v = cublas ] && patch="import baton_engine.runner.model_runner as r; r.GEMV_ROWS = 0"
  timeout "${RUN_S:-75}" bash -c 'ab_variant "$@"' _ "moe-b1-$v" "$patch" \
      --shapes qwen3moe --batches 1 --num-prompts 2 --output-len 128 \
      --gpu-memory-utilization 0.9
done
for v in one programs; do
  patch=""
  [ $v = programs ] && patch="import baton_kernels.triton.moe as m; m.ALIGN_ONE = 0"
  timeout "${RUN_S64:-120}" bash -c 'ab_variant "$@"' _ "moe-b64-align-$v" "$patch" \
      --shapes qwen3moe --batches 64 --num-prompts 128 --output-len 128 \
      --gpu-memory-utilization 0.9
done
echo "ended $(date +%T)"
