# The forty-ninth session's second call (carry .whl): seeded sampling by token index on the GPU
# (the sampler's CUDA tests; the engine's speculative test, whose seeded request now drafts,
# async scheduling on by default with drafts), then spec_probe.py on Qwen2.5-0.5B's shape with
# the new defaults against --sync-drafts, at batch 1 and 8.
#     bash benchmarks/device/spec49b.sh
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout -s INT 120 python3 -m pytest -q -rf -p no:warnings -p no:cacheprovider -m gpu \
    tests/unit/test_sampler.py
timeout -s INT 200 python3 -m pytest -q -rf -x -p no:warnings -p no:cacheprovider --durations=2 \
    tests/gpu/test_engine_gpu.py -k speculative
for batch in 1 8; do
  for flags in "" "--sync-drafts"; do
    timeout -s INT 100 python3 benchmarks/device/spec_probe.py --shape qwen --batch $batch \
        --num-prompts $((4 * batch)) $flags
  done
done
echo "ended $(date +%T)"
