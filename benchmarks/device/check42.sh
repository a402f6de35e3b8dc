# For the first H200 session after the forty-second (which had no GPU): the GPU tests that cover
# what that session changed, in one process (the engine's, with the new sequence-classification
# test; structured output, which gained structural tags; LoRA, whose adapter paths may now be
# repository ids; disaggregation, whose gateway now leaves a stop token's text out), then Qwen
# 256 at K=4 once, to see that nothing on the decode path got slower.
#     bash benchmarks/device/check42.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout 400 python3 -m pytest -q -p no:warnings -p no:cacheprovider \
    tests/gpu/test_engine_gpu.py tests/gpu/test_structured_output_gpu.py \
    tests/gpu/test_lora_gpu.py tests/gpu/test_disagg_gpu.py 2>&1 | tail -10
echo "tests ended $(date +%T)"
ab_variant "qwen256-k4" "" --shapes qwen --batches 0 --num-scheduler-steps 4
echo "ended $(date +%T)"
