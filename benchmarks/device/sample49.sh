# The forty-ninth session's third call (carry .whl): the Triton draw (baton_kernels.triton.sample)
# on the GPU: its tests at Qwen's vocabulary, the sampler's GPU tests and the engine's
# speculative test (a seeded request drafting) through it, then the sampler's times, kernel
# against torch's ops, at 1, 64 and 256 rows of 151,936.
#     bash benchmarks/device/sample49.sh
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout -s INT 150 python3 -m pytest -q -rf -p no:warnings -p no:cacheprovider --durations=3 \
    tests/unit/test_triton_sample.py tests/unit/test_triton_top_p.py
timeout -s INT 60 python3 -m pytest -q -rf -p no:warnings -p no:cacheprovider -m gpu \
    tests/unit/test_sampler.py
timeout -s INT 120 python3 benchmarks/bench_sampler.py --device cuda --vocab 151936 \
    --rows 1,64,256 --iters 30
timeout -s INT 200 python3 -m pytest -q -rf -x -p no:warnings -p no:cacheprovider --durations=2 \
    tests/gpu/test_engine_gpu.py -k speculative
echo "ended $(date +%T)"
