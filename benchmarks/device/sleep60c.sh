# Page-locking the host copy faster (first touch in threads, then cudaHostRegister), and what
# the caching allocator keeps while Llama-3.1-8B's shape sleeps.
#     bash benchmarks/device/sleep60c.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 100 python3 benchmarks/device/pin_register.py 15 16
timeout 200 python3 benchmarks/bench_sleep.py --model benchmarks/configs/llama-3.1-8b \
    --load-format dummy --device cuda --dtype bfloat16 --prompts 8 --max-tokens 16 \
    --levels 1 --segments 2>&1 | grep -vi "warn" | tail -14
