# Where the decode steps of issue 5's workload go on the current code, and what the sampler costs
# on the GPU: the engine's GPU tests first; then Qwen at 256 through step_timeline.py (the GPU's
# idle gaps between steps: is the host behind?) and profile_gpu_steps.py (kernels per decode
# step), Llama at batch 1 through profile_gpu_steps.py, and bench_sampler.py on the device at
# Qwen's vocabulary (top-p's sort against topk first). Full outputs under $OUT.
#     bash benchmarks/device/decode_where.sh        (carry .whl and .gpu)
source benchmarks/device/setup.sh
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
BATON_TEST_MODEL=.gpu/smollm2-shape python3 -m pytest -q -m gpu tests/gpu/test_engine_gpu.py \
    2>&1 | tail -3
python3 benchmarks/device/step_timeline.py --shape qwen --batch 256 --runs 2 \
    > "$out/qwen_timeline.txt" 2>&1
grep -E "^(==|phase|prompt|decode)" "$out/qwen_timeline.txt"
python3 benchmarks/profile_gpu_steps.py --shapes qwen --num-prompts 256 --rows 22 \
    > "$out/qwen_profile.txt" 2>&1
grep -A 30 "decode steps (5)" "$out/qwen_profile.txt" | head -32
python3 benchmarks/profile_gpu_steps.py --shapes llama --num-prompts 1 --rows 22 \
    > "$out/llama_b1_profile.txt" 2>&1
grep -E "round" "$out/llama_b1_profile.txt"
grep -A 30 "decode steps (5)" "$out/llama_b1_profile.txt" | head -32
python3 benchmarks/bench_sampler.py --device cuda --vocab 151936 --rows 64,256 --iters 20
