# Llama-3.1-8B's down projection at batch 1 as a fixed-grid GEMV that applies SiLU-and-multiply
# and the folded norm's 1/rms itself (model_runner.GEMV_DOWN, the default since the
# twenty-eighth session; gemv(..., silu_mul=True, norm_of=stream)) against cuBLAS's split-K GEMM
# after the SiLU kernel ("cublas", BATON_GEMV_DOWN=0). First the kernel's tests and the
# engine's GEMV tests compiled on the H200 with it on; then the engine (bench_gpu_engine.py
# --no-hf --no-checks, each a fresh process), two pairs, Llama batch 1.
#     bash benchmarks/device/ab_gemv_down.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout ${TEST_S:-150} python3 -m pytest -q -p no:warnings tests/unit/test_triton_gemv.py \
    -k "folded_norm or fixed_grid or choose_launch" 2>&1 | tail -2
timeout ${TEST_S:-150} python3 -m pytest -q -p no:warnings -m gpu \
    tests/gpu/test_engine_gpu.py -k lone 2>&1 | tail -2
cublas="import baton_engine.runner.model_runner as mr; mr.GEMV_DOWN = False"
for round in 1 2; do
  ab_variant cublas "$cublas" --shapes llama --batches 1
  ab_variant down "" --shapes llama --batches 1
done
echo "ended $(date +%T)"
