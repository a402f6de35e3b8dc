# LoRA on the H200 (forty-first session): base-model steps replay graphs without the adapters
# (the graphs' switch), adapter steps use the Triton expand kernel. `bash
# benchmarks/device/lora_kernel.sh tests` runs the GPU tests of LoRA, of the expand kernel and of
# the engine, then bench_lora.py on the Qwen2.5-0.5B shape; `... llama` the Llama-3.1-8B shape.
# Both compare, in the same run, the adapters' GEMMs (BATON_LORA_EXPAND_KERNEL=0's path).
#     bash benchmarks/device/lora_kernel.sh tests|llama        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
case "$1" in
  tests)
    timeout "${TESTS_S:-280}" python3 -m pytest -q -p no:warnings -p no:cacheprovider \
        tests/gpu/test_lora_gpu.py tests/unit/test_triton_lora.py tests/gpu/test_engine_gpu.py \
        2>&1 | tail -15
    echo "tests ended $(date +%T)"
    timeout 280 python3 benchmarks/bench_lora.py --shape qwen --device cuda --num-prompts 64 \
        --input-len 512 --output-len 128 --num-adapters 4 --compare-gemms \
        --output-json "$OUT/lora_qwen.json" 2>&1 | grep -vE "^(INFO|WARNING)" | tail -10
    ;;
  llama)
    timeout 560 python3 benchmarks/bench_lora.py --shape llama --device cuda --num-prompts 32 \
        --input-len 512 --output-len 64 --num-adapters 4 --compare-gemms \
        --output-json "$OUT/lora_llama.json" 2>&1 | grep -vE "^(INFO|WARNING)" | tail -10
    ;;
esac
echo "ended $(date +%T)"
