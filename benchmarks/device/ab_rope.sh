# Decode steps with the rotation and the new token's K/V write inside the decode attention kernel
# (decode_attention's rope: one launch a layer instead of two) against the rotary kernel before
# it (FUSE_DECODE_ROPE = False), on the H200: the attention and engine GPU tests, then the engine
# at batch 1 (Llama, Qwen) and 256 (Qwen), each a fresh process, ROUNDS (2) rounds.
#     bash benchmarks/device/ab_rope.sh        (carry .whl)
# STAGES (words): tests, llama, qwen.
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
stages=" ${STAGES:-tests llama qwen} "
has() { [[ "$stages" == *" $1 "* ]]; }
echo "started $(date +%T)"
off="import baton_kernels.attention.triton_backend as b; b.FUSE_DECODE_ROPE = False"
if has tests; then
  timeout 300 python -m pytest -q -p no:warnings tests/unit/test_triton_attention.py \
      tests/gpu/test_triton_attention_gpu.py tests/gpu/test_engine_gpu.py 2>&1 | tail -3
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  if has llama; then
    ab_variant fused "" --shapes llama --batches 1
    ab_variant rotary "$off" --shapes llama --batches 1
  fi
  if has qwen; then
    ab_variant fused "" --shapes qwen --batches 1,0
    ab_variant rotary "$off" --shapes qwen --batches 1,0
  fi
done
echo "ended $(date +%T)"
