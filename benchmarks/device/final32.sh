# The thirty-second session's closing run on the H200 (issue 5): the whole benchmark with
# transformers in the same run, then the compiled tests of the new wide-head decode launch.
#     bash benchmarks/device/final32.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
echo "started $(date +%T)"
timeout ${BENCH_S:-430} python3 benchmarks/bench_gpu_engine.py --output-json "$OUT/bench.json" \
    > "$OUT/bench.txt" 2>&1
echo "bench rc $? ended $(date +%T)"
grep -vE "^\s*$|Warning|warn" "$OUT/bench.txt" | tail -30
timeout ${TEST_S:-60} python3 -m pytest -q -p no:warnings tests/unit/test_triton_attention.py \
    -k "${TESTS:-wide_heads or decode_launch}" 2>&1 | tail -2
echo "tests ended $(date +%T)"
