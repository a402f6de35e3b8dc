# Fifty-third session, second part: a lone request of Qwen3-30B-A3B. PART=sweep (default): the
# kernel tests in CUDA mode (the sum added to a residual), the engine's MoE test on the GPU
# (its lone request through SparseMoE.add_rows), then the tensor-core GEMV's sweep at the
# attention's projections (qkv 5120 x 2048 with the norm inside, o 2048 x 4096 with the
# residual), whose picks go to $OUT/dot.json where they beat the engine's launch. PART=ab: the
# whole model at batch 1, each variant in a fresh process: the defaults; the experts' layer as
# before add_rows (the router through cuBLAS, the add its own launch); and DOT_LAUNCHES with
# the picks of $DOT_JSON (default benchmarks/device/dot53.json).
#     bash benchmarks/device/moe53b.sh; PART=ab bash benchmarks/device/moe53b.sh   (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${PART:-sweep}" = sweep ]; then
  timeout 120 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/unit/test_triton_moe.py \
      2>&1 | tail -3
  timeout 200 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
      -k "mixture_of_experts" 2>&1 | tail -3
  echo "tests ended $(date +%T)"
  timeout "${SWEEP_S:-300}" python3 benchmarks/bench_gemv_gpu.py --models qwen3moe --dot-sweep \
      --no-stacks --dot-json "${OUT:-/tmp}/dot.json"
  echo "picks: $(cat "${OUT:-/tmp}/dot.json" 2>/dev/null)"
  echo "ended $(date +%T)"
  exit 0
fi
export -f ab_variant
export ab_tmp
before="import baton_engine.models.moe as m
m.SparseMoE.add_rows = lambda self, x, stream: stream.add_(self(x))"
dot="import json, baton_kernels.triton.gemv as g
picks = json.load(open('${DOT_JSON:-benchmarks/device/dot53.json}'))
g.DOT_LAUNCHES.update({tuple(map(int, k.split(','))): tuple(v) for k, v in picks.items()})
print('DOT_LAUNCHES', g.DOT_LAUNCHES)"
for round in $(seq "${ROUNDS:-1}"); do
  for v in default before dot; do
    patch=""
    [ $v = before ] && patch=$before
    [ $v = dot ] && patch=$dot
    timeout "${RUN_S:-75}" bash -c 'ab_variant "$@"' _ "moe-b1-$v" "$patch" \
        --shapes qwen3moe --batches 1 --num-prompts 2 --output-len 128 \
        --gpu-memory-utilization 0.9
  done
done
echo "ended $(date +%T)"
