# Issue 5, Llama-3.1-8B's decode attention with many requests (one split a request, head 128):
# decode_loop.py's launch variants at 256 and 64 requests, then the engine at 256
# (decode_attention.ONE_SPLIT_WIDE_HEAD = WIDE, default 32 keys a tile, 1 warp, 3 stages,
# against the launch before), then batch 1 with the qkv projection on the tensor-core GEMV
# (ab_qkv_dot.sh's variant) against the default, ROUNDS rounds; each engine a fresh process.
#     bash benchmarks/device/ab_wide_head.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
[ -z "${NO_LOOP:-}" ] && timeout ${LOOP_S:-150} python3 benchmarks/device/decode_loop.py \
    --points ${POINTS:-llama:256,llama:64}
d="import baton_kernels.triton.decode_attention as d"
for batch in ${BATCHES:-256}; do
  ab_variant default "" --shapes llama --batches $batch
  ab_variant wide "$d
d.ONE_SPLIT_WIDE_HEAD = (${WIDE:-32, 1, 3})" --shapes llama --batches $batch
done
g="import baton_kernels.triton.gemv as g"
for round in $(seq ${ROUNDS:-2}); do
  ab_variant default "" --shapes llama --batches 1
  ab_variant qkv_dot "$g
g.DOT_LAUNCHES[(6144, 4096)] = (64, 256, 4, 4, 1)" --shapes llama --batches 1
done
echo "ended $(date +%T)"
