# o_proj's GEMV reading its rows into L2 while the attention runs (gemv's l2_prefetch: the
# programs, launched early under PDL, prefetch before their wait) on the H200: the GEMV tests and
# the GEMV engine test, then the engine at batch 1 with and without it, each a fresh process,
# then the kernels of Llama's batch-1 decode steps with it (profile_gpu_steps.py).
#     bash benchmarks/device/ab_l2.sh        (carry .whl)
# STAGES (words): tests, llama, qwen, profile; ROUNDS (2: the llama A/B again at the end).
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
stages=" ${STAGES:-tests llama qwen profile} "
has() { [[ "$stages" == *" $1 "* ]]; }
echo "started $(date +%T)"
off="import baton_engine.runner.model_runner as m; m.L2_PREFETCH = False"
if has tests; then
  timeout 240 python -m pytest -q -p no:warnings tests/unit/test_triton_gemv.py \
      tests/gpu/test_engine_gpu.py -k "gemv" 2>&1 | tail -3
fi
llama_ab() {
  ab_variant prefetch "" --shapes llama --batches 1
  ab_variant no-pf "$off" --shapes llama --batches 1
}
has llama && llama_ab
if has qwen; then
  ab_variant prefetch "" --shapes qwen --batches 1
  ab_variant no-pf "$off" --shapes qwen --batches 1
fi
for round in $(seq 2 "${ROUNDS:-2}"); do
  has llama && llama_ab
done
if has profile; then
  timeout 150 python benchmarks/profile_gpu_steps.py --shapes llama --num-prompts 1 --rows 22 \
      > "${OUT:-/tmp}/llama_b1_profile.txt" 2>&1
  grep -A 24 "decode steps (5)" "${OUT:-/tmp}/llama_b1_profile.txt" | head -26
fi
echo "ended $(date +%T)"
