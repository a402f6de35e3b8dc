# Programmatic dependent launch (PDL) for the Triton kernels of decode steps, and the fused GEMV
# layers for Llama-3.1-8B's one-request decode (each measurement a fresh process).
#     bash benchmarks/device/ab_pdl.sh        (carry .whl)
# Stages (STAGES, words): tests (the kernel and engine GPU tests), gemv (bench_gemv_gpu.py's
# layer stacks with and without PDL), llama (batch 1: cuBLAS or GEMV layers, PDL on or off),
# qwen (batch 1 and 256, PDL on or off). ROUNDS (2) rounds of llama and qwen; LLAMA_GEMV=1 adds
# the GEMV variants to the llama stage.
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
stages=" ${STAGES:-tests gemv llama qwen} "
has() { [[ "$stages" == *" $1 "* ]]; }
nopdl="import baton_kernels.triton.common as c; c.PDL = False"
gemv8k="import baton_engine.runner.model_runner as m; m.GEMV_MAX_HIDDEN = 8192"
if has tests; then
  timeout 400 python -m pytest -q tests/gpu/test_engine_gpu.py tests/unit/test_triton_gemv.py \
      tests/unit/test_triton_fused_ops.py tests/unit/test_triton_attention.py \
      -k "gemv or rotary or decode or engine" 2>&1 | tail -3
fi
if has gemv; then
  timeout 200 python benchmarks/bench_gemv_gpu.py 2>&1 | grep -v "^#"
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  if has llama; then
    ab_variant cublas+pdl "" --shapes llama --batches 1
    ab_variant cublas "$nopdl" --shapes llama --batches 1
    if [ -n "${LLAMA_GEMV:-}" ]; then
      ab_variant gemv+pdl "$gemv8k" --shapes llama --batches 1
      ab_variant gemv "$gemv8k; $nopdl" --shapes llama --batches 1
      ab_variant gemv+pdl-pf "$gemv8k; import baton_kernels.triton.gemv as g; g.PREFETCH = False" \
          --shapes llama --batches 1
    fi
  fi
  if has qwen; then
    ab_variant pdl "" --shapes qwen --batches 1,0
    ab_variant nopdl "$nopdl" --shapes qwen --batches 1,0
  fi
done
