# The RMSNorms folded into the prompt steps' layers too (model_runner.FOLD_PROMPTS, the default
# since the twenty-ninth session: the rotary kernel applies the input norm and the qkv bias,
# SiLU-and-multiply the second norm, o_proj and down_proj add into the residual stream) against
# the prompt steps with their norm kernels ("nofold", BATON_FOLD_PROMPTS=0), and with
# SiLU-and-multiply one program a row and columns block ("perblock": each re-reads the stream's
# row). First the changed kernels' tests and the engine's GPU tests compiled on the H200, then
# the argmax launch sweep, then Qwen 256 (bench_gpu_engine.py --no-hf --no-checks, each a fresh
# process), two rounds, then step_timeline.py's picture of the decode phase on this code.
#     bash benchmarks/device/ab_fold_prompts.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout ${TEST_S:-150} python3 -m pytest -q -p no:warnings tests/unit/test_triton_fused_ops.py \
    -k "folded_norm or rotary_and_kv_write or argmax" 2>&1 | tail -2
timeout ${TEST_S:-150} python3 -m pytest -q -p no:warnings -m gpu \
    tests/gpu/test_engine_gpu.py 2>&1 | tail -2
echo "tests done $(date +%T)"
if [[ -z "${NO_ARGMAX:-}" ]]; then
  timeout 120 python3 benchmarks/device/argmax_sweep.py
fi
nofold="import baton_engine.runner.model_runner as mr; mr.FOLD_PROMPTS = False"
perblock="import baton_kernels.triton.fused_ops as f; f.SILU_ROW_LOOP_MIN_ROWS = 1 << 30"
for round in ${ROUNDS:-1 2}; do
  ab_variant nofold "$nofold" --shapes qwen --batches 0
  ab_variant fold "" --shapes qwen --batches 0
  [[ "$round" == 1 ]] && ab_variant perblock "$perblock" --shapes qwen --batches 0
done
echo "timeline $(date +%T)"
# the decode phase step by step on this code (the stalls, the last steps' launches)
if [[ -z "${NO_TIMELINE:-}" ]]; then
  timeout 100 python3 benchmarks/device/step_timeline.py --shape qwen --batch 256 --runs 2 \
      2>&1 | grep -E "^== |^prompt |^decode |above the median|fewer requests|wall median"
fi
echo "ended $(date +%T)"
