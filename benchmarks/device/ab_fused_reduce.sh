# A/B of the split reduce fused into the decode attention kernel (batch-1 decode of both shapes,
# each measurement a fresh process), after the GPU tests of the attention kernels and the engine.
#     bash benchmarks/device/ab_fused_reduce.sh        (carry .whl and .gpu)
# Variants: fused64 (the default: fused reduce, slices of >= 64 keys), sep128 (the previous code:
# a separate reduce kernel, slices of >= 128), fused128. Env: ROUNDS (1), SHAPES (qwen llama),
# BATCHES (1), SKIP_TESTS.
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
if [ -z "$SKIP_TESTS" ]; then
  timeout 300 python -m pytest -q -x tests/gpu/test_triton_attention_gpu.py \
      tests/gpu/test_engine_gpu.py tests/unit/test_triton_attention.py -k "decode or engine" \
      2>&1 | tail -3
fi
patch="import baton_kernels.triton.decode_attention as d"
for round in $(seq 1 "${ROUNDS:-1}"); do
  for shape in ${SHAPES:-qwen llama}; do
    for batch in ${BATCHES:-1}; do
      args="--shapes $shape --batches $batch"
      ab_variant fused64 "" $args  # the default
      ab_variant sep128 "$patch; d.FUSE_REDUCE = False; d.MIN_SPLIT_TOKENS = 128" $args
      ab_variant fused128 "$patch; d.MIN_SPLIT_TOKENS = 128" $args
    done
  done
done
