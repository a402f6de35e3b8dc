# The forty-ninth session's first call (carry .whl): speculative decoding with async scheduling on
# a GPU. The GPU test (its async run: drafts after pending tokens, taken on the device), then
# spec_probe.py on Qwen2.5-0.5B's shape at batch 1: without async scheduling with drafts
# (--sync-drafts) and with it, and Llama-3.1-8B's with it; the Gemma 2 engine test with the time
# left (heads of 256, float32: compile-bound, never seen to finish). Run at bf198df, when async
# scheduling with drafts was not the default (then --async-drafts; the flags now read as then).
#     bash benchmarks/device/spec49.sh
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout -s INT 200 python3 -m pytest -q -rf -x -p no:warnings -p no:cacheprovider --durations=2 \
    tests/gpu/test_engine_gpu.py -k speculative
for flags in "--sync-drafts" ""; do
  timeout -s INT 100 python3 benchmarks/device/spec_probe.py --shape qwen --batch 1 \
      --num-prompts 4 $flags
done
timeout -s INT 120 python3 benchmarks/device/spec_probe.py --shape llama --batch 1 --num-prompts 2 \
    --k 0,4
echo "probes ended $(date +%T)"
timeout -s INT $((570 - SECONDS)) python3 -m pytest -q -rf -x -p no:warnings -p no:cacheprovider \
    --durations=2 tests/gpu/test_engine_gpu.py -k "sliding and gemma2" 2>&1 | grep -v site-packages
echo "ended $(date +%T)"
