# Fifty-third session, third part: up to GEMV_TOKENS tokens the experts run as GEMVs a pair
# (moe.expert_gemv: no alignment, SiLU-and-multiply inside the down projection's loads). The
# kernel tests in CUDA mode; one Qwen3-30B-A3B layer at 1, 2 and 4 tokens, the GEMVs at each
# of $CONFIGS against the grouped GEMMs (bench_moe_gpu.py); the whole model at batch 1 against
# GEMV_TOKENS = 0, each in a fresh process; then the engine's MoE test on the GPU (its lone
# request through the GEMVs, against the reference backend).
#     bash benchmarks/device/moe53c.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/unit/test_triton_moe.py \
    2>&1 | tail -3
CONFIGS=${CONFIGS:-16/256/4/3,8/256/4/3,4/512/4/2,32/128/4/3,32/256/8/3,64/128/8/3,16/512/4/2,16/128/4/4}
timeout 150 python3 benchmarks/bench_moe_gpu.py --forms fused --tokens 1,2,4 --gemv-configs "$CONFIGS"
echo "layer ended $(date +%T)"
export -f ab_variant
export ab_tmp
for v in gemv grouped; do
  patch=""
  [ $v = grouped ] && patch="import baton_kernels.triton.moe as m; m.GEMV_TOKENS = 0"
  timeout "${RUN_S:-75}" bash -c 'ab_variant "$@"' _ "moe-b1-experts-$v" "$patch" \
      --shapes qwen3moe --batches 1 --num-prompts 2 --output-len 128 \
      --gpu-memory-utilization 0.9
done
echo "engine ended $(date +%T)"
timeout 200 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "mixture_of_experts" 2>&1 | tail -3
echo "ended $(date +%T)"
