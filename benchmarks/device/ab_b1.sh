# One-request decode on the H200: decode attention that skips the slices past a request's keys,
# the attention's projections of Llama-3.1-8B as GEMVs (the MLP with cuBLAS), and a Triton
# argmax, against the code before (.ab_old: `git archive <commit> libs | tar -x -C .ab_old`).
#     bash benchmarks/device/ab_b1.sh        (carry .whl and .ab_old)
# Stages (STAGES, words): tests (the GPU tests these touch; quicktests: decode attention's),
# kernels (b1_kernels.py), llama (batch 1: new, new with cuBLAS layers, new with torch's argmax,
# old), qwen (batch 1 and 256: new, new with torch's argmax, old). ROUNDS (1).
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
stages=" ${STAGES:-tests kernels llama qwen} "
echo "started $(date +%T)"
has() { [[ "$stages" == *" $1 "* ]]; }
old="import sys, glob; sys.path[:0] = sorted(glob.glob('.ab_old/libs/*'))"
cublas="import baton_engine.runner.model_runner as m; m.GEMV_ATTN_MAX_HIDDEN = 0"
torch_argmax="import baton_kernels.fused as f; f.ARGMAX_TRITON = False"
if has quicktests; then
  timeout 200 python -m pytest -q -p no:warnings -x tests/gpu/test_triton_attention_gpu.py \
      tests/unit/test_triton_attention.py -k "decode or slices" 2>&1 | tail -2
fi
if has tests; then
  timeout 300 python -m pytest -q -p no:warnings -x tests/gpu/test_engine_gpu.py \
      tests/gpu/test_triton_attention_gpu.py tests/unit/test_triton_fused_ops.py \
      tests/unit/test_triton_attention.py -k "gemv or decode or argmax or graph" 2>&1 | tail -3
fi
if has kernels; then
  timeout 200 python benchmarks/device/b1_kernels.py
fi
for round in $(seq 1 "${ROUNDS:-1}"); do
  if has llama; then
    ab_variant new "" --shapes llama --batches 1
    ab_variant new-cublas-layers "$cublas" --shapes llama --batches 1
    ab_variant new-torch-argmax "$torch_argmax" --shapes llama --batches 1
    ab_variant old "$old" --shapes llama --batches 1
  fi
  if has qwen; then
    ab_variant new "" --shapes qwen --batches 1,0
    ab_variant new-torch-argmax "$torch_argmax" --shapes qwen --batches 1,0
    ab_variant old "$old" --shapes qwen --batches 1,0
  fi
done
