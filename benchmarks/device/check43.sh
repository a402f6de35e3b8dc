# For the first H200 session after the forty-third (the forty-second and forty-third had no GPU):
# the GPU tests that cover what those sessions changed, in one process (the engine's, with the
# sequence-classification test; structured output, which gained structural tags; LoRA, whose
# adapter paths may be repository ids; disaggregation, whose gateway leaves a stop token's text
# out; the sampler on CUDA with a row whose constraints leave no token), then Qwen 256 at K=4
# once, to see that nothing on the decode path got slower.
#     bash benchmarks/device/check43.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout 400 python3 -m pytest -q -p no:warnings -p no:cacheprovider \
    tests/gpu/test_engine_gpu.py tests/gpu/test_structured_output_gpu.py \
    tests/gpu/test_lora_gpu.py tests/gpu/test_disagg_gpu.py \
    "tests/unit/test_sampler.py::test_a_row_with_every_token_masked_still_gets_a_token_id" \
    2>&1 | tail -10
echo "tests ended $(date +%T)"
ab_variant "qwen256-k4" "" --shapes qwen --batches 0 --num-scheduler-steps 4
echo "ended $(date +%T)"
