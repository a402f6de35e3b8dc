# Fifty-first session: the fused mixture-of-experts kernels (baton_kernels.triton.moe) on the
# GPU. PART=kernels (default): their tests in CUDA mode, the engine's MoE GPU test (decode
# graphs and prompt pieces through the kernels), then one layer of Qwen3-30B-A3B's shape by
# tokens in each form and tile (bench_moe_gpu.py). PART=engine: Qwen3-30B-A3B with dummy
# weights at batch 1 and 64, the Triton experts against the forms before them
# (moe.TRITON_EXPERTS = False: gathered / dense in decode graphs, sorted and no pieces
# elsewhere), each in a fresh process. PART=all: both (BATCHES, RUN_S: a run's limit).
#     bash benchmarks/device/moe51.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T) PART=${PART:=kernels}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$PART" = kernels ] || [ "$PART" = all ]; then
  timeout 180 python3 -m pytest -q -p no:warnings -p no:cacheprovider \
      tests/unit/test_triton_moe.py tests/gpu/test_moe_gpu.py 2>&1 | tail -6
  echo "kernel tests ended $(date +%T)"
  timeout 150 python3 -m pytest -q -p no:warnings -p no:cacheprovider \
      tests/gpu/test_engine_gpu.py -k "mixture_of_experts" 2>&1 | tail -4
  echo "engine test ended $(date +%T)"
  timeout 150 python3 benchmarks/bench_moe_gpu.py --tokens ${TOKENS-1,8,64,256,1024,8192} \
      --tiles "${TILES-16/32/128/4/4,16/64/64/4/4,32/64/128/4/4,64/128/64/8/3,128/128/64/8/3}"
  echo "layer bench ended $(date +%T)"
fi
if [ "$PART" = engine ] || [ "$PART" = all ]; then
  export -f ab_variant
  export ab_tmp
  old="import baton_engine.models.moe as m; m.TRITON_EXPERTS = False"
  for b in ${BATCHES:-1 64}; do
    for v in triton before; do
      patch=""
      [ $v = before ] && patch=$old
      timeout "${RUN_S:-300}" bash -c 'ab_variant "$@"' _ "moe-b$b-$v" "$patch" \
          --shapes qwen3moe --batches "$b" --num-prompts $((b * 2)) --output-len 128 \
          --gpu-memory-utilization 0.9
    done
  done
fi
echo "ended $(date +%T)"
