# The fixed-grid GEMV (gemv's stream, _gemv_stream_kernel) on the H200 (twenty-seventh session):
# bench_gemv_gpu.py's per-shape sweep of it against cuBLAS and the one-program-a-block kernel's
# default launch (Llama-3.1-8B's and Qwen2.5-0.5B's projections at one row), each shape's best
# launch written to a JSON; then the engine at batch 1 (bench_gpu_engine.py --no-hf
# --no-checks, each a fresh process): the default against "stream", whose gemv launches take
# the sweep's best where that is the fixed-grid kernel; last, the engine's GPU tests of the
# GEMV paths with the fixed-grid kernel on (BATON_GEMV_STREAM=4, choose_config's tiles).
#     bash benchmarks/device/ab_gemv_stream.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
best=$ab_tmp/best.json
timeout ${SWEEP_S:-200} python3 benchmarks/bench_gemv_gpu.py --stream-sweep --no-stacks \
    --models llama,qwen --best-json "$best"
echo "best: $(cat "$best")"
stream="import json, baton_kernels.triton.gemv as g
best = {tuple(map(int, k.split(','))): v for k, v in json.load(open('$best')).items()}
orig = g.choose_launch
g.choose_launch = lambda n, k: (tuple(best[n, k][:4]), best[n, k][4]) if best.get((n, k), [0] * 5)[4] else orig(n, k)"
for shape in llama qwen; do
  ab_variant default "" --shapes $shape --batches 1
  ab_variant stream "$stream" --shapes $shape --batches 1
done
echo "engine ended $(date +%T)"
BATON_GEMV_STREAM=4 timeout ${TEST_S:-100} python3 -m pytest -q -p no:warnings -m gpu \
    tests/gpu/test_engine_gpu.py -k "gemv or lone" 2>&1 | tail -3
echo "ended $(date +%T)"
