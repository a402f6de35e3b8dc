# A draft model on a GPU again, after its decode passes' inputs were staged at once: the GPU
# test, then the bench_draft_model.py table of draft58.sh at batch 1 (the 2-layer early exit
# and the model itself), then a cProfile of the host at batch 1 with the 2-layer draft.
#     bash benchmarks/device/draft58_profile.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "draft_model" 2>&1 | tail -3
common="--model benchmarks/configs/qwen2.5-0.5b --load-format dummy --device cuda --dtype bfloat16 --k 3 --batch 1"
timeout 100 python3 benchmarks/bench_draft_model.py $common --draft exit:2 --prompts 8 --max-tokens 128 2>&1 | grep -E "^ *[0-9]|Error|error" | tail -3
timeout 100 python3 benchmarks/bench_draft_model.py $common --draft itself --prompts 8 --max-tokens 128 2>&1 | grep -E "^ *[0-9]|Error|error" | tail -3
timeout 150 python3 benchmarks/bench_draft_model.py $common --draft exit:2 --prompts 2 --max-tokens 256 \
    --profile 28 2>&1 | grep -v "^$" | grep -vi "warn" | tail -66
