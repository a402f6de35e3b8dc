# The decode attention's key loop pipelined by hand (decode_attention(..., next_tile=True): each
# tile's block ids and keys requested into registers before the previous tile's arithmetic, the
# partial last tile inside the loop), twenty-eighth session. First decode_loop.py (every variant
# graph-timed with the engine's inputs), then the engine at Qwen 256 with two of them in place of
# the default launch (bench_gpu_engine.py --no-hf --no-checks, each a fresh process; the
# keyword defaults of decode_attention patched, so every decode launch takes them).
#     bash benchmarks/device/ab_next_tile.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout ${LOOP_S:-150} python3 benchmarks/device/decode_loop.py --points "${POINTS:-qwen:256,qwen:64,qwen:1,llama:1}"
next() {  # TILE WARPS: the patch
  echo "import baton_kernels.triton.decode_attention as da
da.decode_attention.__kwdefaults__.update(next_tile=True, num_stages=1, tile_n=$1, num_warps=$2)"
}
for round in $(seq 1 "${ROUNDS:-1}"); do
  ab_variant default "" --shapes qwen --batches 0
  ab_variant next128/8 "$(next 128 8)" --shapes qwen --batches 0
  ab_variant next64/4 "$(next 64 4)" --shapes qwen --batches 0
done
echo "ended $(date +%T)"
