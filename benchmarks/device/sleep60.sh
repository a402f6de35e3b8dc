# Sleep mode on a GPU: the GPU tests (levels 1 and 2, a draft model, graphs captured again),
# then what sleeping gives back and what waking costs for Llama-3.1-8B's and Qwen2.5-0.5B's
# shapes (dummy weights, bf16: level 2's weights are a fresh draw, no disk read).
#     bash benchmarks/device/sleep60.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "started $(date +%T)"
timeout 200 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "sleep" 2>&1 | tail -15
echo "tests ended $(date +%T)"
for model in llama-3.1-8b qwen2.5-0.5b; do
    timeout 200 python3 benchmarks/bench_sleep.py --model benchmarks/configs/$model \
        --load-format dummy --device cuda --dtype bfloat16 --prompts 64 --max-tokens 64 2>&1 |
        grep -vi "warn" | tail -13
done
echo "ended $(date +%T)"
