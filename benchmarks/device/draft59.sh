# What a draft model costs a step on a GPU (dummy weights, bf16, batch 1, K = 3): Qwen2.5-0.5B's
# shape with a 2-layer early exit (its first pass through its decode graphs), Llama-3.1-8B's
# shape with a 2-layer early exit (a dummy early exit keeps ~0 drafts: its ms/step against no
# drafts' is the cost to pay back), Qwen's 2-layer draft with its first pass through its
# piecewise graphs (as before); the GPU test; a cProfile of the host at batch 1 with Qwen's
# 2-layer draft; Qwen as its own draft.
#     [SHORT=1] bash benchmarks/device/draft59.sh        (carry .whl; SHORT: the figures and test only)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "started $(date +%T)"
bench() { timeout "$1" python3 benchmarks/bench_draft_model.py --load-format dummy --device cuda \
    --dtype bfloat16 --k 3 --batch 1 "${@:2}" 2>&1 | grep -E "^ *[0-9]|^model|Error|error" | tail -4; }
qwen="--model benchmarks/configs/qwen2.5-0.5b --prompts 8 --max-tokens 128"
bench 100 $qwen --draft exit:2
bench 150 --model benchmarks/configs/llama-3.1-8b --draft exit:2 --prompts 2 --max-tokens 96
bench 100 $qwen --draft exit:2 --prompt-first-pass
echo "benches ended $(date +%T)"
timeout 120 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "draft_model" 2>&1 | tail -3
[ -n "$SHORT" ] && { echo "ended $(date +%T)"; exit 0; }
timeout 100 python3 benchmarks/bench_draft_model.py --model benchmarks/configs/qwen2.5-0.5b \
    --load-format dummy --device cuda --dtype bfloat16 --k 3 --batch 1 --draft exit:2 \
    --prompts 2 --max-tokens 128 --profile 30 2>&1 | grep -v "^$" | grep -vi "warn" | tail -72
bench 100 $qwen --draft itself
echo "ended $(date +%T)"
