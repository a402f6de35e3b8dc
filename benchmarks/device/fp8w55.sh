# Fifty-fifth session: FP8 linear layers (W8A8, --quantization fp8) on the GPU.
# PART=tests (default): the FP8 layer's tests compiled (the Triton quantization kernel bit for
# bit against torch, the FP8 GEMM against the dequantized product, bf16/fp16/fp32), then the
# engine's (the GPU's defaults against the eager torch reference, both with FP8 layers) beside
# the existing graph test.
# PART=ab: issue 5's workload with bf16 layers against FP8 layers (and FP8 layers with the GEMM
# accumulating exactly, FAST_ACCUM off; EXTRA=fp8-kv8: with an FP8 KV cache too) at 256 (Qwen at
# K=4, as its target's runs), and at batch 1 (and FP8 without the few-row kernel, GEMV_ROWS=0),
# each in a fresh process (SHAPES=qwen or llama to run one).
#     bash benchmarks/device/fp8w55.sh; PART=ab SHAPES=llama bash benchmarks/device/fp8w55.sh
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${PART:-tests}" = tests ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/test_fp8_linear.py 2>&1 | tail -4
  echo "kernel tests ended $(date +%T)"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
      -k "fp8_layers or graph_decode_matches_reference" 2>&1 | tail -6
  echo "tests ended $(date +%T)"
  [ -z "$SHAPES" ] && exit 0
fi
export -f ab_variant
export ab_tmp
exact="import baton_kernels.fp8_linear as f; f.FAST_ACCUM = False"
cublas="import baton_kernels.fp8_linear as f; f.GEMV_ROWS = 0"
for shape in ${SHAPES:-qwen llama}; do
  steps=1
  [ "$shape" = qwen ] && steps=4
  for variant in bf16 fp8 fp8-exact ${EXTRA}; do
    patch="" q="--quantization fp8" kv=auto
    [ "$variant" = bf16 ] && q=""
    [ "$variant" = fp8-exact ] && patch="$exact"
    [ "$variant" = fp8-kv8 ] && kv=fp8
    timeout "${RUN_S:-240}" bash -c 'ab_variant "$@"' _ "$shape-256-$variant" "$patch" \
        --shapes "$shape" --batches 0 --num-scheduler-steps $steps --kv-cache-dtype $kv $q
  done
  for variant in bf16 fp8 fp8-cublas; do
    patch="" q="--quantization fp8"
    [ "$variant" = bf16 ] && q=""
    [ "$variant" = fp8-cublas ] && patch="$cublas"
    timeout "${RUN_S:-240}" bash -c 'ab_variant "$@"' _ "$shape-b1-$variant" "$patch" \
        --shapes "$shape" --batches 1 $q
  done
done
echo "ended $(date +%T)"
