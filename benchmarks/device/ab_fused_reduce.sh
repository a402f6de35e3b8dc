# A/B of the split reduce fused into the decode attention kernel (batch-1 decode of both shapes,
# each measurement a fresh process), after the GPU tests of the attention kernels and the engine.
#     bash benchmarks/device/ab_fused_reduce.sh        (carry .whl and .gpu)
# Variants: fused64 (the default: fused reduce, slices of >= 64 keys), sep128 (the previous code:
# a separate reduce kernel, slices of >= 128), fused128. Env: ROUNDS (1), SHAPES (qwen llama),
# BATCHES (1), SKIP_TESTS.
source benchmarks/device/setup.sh
tmp=$(mktemp -d)
cat > "$tmp/summary.py" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["throughput"]:
    print(f"{sys.argv[2]:9} {r['shape']:6} batch {r['batch']} tok/s {r['output_tok_s']:8.1f}"
          f"  step ms {r['median_decode_step_ms']:.3f}  graph ms {r['graph_replay_ms']:.3f}")
PY
if [ -z "$SKIP_TESTS" ]; then
  timeout 300 python -m pytest -q -x tests/gpu/test_triton_attention_gpu.py \
      tests/gpu/test_engine_gpu.py tests/unit/test_triton_attention.py -k "decode or engine" \
      2>&1 | tail -3
fi
variant() {  # name, python run before the benchmark, shape, batch, round
  local run="$1-$3-$4-$5"
  python -c "
import runpy, sys
$2
sys.argv = ['bench_gpu_engine.py', '--shapes', '$3', '--batches', '$4', '--no-hf', '--no-checks',
            '--in-process', '--output-json', '$tmp/$run.json']
runpy.run_path('benchmarks/bench_gpu_engine.py', run_name='__main__')
" > "$tmp/$run.log" 2>&1 || tail -5 "$tmp/$run.log"
  python "$tmp/summary.py" "$tmp/$run.json" "$1"
}
patch="import baton_kernels.triton.decode_attention as d"
for round in $(seq 1 "${ROUNDS:-1}"); do
  for shape in ${SHAPES:-qwen llama}; do
    for batch in ${BATCHES:-1}; do
      variant fused64 "" $shape $batch $round  # the default
      variant sep128 "$patch; d.FUSE_REDUCE = False; d.MIN_SPLIT_TOKENS = 128" $shape $batch $round
      variant fused128 "$patch; d.MIN_SPLIT_TOKENS = 128" $shape $batch $round
    done
  done
done
