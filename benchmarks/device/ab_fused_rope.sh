# A/B of the fused rotary + KV write on the H200 (batch-1 decode of both shapes), then the GPU
# tests of the engine and of the new kernel at real shapes.
#     bash benchmarks/device/ab_fused_rope.sh   (carry .whl and .gpu)
source benchmarks/device/setup.sh
OUT=${OUT:-benchmarks/out}
summary='import json, sys
for r in json.load(open(sys.argv[1]))["throughput"]:
    print(sys.argv[2], r["shape"], "batch", r["batch"], "tok/s %.1f" % r["output_tok_s"],
          "step ms %.3f" % r["median_decode_step_ms"], "graph ms %.3f" % r["graph_replay_ms"])'
for round in 1 2; do
  python benchmarks/bench_gpu_engine.py --batches 1 --no-hf --no-checks \
      --output-json $OUT/fused$round.json > /dev/null 2>&1
  python -c "$summary" $OUT/fused$round.json fused
  python -c "
import baton_kernels.attention.triton_backend as t, runpy, sys
t.TritonAttentionBackend.fuses_rope = False
sys.argv = ['bench_gpu_engine.py', '--batches', '1', '--no-hf', '--no-checks',
            '--output-json', '$OUT/unfused$round.json']
runpy.run_path('benchmarks/bench_gpu_engine.py', run_name='__main__')
" > /dev/null 2>&1
  python -c "$summary" $OUT/unfused$round.json unfused
done
timeout 200 python -m pytest -q -x tests/gpu/test_engine_gpu.py 2>&1 | tail -3
timeout 100 python -m pytest -q -x tests/unit/test_triton_fused_ops.py tests/unit/test_triton_attention.py \
    -k "rotary_and_kv_write or forward_rope" 2>&1 | tail -3
