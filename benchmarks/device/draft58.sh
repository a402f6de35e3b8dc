# Speculative decoding with a draft model on a GPU: its GPU test beside the n-gram and graph
# ones, then bench_draft_model.py on Qwen2.5-0.5B's shape (dummy weights, bf16): a 2-layer early
# exit of it as the draft (batch 1 and 8) and the model as its own draft (batch 1), K = 3.
#     [SKIP_TESTS=1] bash benchmarks/device/draft58.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "started $(date +%T)"
[ -n "$SKIP_TESTS" ] || timeout 300 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "draft_model or speculative_decoding or graph_decode_matches_reference" 2>&1 | tail -15
echo "tests ended $(date +%T)"
common="--model benchmarks/configs/qwen2.5-0.5b --load-format dummy --device cuda --dtype bfloat16 --k 3 --prompts 8 --max-tokens 128"
timeout 200 python3 benchmarks/bench_draft_model.py $common --draft exit:2 --batch 1,8 2>&1 | grep -E "^ *[0-9]|model|Error|error" | tail -8
timeout 120 python3 benchmarks/bench_draft_model.py $common --draft itself --batch 1 2>&1 | grep -E "^ *[0-9]|model|Error|error" | tail -5
echo "ended $(date +%T)"
