# Sourced by the device A/B scripts (after setup.sh). `ab_variant NAME PATCH ARGS...` runs
# bench_gpu_engine.py with ARGS in a fresh process after the Python statements PATCH (module
# constants to change; "" for the defaults), one engine in that process, without transformers
# or the checks, and prints its summary line (ab_summary.py) labelled NAME, with "cpu ms": the
# host CPU's speed at the process's start and end (cpu_speed.py).
ab_tmp=${ab_tmp:-$(mktemp -d)}
ab_variant() {
  local name="$1" patch="$2"
  shift 2
  local run
  run="$ab_tmp/$name-$(echo "$*" | tr -c 'a-zA-Z0-9\n' '_')"
  python -c "
import runpy, sys
sys.path.insert(0, 'benchmarks/device')
from cpu_speed import calibrate
first = calibrate()
$patch
sys.argv = ['bench_gpu_engine.py', *sys.argv[1:]]
try:
    runpy.run_path('benchmarks/bench_gpu_engine.py', run_name='__main__')
finally:
    print(f'cpu ms {first:.0f} / {calibrate():.0f}', file=sys.stderr)
" --no-hf --no-checks --in-process --output-json "$run.json" "$@" > "$run.log" 2>&1 \
      || tail -5 "$run.log"
  python benchmarks/device/ab_summary.py "$run.json" "$name" \
      "$(grep -E '^cpu ms' "$run.log" | tail -1)"
}
