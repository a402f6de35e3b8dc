# Fifty-fourth session: the FP8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2) on the GPU.
# PART=tests (default): the kernels it changed, compiled (the cache writes' rounding bit for bit
# against torch's cast, both attentions over an 8-bit cache, and the 16-bit cases of the same
# kernels again), then the engine's test (the Triton path through CUDA graphs against the
# reference backend over the same 8-bit cache) beside the existing graph and lone-request ones.
# PART=ab: issue 5's workload with the cache of the model's dtype (bf16) against fp8, each in a
# fresh process: Qwen2.5-0.5B at 256 (K=4, as its target's runs) and Llama-3.1-8B at 256
# (SHAPES=qwen or llama to run one).
#     bash benchmarks/device/fp8kv54.sh; PART=ab bash benchmarks/device/fp8kv54.sh   (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${PART:-tests}" = tests ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider \
      tests/unit/test_triton_attention.py tests/unit/test_triton_fused_ops.py \
      -k "8bit or write_kv or decode_attention_matches_reference or triton_backend \
          or rotates_and_writes or rotary" 2>&1 | tail -4
  echo "kernel tests ended $(date +%T)"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
      -k "8bit or graph_decode_matches_reference or lone_request" 2>&1 | tail -4
  echo "tests ended $(date +%T)"
  exit 0
fi
export -f ab_variant
export ab_tmp
for shape in ${SHAPES:-qwen llama}; do
  steps=1
  [ "$shape" = qwen ] && steps=4
  for kv in auto fp8; do
    timeout "${RUN_S:-240}" bash -c 'ab_variant "$@"' _ "$shape-256-$kv" "" \
        --shapes "$shape" --batches 0 --num-scheduler-steps $steps --kv-cache-dtype $kv
  done
done
echo "ended $(date +%T)"
