# Qwen at 256 (issue 5): is the decode step bound by the host or by the GPU, and how long is the
# host's own work per step on the GPU machine's CPU? (H200; carry .whl)
#   1. bench_host_step.py: the host's work of a decode step at 256 (schedule, launch, update),
#      no GPU, on the GPU machine's CPU;
#   2. host_or_gpu.sh's delays: extra host work at the start of each step (0, 150, 300 us);
#   3. extra GPU work per step instead (torch.cuda._sleep after each launch: 150, 300 us);
#   4. step_timeline.py: host phases and GPU span per step.
# If the step grows by the whole host delay and not by the GPU delay, the host sets the step; if
# the other way round, the GPU does. Each engine a fresh process (ab_variant).
#     bash benchmarks/device/qwen256_bound.sh
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
echo "started $(date +%T); $(nproc) CPUs: $(lscpu | grep -m1 'Model name' | sed 's/.*: *//')"
for i in 1 2; do
  python3 benchmarks/bench_host_step.py --steps 200 | sed "s/^/host-only $i: /"
done
gpu_sleep() {  # the patch: $1 us of GPU work after each launch, cycles calibrated once
  echo "
import torch
import baton_engine.runner.model_runner as mr
_s, _e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda._sleep(1000); _s.record(); torch.cuda._sleep(1_000_000); _e.record()
torch.cuda.synchronize()
_cycles = int(1_000_000 * $1 / (_s.elapsed_time(_e) * 1e3))
_launch = mr.ModelRunner.launch
def launch(self, so, _l=_launch):
    h = _l(self, so)
    if not so.is_empty:
        torch.cuda._sleep(_cycles)
    return h
mr.ModelRunner.launch = launch
"
}
host_delay() {
  echo "
import time
import baton_engine.core.engine_core as ec
_step = ec.EngineCore.step
def step(self, _s=_step, _d=$1e-6):
    t = time.perf_counter()
    while time.perf_counter() - t < _d:
        pass
    return _s(self)
ec.EngineCore.step = step
"
}
for round in 1 2; do
  ab_variant "base" "" --shapes qwen --batches 0
  for us in 150 300; do
    ab_variant "host+$us" "$(host_delay $us)" --shapes qwen --batches 0
    ab_variant "gpu+$us" "$(gpu_sleep $us)" --shapes qwen --batches 0
  done
done
python3 benchmarks/device/step_timeline.py --shape qwen --batch 256 --runs 2 \
    > "$out/qwen_timeline.txt" 2>&1
grep -E "^(==|phase|prompt|decode)" "$out/qwen_timeline.txt"
echo "ended $(date +%T)"
