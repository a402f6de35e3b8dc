# Sixty-fourth to sixty-sixth sessions: packed integer layers (W4A16, compressed-tensors / AWQ
# checkpoints) on the GPU.
# PART=tests (default): the kernels' tests compiled (the Triton GEMM, GEMV and dequantization
# against the torch reference, bf16/fp16/fp32); TESTS_K: a pytest -k filter (compiling every
# test takes more than 300 s). (The checkpoints' tests need the default model, which the GPU
# host lacks.)
# PART=kernels: benchmarks/bench_int_linear_gpu.py ${ARGS} (each projection against bf16
# cuBLAS, and the launch sweep).
# PART=ab: issue 5's workload, bf16 against W4A16 (dummy weights, groups of 128), each in a
# fresh process: SHAPES (default "llama qwen") at BATCHES (default "1 64 0"; 0: all 256);
# MM_ROWS=N adds a W4A16 variant whose layers run int_mm up to N rows (int_linear.MM_ROWS).
# PART may name several parts ("tests kernels"); each writes its log under $OUT.
#     bash benchmarks/device/int64.sh; PART=ab SHAPES=llama bash benchmarks/device/int64.sh
#     PART="tests kernels" TESTS_K=tiled ARGS="--shapes llama" bash benchmarks/device/int64.sh
#     PART=ab SHAPES=llama BATCHES=64 MM_ROWS=256 bash benchmarks/device/int64.sh
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p "${OUT:=$(mktemp -d)}"
for part in ${PART:-tests}; do
case "$part" in
tests)
  timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider tests/unit/test_int_linear.py \
      -k "${TESTS_K:-}" > "$OUT/tests.log" 2>&1
  tail -4 "$OUT/tests.log"
  echo "kernel tests ended $(date +%T)"
  ;;
kernels)
  timeout "${KERNELS_S:-540}" python3 benchmarks/bench_int_linear_gpu.py ${ARGS} > "$OUT/kernels.log" 2>&1
  tail -80 "$OUT/kernels.log"
  ;;
ab)
  export -f ab_variant
  export ab_tmp
  for shape in ${SHAPES:-llama qwen}; do
    for batch in ${BATCHES:-1 64 0}; do
      steps=1
      [ "$shape" = qwen ] && [ "$batch" = 0 ] && steps=4
      for variant in "$shape" "$shape-w4" ${MM_ROWS:+"$shape-w4-mm"}; do
        [ -n "${NO_BF16:-}" ] && [ "$variant" = "$shape" ] && continue  # (W4A16 variants only)
        patch=""  # (the -mm variant: int_linear routes up to MM_ROWS rows to int_mm)
        [ "${variant%-mm}" != "$variant" ] && \
            patch="from baton_kernels import int_linear; int_linear.MM_ROWS = $MM_ROWS"
        timeout "${RUN_S:-240}" bash -c 'ab_variant "$@"' _ "$variant-$batch" "$patch" \
            --shapes "${variant%-mm}" --batches "$batch" --num-scheduler-steps $steps
      done
    done
  done
  ;;
esac
done
echo "ended $(date +%T)"
