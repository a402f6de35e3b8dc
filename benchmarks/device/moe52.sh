# Fifty-second session: the fused MoE path on the GPU after its first measurement. One layer of
# Qwen3-30B-A3B by tokens, the router (route_top_k against the torch form) and more tiles; then
# where a decode step's time goes at batch 1 and 64 (decode_parts.py: the graph alone, the
# parts of a launch, the profiler's kernels); then the whole model with the fused router
# against the torch router (each in a fresh process, as moe51.sh's PART=engine).
#     bash benchmarks/device/moe52.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 120 python3 benchmarks/bench_moe_gpu.py --tokens ${TOKENS-1,64,256} \
    --forms fused,router --tiles "${TILES-16/128/128/4/3,16/64/256/4/3,16/32/256/4/4,32/64/128/4/3,32/128/64/4/4,64/64/64/4/4,16/64/128/8/4}"
echo "layer bench ended $(date +%T)"
for b in ${PARTS_BATCHES-1}; do
  echo "== decode parts, batch $b"
  timeout 200 python3 benchmarks/device/decode_parts.py --shape qwen3moe --batch "$b" \
      --num-prompts "$b" --output-len 96 2>&1 | grep -vE "^\s*$|INFO|WARNING" | tail -45
done
echo "decode parts ended $(date +%T)"
export -f ab_variant
export ab_tmp
torch_router="import baton_kernels.triton.moe as k, baton_engine.models.moe as m; k.route_top_k = m.route"
for b in ${BATCHES:-1 64}; do
  for v in fused torch-router; do
    patch=""
    [ $v = torch-router ] && patch=$torch_router
    timeout "${RUN_S:-140}" bash -c 'ab_variant "$@"' _ "moe-b$b-$v" "$patch" \
        --shapes qwen3moe --batches "$b" --num-prompts $((b * 2)) --output-len 128 \
        --gpu-memory-utilization 0.9
  done
done
echo "ended $(date +%T)"
