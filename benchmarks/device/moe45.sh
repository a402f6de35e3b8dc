# Forty-fifth session (written without a GPU; not yet run): mixtures of experts on the GPU.
# First the GPU tests of a Qwen3-MoE shape (decode steps from CUDA graphs, the experts in their
# static-shape forms, against the eager reference) and of Granite's multipliers, then Qwen3-30B-A3B's shape with dummy
# weights (61 GB of bf16: fits an H100's 80 GB with ~8 GB of KV) at batch 1 and 64, to see where
# the experts without a fused kernel leave it against its roofline (bench_gpu_engine.roofline).
#     bash benchmarks/device/moe45.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout 200 python3 -m pytest -q -p no:warnings -p no:cacheprovider \
    tests/gpu/test_engine_gpu.py -k "mixture_of_experts or granite" 2>&1 | tail -4
echo "tests ended $(date +%T)"
ab_variant "qwen3moe-b1" "" --shapes qwen3moe --batches 1 --num-prompts 4 --output-len 128
ab_variant "qwen3moe-b64" "" --shapes qwen3moe --batches 64 --num-prompts 64 --output-len 128
echo "ended $(date +%T)"
