# A/B of the prompt steps' piecewise CUDA graphs (runner.cuda_graphs.PieceGraphs; each
# measurement a fresh process), after the engine's GPU tests.
#     bash benchmarks/device/ab_pieces.sh        (carry .whl)
# Variants: pieces (the default), eager (prompt steps launched op by op, as before), old (also
# without the LM head's warm-up at every row count). Env: ROUNDS (2), SHAPES (qwen), BATCHES
# (256), SKIP_TESTS.
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
if [ -z "$SKIP_TESTS" ]; then
  timeout 400 python -m pytest -q tests/gpu/test_engine_gpu.py 2>&1 | tail -3
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for shape in ${SHAPES:-qwen}; do
    for batch in ${BATCHES:-256}; do
      ab_variant pieces "" --shapes $shape --batches $batch
      ab_variant eager \
          "import baton_engine.runner.model_runner as m; m.ModelRunner.enable_piece_graphs = lambda self, capture: True" \
          --shapes $shape --batches $batch
      ab_variant old \
          "import baton_engine.runner.model_runner as m; m.ModelRunner.enable_piece_graphs = lambda self, capture: True; m.ModelRunner.warmup_kernels = lambda self: self.backend.warmup(self.kv_caches[0], self.model_config.num_heads)" \
          --shapes $shape --batches $batch
    done
  done
done
grep -h "captured" "$ab_tmp"/pieces-*.log | head -2
