# The decode attention's start under PDL (decode_attention.EARLY_INPUTS, PREFETCH_TILES) on the
# H200: the kernel's tests compiled there; then the engine (bench_gpu_engine.py --no-hf
# --no-checks, each a fresh process, "cpu ms" the host's speed then) with the old start (the
# PDL wait first, nothing prefetched), with the step's inputs read before the wait, and with
# 1 or 2 tiles of keys prefetched into the L2 too: Qwen at 256 in rounds while the call has
# time (STOP_AFTER seconds, default 330), then Qwen and Llama at batch 1, old start against
# the default; last, the GPU engine tests. (Run in the twenty-sixth session before the launcher
# kept both to split keys: at 256 requests, one split, the variants now launch the same.)
#     bash benchmarks/device/ab_prefetch.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
start=$SECONDS
echo "started $(date +%T)"
timeout 200 python3 -m pytest -q -p no:warnings tests/unit/test_triton_attention.py 2>&1 \
    | tail -2
da="import baton_kernels.triton.decode_attention as da"
old="$da; da.EARLY_INPUTS = False; da.PREFETCH_TILES = 0"
for round in 1 2 3 4; do
  for variant in old early p1 p2; do
    if (( SECONDS - start > ${STOP_AFTER:-330} )); then break 2; fi
    case $variant in
      old) patch="$old" ;;
      early) patch="$da; da.PREFETCH_TILES = 0" ;;
      p1) patch="$da; da.PREFETCH_TILES = 1" ;;
      p2) patch="$da; da.PREFETCH_TILES = 2" ;;
    esac
    ab_variant "$variant" "$patch" --shapes qwen --batches 0
  done
done
echo "qwen 256 ended $(date +%T)"
ab_variant old "$old" --shapes qwen --batches 1
ab_variant default "" --shapes qwen --batches 1
ab_variant old "$old" --shapes llama --batches 1
ab_variant default "" --shapes llama --batches 1
echo "batch 1 ended $(date +%T)"
timeout $((580 - (SECONDS - start))) python3 -m pytest -q -p no:warnings -m gpu \
    tests/gpu/test_engine_gpu.py 2>&1 | tail -3
echo "ended $(date +%T)"
