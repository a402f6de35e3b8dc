# Sourced by the device A/B scripts (after setup.sh). `ab_variant NAME PATCH ARGS...` runs
# bench_gpu_engine.py with ARGS in a fresh process after the Python statements PATCH (module
# constants to change; "" for the defaults), one engine in that process, without transformers
# or the checks, and prints its summary line (ab_summary.py) labelled NAME.
ab_tmp=${ab_tmp:-$(mktemp -d)}
ab_variant() {
  local name="$1" patch="$2"
  shift 2
  local run
  run="$ab_tmp/$name-$(echo "$*" | tr -c 'a-zA-Z0-9\n' '_')"
  python -c "
import runpy, sys
$patch
sys.argv = ['bench_gpu_engine.py', *sys.argv[1:]]
runpy.run_path('benchmarks/bench_gpu_engine.py', run_name='__main__')
" --no-hf --no-checks --in-process --output-json "$run.json" "$@" > "$run.log" 2>&1 \
      || tail -5 "$run.log"
  python benchmarks/device/ab_summary.py "$run.json" "$name"
}
