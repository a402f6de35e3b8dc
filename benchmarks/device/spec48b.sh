# Forty-eighth session, second call (carry .whl): spec_probe.py at batch 1 on Qwen2.5-0.5B's
# shape (K = 0, 2, 4) and Llama-3.1-8B's (K = 0, 4), then the Gemma 3 sliding-window engine
# test (compile-bound: the warm-up now compiles only the split counts its lengths can take).
#     bash benchmarks/device/spec48b.sh
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout -s INT 130 python3 benchmarks/device/spec_probe.py --shape qwen --batch 1 --num-prompts 4
echo "qwen b1 ended $(date +%T)"
timeout -s INT 140 python3 benchmarks/device/spec_probe.py --shape llama --batch 1 --num-prompts 2 \
    --k 0,4
echo "llama b1 ended $(date +%T)"
timeout -s INT $((550 - SECONDS)) python3 -m pytest -q -rf -x -p no:warnings -p no:cacheprovider \
    --durations=2 -o faulthandler_timeout=$((520 - SECONDS)) tests/gpu/test_engine_gpu.py \
    -k "sliding and gemma3" 2>&1 | grep -v "site-packages/_pytest\|site-packages/pluggy"
echo "ended $(date +%T)"
