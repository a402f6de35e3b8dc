# The decode attention's key loop on the H200 (twenty-seventh session): decode_loop.py's kernel
# variants (one graph of every layer's launch, the engine's inputs), then the engine
# (bench_gpu_engine.py --no-hf --no-checks, each a fresh process): the default against the
# partial tile inside the pipelined loop ("loop": decode_attention.TAIL_IN_LOOP) and against
# that with 64-key tiles in 5 stages ("loop64"), Qwen at 256 in rounds while the call has time
# (STOP_AFTER seconds, default 300), then Qwen and Llama at batch 1.
#     bash benchmarks/device/ab_decode_loop.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
start=$SECONDS
echo "started $(date +%T)"
timeout 200 python3 benchmarks/device/decode_loop.py ${POINTS:+--points $POINTS}
da="import baton_kernels.triton.decode_attention as da; da.TAIL_IN_LOOP = True"
tb="import functools, baton_kernels.attention.triton_backend as tb"
loop64="$da; $tb; tb.decode_attention = functools.partial(tb.decode_attention, tile_n=64, num_stages=5)"
for round in 1 2 3; do
  for variant in default loop loop64; do
    if (( SECONDS - start > ${STOP_AFTER:-300} )); then break 2; fi
    case $variant in
      default) patch="" ;;
      loop) patch="$da" ;;
      loop64) patch="$loop64" ;;
    esac
    ab_variant "$variant" "$patch" --shapes qwen --batches 0
  done
done
echo "qwen 256 ended $(date +%T)"
ab_variant default "" --shapes qwen --batches 1
ab_variant loop "$da" --shapes qwen --batches 1
ab_variant default "" --shapes llama --batches 1
ab_variant loop "$da" --shapes llama --batches 1
echo "ended $(date +%T)"
