# Prompt attention's launch (paged_attention.LONG_CHUNK_CONFIGS) on the H200: the sweep over
# tile rows, keys per tile, warps, stages and program order (bench_attention_gpu.py --sweep
# prefill, the head shapes of MODELS, default both; writes the best per head size to
# $OUT/best.json); the GPU attention tests and the engine's prompt-path GPU tests; then the
# engine (each a fresh process, bench_gpu_engine.py --no-hf --no-checks) with the launch before
# the sweep ("old": 64 rows, 64-key tiles, 4 warps, 2 stages) against the default, on LONG
# (16 x 8,192-token prompts, 16 output tokens: the prompt phase is what the launch changes)
# and on the Qwen-256 workload, for ROUNDS (1) rounds.
#     bash benchmarks/device/ab_prefill.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
out=${OUT:-/tmp}
timeout 330 python3 benchmarks/bench_attention_gpu.py --batches 1 --contexts 512 \
    --models "${MODELS:-qwen,llama}" --sweep prefill --best-out "$out/best.json" 2>&1 \
    | sed -n '/^## prefill sweep/,/^## prefill chunks/p'
cat "$out/best.json"; echo
timeout 200 python3 -m pytest -q -p no:warnings -m gpu tests/gpu/test_triton_attention_gpu.py \
    tests/gpu/test_engine_gpu.py -k "not lone and not async_sampling" 2>&1 | tail -2
old="import baton_kernels.triton.paged_attention as p
p.LONG_CHUNK_CONFIGS.update({64: p.PrefillConfig(64, 64, 4, 2), 128: p.PrefillConfig(64, 64, 4, 2)})"
long="--batches 0 --num-prompts 16 --prompt-len 8192 --output-len 16"
for round in $(seq 1 "${ROUNDS:-1}"); do
  ab_variant old "$old" --shapes "${LONG:-qwen}" $long
  ab_variant default "" --shapes "${LONG:-qwen}" $long
  ab_variant old "$old" --shapes qwen --batches 0
  ab_variant default "" --shapes qwen --batches 0
done
echo "ended $(date +%T)"
