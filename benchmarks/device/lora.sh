# LoRA on the H200 (fortieth session): the GPU tests of LoRA and of the engine, what adapters
# cost (bench_lora.py, Qwen2.5-0.5B and Llama-3.1-8B shapes), and Qwen 256 at K=4 once (the
# runner now sets each step's adapters: a regression check).
#     bash benchmarks/device/lora.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:warnings -p no:cacheprovider \
    tests/gpu/test_lora_gpu.py tests/gpu/test_engine_gpu.py 2>&1 | tail -15
echo "tests ended $(date +%T)"
timeout 200 python3 benchmarks/bench_lora.py --shape qwen --device cuda --num-prompts 64 \
    --input-len 512 --output-len 128 --num-adapters 4 --output-json "$OUT/lora_qwen.json" \
    2>&1 | grep -vE "^(INFO|WARNING)" | tail -8
timeout 240 python3 benchmarks/bench_lora.py --shape llama --device cuda --num-prompts 32 \
    --input-len 512 --output-len 64 --num-adapters 4 --output-json "$OUT/lora_llama.json" \
    2>&1 | grep -vE "^(INFO|WARNING)" | tail -8
for round in 1; do
  ab_variant "qwen256-k4" "" --shapes qwen --batches 0 --num-scheduler-steps 4
done
echo "ended $(date +%T)"
