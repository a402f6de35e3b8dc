# The host KV tier (--kv-offloading-size) on a GPU: its GPU test beside the graph-decode one,
# then bench_kv_offloading.py on Llama-3.1-8B's shape (dummy weights, bf16): 16 conversations of
# 4,096-token contexts over a pool of 2,048 blocks (32k tokens), round 2's TTFT without a tier,
# with a 16 GiB pinned tier, and with a pool holding every context.
#     [SKIP_TESTS=1] bash benchmarks/device/offload57.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "started $(date +%T)"
[ -n "$SKIP_TESTS" ] || timeout 240 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "host_kv_tier or graph_decode_matches_reference" 2>&1 | tail -15
echo "tests ended $(date +%T)"
timeout 330 python3 benchmarks/bench_kv_offloading.py --model benchmarks/configs/llama-3.1-8b \
    --load-format dummy --device cuda --dtype bfloat16 --context 4096 --convs 16 --blocks 2048 \
    --offload-gib 16 2>&1 | grep -E "^\||conversations|Error|error" | tail -12
echo "ended $(date +%T)"
