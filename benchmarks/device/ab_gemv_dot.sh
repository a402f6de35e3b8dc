# The tensor-core GEMV (gemv(..., dot=...), _gemv_dot_kernel: the weight tile as the MMA's wide
# operand, Triton's software pipeline keeping num_stages weight tiles in flight) on the H200,
# for Llama-3.1-8B's batch-1 decode. PHASE=sweep (the default): bench_gemv_gpu.py's sweep of it
# on the engine's four calls (--folded: gate_up plain, the down projection with SiLU and the
# folded norm inside) against cuBLAS and the CUDA-core kernel's default launch; each shape's
# best launch where it beats what the engine runs goes to $DOT_JSON; then the kernel's tests
# compiled there. PHASE=engine (or after the sweep with ENGINE=1): the engine at batch 1
# (bench_gpu_engine.py --no-hf --no-checks, each a fresh process), the default against "dot"
# (gemv.DOT_LAUNCHES = $DOT_JSON's launches; DOT_SHAPES="N,K ...": those only), and "dot_pfP"
# for each P of PREFETCHES (gemv.DOT_PREFETCH = P: K slices started into the L2 before the PDL
# wait), ROUNDS rounds. The sweep also times the engine's layer stack without attention
# (--folded-stack) with the picks, all and one shape at a time, and with the prefetch.
#     bash benchmarks/device/ab_gemv_dot.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
DOT_JSON=${DOT_JSON:-$ab_tmp/dot.json}
if [ "${PHASE:-sweep}" = sweep ]; then
  timeout ${SWEEP_S:-330} python3 benchmarks/bench_gemv_gpu.py --dot-sweep --folded --no-stacks \
      --models ${MODELS:-llama} --dot-json "$DOT_JSON" --folded-stack
  echo "sweep ended $(date +%T); picks: $(cat "$DOT_JSON" 2>/dev/null)"
  [ -n "${OUT:-}" ] && cp "$DOT_JSON" "$OUT/dot.json" 2>/dev/null
  timeout ${TEST_S:-90} python3 -m pytest -q -p no:warnings tests/unit/test_triton_gemv.py \
      -k "tensor_core or dot_launches" 2>&1 | tail -2
  echo "tests ended $(date +%T)"
fi
if [ "${PHASE:-sweep}" = engine ] || [ -n "${ENGINE:-}" ]; then
  dot="import json, baton_kernels.triton.gemv as g
picks = json.load(open('$DOT_JSON'))
g.DOT_LAUNCHES.update({tuple(map(int, k.split(','))): tuple(v) for k, v in picks.items()
                       if k in '${DOT_SHAPES:-}'.split() or not '${DOT_SHAPES:-}'})
print('DOT_LAUNCHES', g.DOT_LAUNCHES)"
  for round in $(seq ${ROUNDS:-2}); do
    ab_variant default "" --shapes llama --batches 1
    ab_variant dot "$dot" --shapes llama --batches 1
    for pf in ${PREFETCHES:-}; do
      ab_variant dot_pf$pf "$dot
g.DOT_PREFETCH = $pf" --shapes llama --batches 1
    done
  done
  echo "engine ended $(date +%T)"
fi
