# Next session's call (carry .whl), ready to run: speculative decoding with async scheduling on
# a GPU. The GPU test (its async run: drafts after pending tokens, taken on the device), then
# spec_probe.py on Qwen2.5-0.5B's shape at batch 1: defaults (no async with drafts) and
# --async-drafts, and Llama-3.1-8B's with --async-drafts; the Gemma 2 engine test with the time
# left (heads of 256, float32: compile-bound, never seen to finish).
#     bash benchmarks/device/spec49.sh
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout -s INT 200 python3 -m pytest -q -rf -x -p no:warnings -p no:cacheprovider --durations=2 \
    tests/gpu/test_engine_gpu.py -k speculative
for flags in "" "--async-drafts"; do
  timeout -s INT 100 python3 benchmarks/device/spec_probe.py --shape qwen --batch 1 \
      --num-prompts 4 $flags
done
timeout -s INT 120 python3 benchmarks/device/spec_probe.py --shape llama --batch 1 --num-prompts 2 \
    --k 0,4 --async-drafts
echo "probes ended $(date +%T)"
timeout -s INT $((570 - SECONDS)) python3 -m pytest -q -rf -x -p no:warnings -p no:cacheprovider \
    --durations=2 tests/gpu/test_engine_gpu.py -k "sliding and gemma2" 2>&1 | grep -v site-packages
echo "ended $(date +%T)"
