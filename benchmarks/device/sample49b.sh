# The forty-ninth session's fourth call (carry .whl): the Triton draw after sample49.sh, now for
# batches with seeded rows only and their seeds set in one indexed copy (the third call's 1.69
# ms for 256 seeded rows spent most of its time in a Python loop of 256 tensor writes): its
# tests, the sampler's GPU tests, the sampler's times at 1, 64 and 256 rows of 151,936.
#     bash benchmarks/device/sample49b.sh
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout -s INT 150 python3 -m pytest -q -rf -p no:warnings -p no:cacheprovider --durations=3 \
    tests/unit/test_triton_sample.py tests/unit/test_triton_top_p.py
timeout -s INT 60 python3 -m pytest -q -rf -p no:warnings -p no:cacheprovider -m gpu \
    tests/unit/test_sampler.py
timeout -s INT 120 python3 benchmarks/bench_sampler.py --device cuda --vocab 151936 \
    --rows 1,64,256 --iters 30
echo "ended $(date +%T)"
