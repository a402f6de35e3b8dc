# Decode steps with each layer's RMSNorms folded into the projections after them
# (model_runner.FOLD_NORMS, LlamaForCausalLM.fold_norms: 2 launches fewer a layer) on the H200:
# the kernel tests this touches, compiled there; then the engine with the fold against without
# it (FOLD_NORMS = False), each a fresh process (bench_gpu_engine.py --no-hf --no-checks;
# compare "graph ms", the decode graph at the run's last full step): Qwen at 256 for ROUNDS (2)
# rounds, Qwen at 64, Llama at batch 1 (its MLP's norm moves into SiLU-and-multiply); then the
# GPU tests in full in the time left, the disaggregation tests on BATON_TEST_MODEL
# (.gpu/smollm2-shape: python benchmarks/make_model_dir.py .gpu/smollm2-shape).
#     bash benchmarks/device/ab_fold.sh        (carry .whl and .gpu)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
start=$SECONDS
echo "started $(date +%T)"
timeout 150 python3 -m pytest -q -p no:warnings tests/unit/test_triton_attention.py \
    tests/unit/test_triton_fused_ops.py -k "folded_norm or mismatched_norm or silu or rotates" \
    2>&1 | tail -2
nofold="import baton_engine.runner.model_runner as m; m.FOLD_NORMS = False"
for round in $(seq 1 "${ROUNDS:-2}"); do
  ab_variant fold "" --shapes qwen --batches 0
  ab_variant nofold "$nofold" --shapes qwen --batches 0
done
ab_variant fold "" --shapes qwen --batches 64
ab_variant nofold "$nofold" --shapes qwen --batches 64
ab_variant fold "" --shapes llama --batches 1
ab_variant nofold "$nofold" --shapes llama --batches 1
echo "engine runs ended $(date +%T)"
BATON_TEST_MODEL=$PWD/.gpu/smollm2-shape timeout $((570 - (SECONDS - start))) \
    python3 -m pytest -q -p no:warnings -m gpu tests/gpu 2>&1 | grep -v "NIXL INFO" | tail -8
echo "ended $(date +%T)"
