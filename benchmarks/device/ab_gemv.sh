# A/B of the fused GEMV layers for one-request decode steps (Qwen2.5-0.5B shape, batch 1; each
# measurement a fresh process), after the GPU tests of the engine and of the GEMV kernel.
#     bash benchmarks/device/ab_gemv.sh        (carry .whl)
# Variants: gemv (the default for hidden sizes up to GEMV_MAX_HIDDEN), cublas (the layers as
# before: norm, cuBLAS linear, SiLU kernels). Env: ROUNDS (3), SHAPES (qwen), SKIP_TESTS.
source benchmarks/device/setup.sh
tmp=$(mktemp -d)
cat > "$tmp/summary.py" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["throughput"]:
    print(f"{sys.argv[2]:7} {r['shape']:6} batch {r['batch']} tok/s {r['output_tok_s']:8.1f}"
          f"  step ms {r['median_decode_step_ms']:.3f}  graph ms {r['graph_replay_ms']:.3f}")
PY
if [ -z "$SKIP_TESTS" ]; then
  timeout 400 python -m pytest -q tests/gpu/test_engine_gpu.py tests/unit/test_triton_gemv.py \
      2>&1 | tail -3
fi
variant() {  # name, python run before the benchmark, shape, round
  local run="$1-$3-$4"
  python -c "
import runpy, sys
$2
sys.argv = ['bench_gpu_engine.py', '--shapes', '$3', '--batches', '1', '--no-hf', '--no-checks',
            '--in-process', '--output-json', '$tmp/$run.json']
runpy.run_path('benchmarks/bench_gpu_engine.py', run_name='__main__')
" > "$tmp/$run.log" 2>&1 || tail -5 "$tmp/$run.log"
  python "$tmp/summary.py" "$tmp/$run.json" "$1"
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  for shape in ${SHAPES:-qwen}; do
    variant gemv "" $shape $round
    variant cublas "import baton_engine.runner.model_runner as m; m.GEMV_MAX_HIDDEN = 0" $shape $round
  done
done
