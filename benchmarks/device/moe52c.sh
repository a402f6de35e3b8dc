# Fifty-second session, third part: a lone request of a mixture of experts with its layers'
# attention projections as GEMVs (use_gemv_decode now takes q/k norms and experts) against
# cuBLAS's (GEMV_ROWS = 0), Qwen3-30B-A3B at batch 1, each in a fresh process.
#     bash benchmarks/device/moe52c.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
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
