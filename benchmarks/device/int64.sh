# Sixty-fourth session: packed integer layers (W4A16, compressed-tensors / AWQ checkpoints) on
# the GPU.
# PART=tests (default): the kernels' tests compiled (the Triton GEMM and dequantization against
# the torch reference, bf16/fp16/fp32). (The checkpoints' tests need the default model, which
# the GPU host lacks.)
# PART=kernels: benchmarks/bench_int_linear_gpu.py (each projection against bf16 cuBLAS, and
# the launch sweep).
# PART=ab: issue 5's workload, bf16 against W4A16 (dummy weights, groups of 128), each in a
# fresh process: SHAPES (default "llama qwen") at BATCHES (default "1 64 0"; 0: all 256).
#     bash benchmarks/device/int64.sh; PART=ab SHAPES=llama bash benchmarks/device/int64.sh
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${PART:-tests}" in
tests)
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_int_linear.py 2>&1 | tail -4
  echo "kernel tests ended $(date +%T)"
  ;;
kernels)
  timeout 540 python3 benchmarks/bench_int_linear_gpu.py ${ARGS} 2>&1 | tail -80
  ;;
ab)
  export -f ab_variant
  export ab_tmp
  for shape in ${SHAPES:-llama qwen}; do
    for batch in ${BATCHES:-1 64 0}; do
      steps=1
      [ "$shape" = qwen ] && [ "$batch" = 0 ] && steps=4
      for variant in "$shape" "$shape-w4"; do
        timeout "${RUN_S:-240}" bash -c 'ab_variant "$@"' _ "$variant-$batch" "" \
            --shapes "$variant" --batches "$batch" --num-scheduler-steps $steps
      done
    done
  done
  ;;
esac
echo "ended $(date +%T)"
