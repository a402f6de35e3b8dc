# Sleep mode after its host copy was made one buffer, faulted in by threads and registered: the
# GPU tests, then Llama-3.1-8B's shape at levels 1, 2, 1 (dummy weights, bf16).
#     bash benchmarks/device/sleep60d.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "started $(date +%T)"
timeout 200 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "sleep" 2>&1 | tail -4
timeout 240 python3 benchmarks/bench_sleep.py --model benchmarks/configs/llama-3.1-8b \
    --load-format dummy --device cuda --dtype bfloat16 --prompts 8 --max-tokens 16 \
    --levels 1,2,1 2>&1 | grep -vi "warn" | tail -17
echo "ended $(date +%T)"
