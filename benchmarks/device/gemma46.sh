# Forty-sixth session (written without a GPU; not yet run): sliding windows and softcaps on the
# GPU. First the GPU tests of the Triton kernels' windows and softcaps at real shapes (against
# their references, in CUDA-graph replays) and of Gemma 2, Gemma 3 and a Mistral-7B-v0.1 kind on
# the GPU's defaults against the eager torch reference; then Gemma 3 1B's shape with dummy
# weights (5 of 6 layers attend to their last 512 tokens) at 256 and 1 requests, against its
# roofline (bench_gpu_engine.roofline counts a local layer's window of KV).
#     bash benchmarks/device/gemma46.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout 300 python3 -m pytest -q -p no:warnings -p no:cacheprovider -m gpu \
    tests/gpu/test_triton_attention_gpu.py -k "window or softcap" 2>&1 | tail -4
timeout 200 python3 -m pytest -q -p no:warnings -p no:cacheprovider \
    tests/gpu/test_engine_gpu.py -k "sliding" 2>&1 | tail -4
echo "tests ended $(date +%T)"
ab_variant "gemma3-256" "" --shapes gemma3 --batches 0
ab_variant "gemma3-b1" "" --shapes gemma3 --batches 1
echo "ended $(date +%T)"
