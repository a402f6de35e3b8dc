# Host work per decode step (the scheduler's, the runner's and the output path's Python) before
# and after a change, on the H200's host. OLD is a copy of the earlier tree's libs/ (default
# .old: `git worktree add /tmp/old REV && mkdir .old && cp -r /tmp/old/libs .old/`, ignored,
# carried). PARTS (default "bench engine b1 tests") picks, in order:
# - bench: bench_host_step.py (no GPU work; this tree's script) with each tree's libraries, in
#   turns;
# - engine: the engine (bench_gpu_engine.py --no-hf --no-checks, Qwen at 256, each a fresh
#   process, "cpu ms" the host's speed then) with each;
# - timeline: step_timeline.py (Qwen at 256, one run) with each, in turns while the call has
#   time (STOP_AFTER seconds, default 300): tok/s, the decode phase's totals (wall, GPU span
#   and gaps, host seconds by phase) and the decode steps' median and mean;
# - b1: Qwen at batch 1 with the decode attention's prefetch off and on;
# - tests: the GPU engine tests in the time left.
#     bash benchmarks/device/ab_host.sh        (carry .whl and .old)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
old=${OLD:-.old}
parts=" ${PARTS:-bench engine b1 tests} "
start=$SECONDS
echo "started $(date +%T)"
old_path="$PWD/$old/libs/engine:$PWD/$old/libs/kernels:$PWD/$old/libs/baton"
with_tree() {  # TREE COMMAND...: the command with TREE's libraries first on the path
  local path=$PYTHONPATH
  [[ $1 == old ]] && path=$old_path:$PYTHONPATH
  shift
  PYTHONPATH=$path "$@"
}
if [[ $parts == *" bench "* ]]; then
  for round in 1 2 3 4; do
    for tree in old new; do
      echo "$tree: $(with_tree $tree python benchmarks/bench_host_step.py --steps 300 \
          | grep -E 'whole|schedule|launch|update' \
          | awk '{printf "%s %s/%s  ", $1, $(NF-2), $(NF-1)}')"
    done
  done
  echo "(median/mean ms: whole step, schedule, launch, update_from_output)"
fi
if [[ $parts == *" engine "* ]]; then
  use_old="import sys; sys.path[:0] = '$old_path'.split(':')"
  for round in 1 2 3; do
    ab_variant old "$use_old" --shapes qwen --batches 0
    ab_variant new "" --shapes qwen --batches 0
  done
  echo "qwen 256 ended $(date +%T)"
fi
if [[ $parts == *" timeline "* ]]; then
  for round in 1 2 3 4 5 6; do
    for tree in old new; do
      if (( SECONDS - start > ${STOP_AFTER:-300} )); then break 2; fi
      with_tree $tree python benchmarks/device/step_timeline.py --shape qwen --batch 256 \
          --runs 1 > /tmp/timeline.txt 2>&1 || tail -3 /tmp/timeline.txt
      echo "$tree $(date +%T): $(grep -E '^== ' /tmp/timeline.txt | tail -1)"
      grep -E "^(phase|decode )" /tmp/timeline.txt | sed 's/^/    /'
    done
  done
  echo "timelines ended $(date +%T)"
fi
if [[ $parts == *" b1 "* ]]; then
  da="import baton_kernels.triton.decode_attention as da"
  for round in 1 2; do
    ab_variant early "$da; da.PREFETCH_TILES = 0" --shapes qwen --batches 1
    ab_variant p1 "" --shapes qwen --batches 1
  done
  echo "batch 1 ended $(date +%T)"
fi
if [[ $parts == *" tests "* ]]; then
  timeout $((585 - (SECONDS - start))) python3 -m pytest -q -p no:warnings -m gpu \
      tests/gpu/test_engine_gpu.py 2>&1 | tail -3
fi
echo "ended $(date +%T)"
