# The forty-first session's last H200 run, on its final tree: the GPU tests of LoRA, of the
# expand kernel and of the engine (embeddings included) in one process; what the LoRA engine's
# doubled CUDA graphs cost (bench_lora.py's engines' "captured" and "KV cache" log lines); and
# Qwen 256 at K=4 without LoRA once (the graphs' switch must cost an engine without LoRA nothing).
#     bash benchmarks/device/final41.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout 300 python3 -m pytest -q -p no:warnings -p no:cacheprovider \
    tests/gpu/test_lora_gpu.py tests/unit/test_triton_lora.py tests/gpu/test_engine_gpu.py \
    2>&1 | tail -8
echo "tests ended $(date +%T)"
timeout 200 python3 benchmarks/bench_lora.py --shape qwen --device cuda --num-prompts 64 \
    --input-len 512 --output-len 128 --num-adapters 4 --log --output-json "$OUT/lora_qwen.json" \
    2>&1 | grep -E "captured|KV cache|configuration|LoRA|adapter|tok/s" | cut -c1-160 | tail -30
ab_variant "qwen256-k4" "" --shapes qwen --batches 0 --num-scheduler-steps 4
echo "ended $(date +%T)"
