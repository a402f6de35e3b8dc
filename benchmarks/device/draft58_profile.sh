# Where a step with a draft model spends its time on a GPU (cProfile of the host, batch 1):
# Qwen2.5-0.5B's shape (dummy, bf16) with a 2-layer early exit as its draft, K = 3.
#     bash benchmarks/device/draft58_profile.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 benchmarks/bench_draft_model.py --model benchmarks/configs/qwen2.5-0.5b \
    --load-format dummy --device cuda --dtype bfloat16 --k 3 --prompts 2 --max-tokens 256 \
    --draft exit:2 --batch 1 --profile 30 2>&1 | grep -v "^$" | grep -vi "warn" | tail -80
