# Where level 1's seconds go (page-locked allocation vs the copy), the sleep figures of
# Llama-3.1-8B's shape with the device-wide memory column, then the draft model's profile.
#     bash benchmarks/device/sleep60b.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "started $(date +%T)"
timeout 120 python3 benchmarks/device/pinned_copy.py 15
timeout 200 python3 benchmarks/bench_sleep.py --model benchmarks/configs/llama-3.1-8b \
    --load-format dummy --device cuda --dtype bfloat16 --prompts 64 --max-tokens 64 2>&1 |
    grep -vi "warn" | tail -13
echo "sleep ended $(date +%T)"
timeout 150 python3 benchmarks/bench_draft_model.py --model benchmarks/configs/qwen2.5-0.5b \
    --load-format dummy --device cuda --dtype bfloat16 --k 3 --batch 1 --draft exit:2 \
    --prompts 2 --max-tokens 128 --profile 30 2>&1 | grep -v "^$" | grep -vi "warn" | tail -50
echo "ended $(date +%T)"
