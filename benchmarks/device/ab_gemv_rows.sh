# The fused GEMV layers for decode steps of 2 and 4 requests (GEMV_ROWS = 4) against cuBLAS
# layers, Qwen2.5-0.5B shape (2 or 4 prompts, all decoding together; each a fresh process), then
# the 4-row layer stack of bench_gemv_gpu.py.        bash benchmarks/device/ab_gemv_rows.sh
source benchmarks/device/setup.sh
tmp=$(mktemp -d)
cat > "$tmp/summary.py" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["throughput"]:
    print(f"{sys.argv[2]:7} {r['shape']:6} batch {r['batch']} tok/s {r['output_tok_s']:8.1f}"
          f"  step ms {r['median_decode_step_ms']:.3f}  graph ms {r['graph_replay_ms']:.3f}")
PY
variant() {  # name, patch, batch
  python -c "
import runpy, sys
import baton_engine.runner.model_runner as m
$2
sys.argv = ['bench_gpu_engine.py', '--shapes', 'qwen', '--batches', '0', '--num-prompts', '$3',
            '--no-hf', '--no-checks', '--in-process', '--output-json', '$tmp/$1-$3.json']
runpy.run_path('benchmarks/bench_gpu_engine.py', run_name='__main__')
" > "$tmp/$1-$3.log" 2>&1 || tail -5 "$tmp/$1-$3.log"
  python "$tmp/summary.py" "$tmp/$1-$3.json" "$1"
}
for b in 2 4; do
  variant gemv4 "m.GEMV_ROWS = 4" $b
  variant cublas "m.GEMV_MAX_HIDDEN = 0" $b
done
timeout 100 python benchmarks/bench_gemv_gpu.py --rows 4 --models qwen 2>&1 | tail -1
