# Why one engine process in two to four runs issue 5's Qwen-256 decode steps at 2.3-2.7 ms on a
# decode graph of ~1.7-1.8 ms (seen since the twenty-second session; the cause is not known):
# step_timeline.py (host phases, the GPU's span and idle gaps, per phase) in fresh processes,
# REPS (3) of each variant: the default; pinned to one core (taskset -c PIN_CPU, default 2);
# one intra-op thread (OMP_NUM_THREADS=1: torch's threads, if an op runs wide on the host, then
# spin on no core); the hash seed fixed (PYTHONHASHSEED=0). Each variant prints the decode
# phase's totals (a slow process shows whether its host phases or the GPU's gaps grow) and the
# CPUs the process could run on and last ran on. The host's CPU and NUMA layout and the GPU's
# affinity first.
#     bash benchmarks/device/slow_processes.sh        (carry .whl)
# (On a CPU, a smoke run: SMOKE=1 REPS=1 PIN_CPU=1 bash benchmarks/device/slow_processes.sh.)
if [[ -z "${SMOKE:-}" ]]; then
  source benchmarks/device/setup.sh || exit 1
  args="'--shape', 'qwen', '--batch', '256', '--runs', '1'"
else
  args="'--shape', 'tiny', '--device', 'cpu', '--batch', '4', '--num-prompts', '4', '--output-len', '8', '--runs', '1'"
fi
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA|CPU max MHz)"
nvidia-smi topo -m 2>/dev/null | head -3
timeline() {
  local name="$1"
  shift
  "$@" python3 -c "
import os, runpy, sys
sys.argv = ['step_timeline.py', $args]
try:
    runpy.run_path('benchmarks/device/step_timeline.py', run_name='__main__')
except SystemExit:
    pass
print('cpus', len(os.sched_getaffinity(0)), 'last on', open('/proc/self/stat').read().split()[38])
" > /tmp/timeline.txt 2>&1 || tail -5 /tmp/timeline.txt
  echo "$name: $(grep -E '^== ' /tmp/timeline.txt | tail -1)"
  grep -E "^(phase|decode |cpus|decode steps)" /tmp/timeline.txt | sed 's/^/    /'
}
for rep in $(seq 1 "${REPS:-3}"); do
  timeline default env
  timeline pinned taskset -c "${PIN_CPU:-2}"
  timeline omp1 env OMP_NUM_THREADS=1
  timeline hashseed0 env PYTHONHASHSEED=0
done
echo "ended $(date +%T)"
