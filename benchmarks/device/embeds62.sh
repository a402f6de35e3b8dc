# Prompt embeddings on a GPU (the GPU's defaults: Triton, decode and piecewise graphs, async
# scheduling), beside the graph-decode reference test.
#     bash benchmarks/device/embeds62.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "started $(date +%T)"
timeout 400 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "prompt_embeddings or graph_decode_matches" 2>&1 | tail -25
echo "ended $(date +%T)"
