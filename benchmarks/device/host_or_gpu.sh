# Is Qwen-256's decode step bound by the host or by the GPU? (H200) Each engine step is given
# DELAYS_US (default "0 100 200 400") of extra host work, a busy wait at the start of
# EngineCore.step, each a fresh process (bench_gpu_engine.py --shapes qwen --batches 0, the
# workload's 256 requests). If the median decode step grows by the whole delay, the host sets
# the step's length; if it does not grow until the delay passes some slack, the GPU does, and
# that slack is how far ahead the host runs.
#     bash benchmarks/device/host_or_gpu.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
for us in ${DELAYS_US:-0 100 200 400}; do
  ab_variant "host+${us}us" "
import time
import baton_engine.core.engine_core as ec
_step = ec.EngineCore.step
def step(self, _s=_step, _d=${us}e-6):
    t = time.perf_counter()
    while time.perf_counter() - t < _d:
        pass
    return _s(self)
ec.EngineCore.step = step
" --shapes qwen --batches 0
done
echo "ended $(date +%T)"
