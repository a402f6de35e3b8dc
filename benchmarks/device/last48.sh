# Forty-eighth session, last call (carry .whl): the new two-engines test, then the Gemma 2
# sliding-window engine test (heads of 256, float32; compile-bound) with what time is left.
#     bash benchmarks/device/last48.sh LIMIT
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout -s INT 150 python3 -m pytest -q -rf -p no:warnings -p no:cacheprovider --durations=2 \
    tests/gpu/test_engine_gpu.py -k "second_engine" 2>&1 | grep -v "site-packages"
echo "first ended $(date +%T)"
timeout -s INT $(($1 - SECONDS)) python3 -m pytest -q -rf -x -p no:warnings -p no:cacheprovider \
    --durations=2 tests/gpu/test_engine_gpu.py -k "sliding and gemma2" 2>&1 | grep -v "site-packages"
echo "ended $(date +%T)"
