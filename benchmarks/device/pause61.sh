# The GPU sleep tests (now with requests kept: mode "keep") and the profiler's (torch's trace
# of the kernels, cudaProfilerStart/Stop); then Llama-3.1-8B's shape at levels 1, 1, 2 with
# the host copy kept locked after waking (the second level-1 sleep reuses it).
#     bash benchmarks/device/pause61.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "started $(date +%T)"
timeout 240 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "sleep or profiler" 2>&1 | tail -25
timeout 240 python3 benchmarks/bench_sleep.py --model benchmarks/configs/llama-3.1-8b \
    --load-format dummy --device cuda --dtype bfloat16 --prompts 8 --max-tokens 16 \
    --levels 1,1,2 2>&1 | grep -vi "warn" | tail -17
echo "ended $(date +%T)"
