# The fused GEMV layers for decode steps of 2 and 4 requests (GEMV_ROWS = 4) against cuBLAS
# layers, Qwen2.5-0.5B shape (2 or 4 prompts, all decoding together; each a fresh process), then
# the 4-row layer stack of bench_gemv_gpu.py.        bash benchmarks/device/ab_gemv_rows.sh
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
for b in 2 4; do
  m="import baton_engine.runner.model_runner as m"
  ab_variant gemv4 "$m; m.GEMV_ROWS = 4" --shapes qwen --batches 0 --num-prompts $b
  ab_variant cublas "$m; m.GEMV_MAX_HIDDEN = 0" --shapes qwen --batches 0 --num-prompts $b
done
timeout 100 python benchmarks/bench_gemv_gpu.py --rows 4 --models qwen 2>&1 | tail -1
