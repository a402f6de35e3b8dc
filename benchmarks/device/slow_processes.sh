# Why one engine process in two to four runs issue 5's Qwen-256 decode steps at 2.3-2.7 ms on a
# decode graph of ~1.7 ms (seen since the twenty-second session): step_timeline.py (host
# phases, the GPU's span and idle gaps, per phase) in fresh processes, REPS (3) rounds of the
# VARIANTS (default: all four): the default; pinned to one core (taskset -c PIN_CPU, default
# 2); one intra-op thread (OMP_NUM_THREADS=1); the hash seed fixed (PYTHONHASHSEED=0). Each
# process prints the decode phase's totals, the CPUs it could run on and last ran on, a fixed
# pure-Python loop's time before and after the workload (the host CPU's speed as that process
# saw it) and the share of the machine's CPU time stolen by the hypervisor meanwhile
# (/proc/stat), and where its threads ran and what huge pages it got (placement.py). The
# host's CPU and NUMA layout, the GPU's affinity and the transparent huge pages' mode first.
# Two more variants: Python's objects from glibc's malloc (PYTHONMALLOC=malloc, "pymalloc_off")
# and the same with glibc backing its heap with transparent huge pages
# (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, "thp").
# The twenty-fifth session ran the first four variants (REPS=2): none was the cause, and every
# host phase of a slow process was slower by the same factor. In the twenty-sixth, slow and
# fast processes alternated within a minute (ab_host.sh's timeline part), and the calibration
# loop (in ab_variant.sh) did not tell them apart. Next:
#     VARIANTS="default thp pymalloc_off" REPS=3 bash benchmarks/device/slow_processes.sh
# (carry .whl): is a slow process one whose main thread shares its CPU with a busy thread, or
# one with few huge pages, and does the "thp" variant remove the slow ones?
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
echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
cpu_ticks() {  # the machine's CPU time so far: total and stolen ticks (/proc/stat)
  awk '/^cpu /{t = 0; for (i = 2; i <= NF; i++) t += $i; print t, $9}' /proc/stat
}
timeline() {
  local name="$1"
  shift
  local before after
  before=$(cpu_ticks)
  "$@" python3 -c "
import os, runpy, sys
sys.path.insert(0, 'benchmarks/device')
from cpu_speed import calibrate
import placement
first = calibrate()
placement.start()
sys.argv = ['step_timeline.py', $args]
try:
    runpy.run_path('benchmarks/device/step_timeline.py', run_name='__main__')
except SystemExit:
    pass
placement.report()
print(f'calibration loop ms: {first:.1f} before, {calibrate():.1f} after')
print('cpus', len(os.sched_getaffinity(0)), 'last on', open('/proc/self/stat').read().split()[38])
" > /tmp/timeline.txt 2>&1 || tail -5 /tmp/timeline.txt
  after=$(cpu_ticks)
  echo "$name: $(grep -E '^== ' /tmp/timeline.txt | tail -1)"
  grep -E "^(phase|decode |cpus|decode steps|calibration|placement)" /tmp/timeline.txt \
      | sed 's/^/    /'
  echo "$before $after" | awk '{printf "    stolen: %.1f%% of the CPU time meanwhile\n", 100 * ($4 - $2) / ($3 - $1 + 1e-9)}'
}
for rep in $(seq 1 "${REPS:-3}"); do
  for variant in ${VARIANTS:-default pinned omp1 hashseed0}; do
    case $variant in
      default) timeline default env ;;
      pinned) timeline pinned taskset -c "${PIN_CPU:-2}" ;;
      omp1) timeline omp1 env OMP_NUM_THREADS=1 ;;
      hashseed0) timeline hashseed0 env PYTHONHASHSEED=0 ;;
      pymalloc_off) timeline pymalloc_off env PYTHONMALLOC=malloc ;;
      thp) timeline thp env PYTHONMALLOC=malloc GLIBC_TUNABLES=glibc.malloc.hugetlb=1 ;;
    esac
  done
done
echo "ended $(date +%T)"
