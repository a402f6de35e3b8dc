# A/B of the fused GEMV layers for one-request decode steps (Qwen2.5-0.5B shape, batch 1; each
# measurement a fresh process), after the GPU tests of the engine and of the GEMV kernel.
#     bash benchmarks/device/ab_gemv.sh        (carry .whl)
# Variants: gemv (the default for hidden sizes up to GEMV_MAX_HIDDEN), cublas (the layers as
# before: norm, cuBLAS linear, SiLU kernels). Env: ROUNDS (3), SHAPES (qwen), SKIP_TESTS.
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
if [ -z "$SKIP_TESTS" ]; then
  timeout 400 python -m pytest -q tests/gpu/test_engine_gpu.py tests/unit/test_triton_gemv.py \
      2>&1 | tail -3
fi
for round in $(seq 1 "${ROUNDS:-3}"); do
  for shape in ${SHAPES:-qwen}; do
    ab_variant gemv "" --shapes $shape --batches 1
    ab_variant cublas "import baton_engine.runner.model_runner as m; m.GEMV_MAX_HIDDEN = 0" \
        --shapes $shape --batches 1
  done
done
