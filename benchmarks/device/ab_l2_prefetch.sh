# Two L2 prefetches of the thirtieth session, each against the code without it:
# - Llama-3.1-8B's o_proj at batch 1 starts its weight into the L2 before the PDL wait
#   (gemv(l2_prefetch=True): "l2", gemv.L2_PREFETCH on; "nol2" off, the default; "l2blk": the prefetch
#   with o_proj on the one-program-a-block kernel instead of the fixed grid): the decode
#   attention before it reads ~2.6 MB of KV in ~8 us and leaves the memory idle, and o_proj
#   (33.5 MB) read at ~2.4 TB/s alone;
# - the decode attention's key loop starts the next tile's blocks into the L2 at each
#   iteration ("next": decode_attention.PREFETCH_NEXT on; off by default): Qwen 256;
# - and, not an L2 prefetch: the MLP of the prompt steps in row chunks of MLP_ROWS (2,048)
#   tokens ("mlp2k", DecoderLayer.folded_mlp patched), its activations L2-sized: Qwen 256.
# First the compiled tests, then decode_loop.py (the attention alone, graph-timed) and
# mlp_chunks.py (the prompt step's MLP in row chunks, graph-timed), then the
# engine (bench_gpu_engine.py --no-hf --no-checks, each a fresh process), ROUNDS rounds.
#     bash benchmarks/device/ab_l2_prefetch.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout ${TEST_S:-120} python3 -m pytest -q -p no:warnings tests/unit/test_triton_gemv.py \
    -k "l2 or fixed_grid" 2>&1 | tail -2
timeout ${TEST_S:-120} python3 -m pytest -q -p no:warnings -m gpu \
    tests/gpu/test_triton_attention_gpu.py -k "next_tile and bfloat16" 2>&1 | tail -2
timeout ${LOOP_S:-90} python3 benchmarks/device/decode_loop.py --points qwen:256,llama:1 2>&1 \
    | grep -v Warning
timeout ${MLP_S:-60} python3 benchmarks/device/mlp_chunks.py 2>&1 | grep -v Warning
nol2="import baton_kernels.triton.gemv as g; g.L2_PREFETCH = False"
l2="import baton_kernels.triton.gemv as g; g.L2_PREFETCH = True"
l2blk="$l2
f = g.choose_launch
g.choose_launch = lambda n, k: (g.choose_config(n, k), 0) if n == k else f(n, k)"
next="import baton_kernels.triton.decode_attention as d; d.PREFETCH_NEXT = True"
mlp2k="import baton_engine.models.llama as L
whole = L.DecoderLayer.folded_mlp
def chunked(self, stream, rows=${MLP_ROWS:-2048}):
    for r in range(0, stream.shape[0], rows):
        whole(self, stream[r : r + rows])
    return stream
L.DecoderLayer.folded_mlp = chunked"
for round in $(seq 1 "${ROUNDS:-1}"); do
  ab_variant default "" --shapes qwen --batches 256
  ab_variant next "$next" --shapes qwen --batches 256
  ab_variant mlp2k "$mlp2k" --shapes qwen --batches 256
  ab_variant nol2 "$nol2" --shapes llama --batches 1
  ab_variant l2 "$l2" --shapes llama --batches 1
  [[ $round == 1 ]] && ab_variant l2blk "$l2blk" --shapes llama --batches 1
  echo "round $round done $(date +%T)"
done
echo "ended $(date +%T)"
