# Baton's Triton launch cache (baton_kernels.triton.launch) on the H200: Triton's launcher call in
# this Triton, the GPU tests (the cache's own, the engine's, the attention kernels'), host time
# per launch through the cache against Triton's path (launch_cost.py --launches-only), then
# Qwen 256 at K=4 with the cache (BATON_FAST_LAUNCH=1) and without, ROUNDS rounds (default 2),
# each a fresh process, and the prompt steps' host time with the cache (step_timeline.py).
#     bash benchmarks/device/fast_launch.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
python3 -c "import inspect, triton, triton.runtime.jit as j; print('triton', triton.__version__);
print(*[l.strip() for l in inspect.getsource(j.JITFunction.run).splitlines() if 'kernel.run(' in l or 'knobs.runtime.launch_enter_hook, ' in l], sep='\n')"
timeout 240 python3 -m pytest -q -p no:warnings tests/gpu/test_triton_launch_gpu.py \
    tests/gpu/test_engine_gpu.py tests/gpu/test_triton_attention_gpu.py 2>&1 | tail -4
echo "tests ended $(date +%T)"
timeout 60 python3 benchmarks/device/launch_cost.py --launches-only 2>&1 | grep " us"
for round in $(seq "${ROUNDS:-2}"); do
  for fast in 1 0; do
    export BATON_FAST_LAUNCH=$fast
    ab_variant "fast$fast" "" --shapes qwen --batches 0 --num-scheduler-steps 4
  done
done
echo "A/B ended $(date +%T)"
BATON_FAST_LAUNCH=1 timeout 120 python3 benchmarks/device/step_timeline.py --shape qwen \
    --batch 256 --runs 1 --num-scheduler-steps 4 2>&1 | grep -vE "^\s*$" \
    | grep -E -A12 "prompt phase and"
echo "ended $(date +%T)"
