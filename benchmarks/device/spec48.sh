# Forty-eighth session: n-gram speculative decoding through the decode graphs (a step's decodes
# and drafts replayed as one graph, a row a token). One call (carry .whl):
#     bash benchmarks/device/spec48.sh
# the GPU test (greedy tokens equal a run without drafts; graphs wider than the batch replayed),
# then spec_probe.py: Qwen2.5-0.5B's and Llama-3.1-8B's shapes (dummy weights, bf16) at batch 1,
# K = 0, 2, 4, and Qwen's at 16 requests, K = 0, 4.
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout -s INT 200 python3 -m pytest -q -rf -x -p no:warnings -p no:cacheprovider --durations=2 \
    tests/gpu/test_engine_gpu.py -k speculative
echo "test ended $(date +%T)"
timeout -s INT 150 python3 benchmarks/device/spec_probe.py --shape qwen --batch 1 --num-prompts 4
echo "qwen b1 ended $(date +%T)"
timeout -s INT 150 python3 benchmarks/device/spec_probe.py --shape llama --batch 1 --num-prompts 2
echo "llama b1 ended $(date +%T)"
timeout -s INT 100 python3 benchmarks/device/spec_probe.py --shape qwen --batch 16 --num-prompts 32 \
    --k 0,4
echo "ended $(date +%T)"
