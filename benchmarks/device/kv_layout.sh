# Written for the twenty-fourth session's first call. Three things on the H200:
# 1. decode attention's read rate with every layer read in turn (decode_order.py's "all" rows,
#    block sizes 16 and 32): is the ~3.0 TB/s it reads on one replayed layer an L2 effect, and
#    the engine's ~2.5 TB/s the kernel's real rate from HBM?
# 2. the engine with 32-token KV blocks against 16 (twice the contiguous K/V per block read):
#    Qwen at 256 for ROUNDS (2) rounds, and at batch 1 (each a fresh process,
#    bench_gpu_engine.py --no-hf --no-checks; "graph ms" is the decode graph at the run's last
#    full step, the figure to compare when processes' step times spread);
# 3. the GPU tests in full, in the time left (the twenty-third session's run of them on the new
#    prompt-attention launch was cut by its timeout).
#     bash benchmarks/device/kv_layout.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
start=$SECONDS
echo "started $(date +%T)"
timeout 120 python3 benchmarks/device/decode_order.py
for round in $(seq 1 "${ROUNDS:-2}"); do
  ab_variant block32 "" --shapes qwen --batches 0 --block-size 32
  ab_variant block16 "" --shapes qwen --batches 0
done
ab_variant block32 "" --shapes qwen --batches 1 --block-size 32
ab_variant block16 "" --shapes qwen --batches 1
# the tests last, in what is left of the call's 600 s
timeout $((570 - (SECONDS - start))) python3 -m pytest -q -p no:warnings -m gpu tests/gpu \
    --durations=5 2>&1 | tail -12
echo "ended $(date +%T)"
