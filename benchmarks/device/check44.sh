# Forty-fourth session, second GPU call: the launch cache's GPU tests after their strided case
# stopped reading past its tensor, then every speed target's figure once (Qwen 256 at K=4 twice,
# the K=1 shapes and batch 1 of both models), to see the sessions since the thirty-ninth left
# the engine's speed where it was.
#     bash benchmarks/device/check44.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout 150 python3 -m pytest -q -p no:warnings -p no:cacheprovider \
    tests/gpu/test_triton_launch_gpu.py 2>&1 | tail -4
echo "tests ended $(date +%T)"
ab_variant "qwen256-k4" "" --shapes qwen --batches 0 --num-scheduler-steps 4
ab_variant "qwen256-k4" "" --shapes qwen --batches 0 --num-scheduler-steps 4
ab_variant "qwen1" "" --shapes qwen --batches 1
ab_variant "llama256" "" --shapes llama --batches 0
ab_variant "llama1" "" --shapes llama --batches 1
echo "ended $(date +%T)"
