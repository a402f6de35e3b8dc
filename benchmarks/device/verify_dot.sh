# The tensor-core GEMV after its review mend (51c302a) and its 16-bit-only routing (b94b3a3), on
# the H200: its kernel tests compiled, the engine's greedy tokens through the size-1 graph with
# every projection on it against the torch backend (tests/gpu, float32), and Llama-3.1-8B at
# batch 1 in fresh processes (ROUNDS, default 2).
#     bash benchmarks/device/verify_dot.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout ${TEST_S:-150} python3 -m pytest -q -p no:warnings tests/unit/test_triton_gemv.py \
    -k "tensor_core or dot_launch or choose" 2>&1 | tail -3
echo "kernel tests ended $(date +%T)"
timeout ${TEST_S:-150} python3 -m pytest -q -p no:warnings -m gpu tests/gpu/test_engine_gpu.py \
    -k lone_request 2>&1 | tail -3
echo "engine tests ended $(date +%T)"
for round in $(seq ${ROUNDS:-2}); do
  ab_variant default "" --shapes llama --batches 1
done
echo "engine ended $(date +%T)"
