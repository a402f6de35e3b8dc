# Top-p on the GPU by the Triton search (baton_kernels.triton.top_p) against the sort of every
# row (the code before, .ab_old: `git archive <commit> libs | tar -x -C .ab_old`): Qwen at 256,
# temperature 1, top-p 0.9, each measurement a fresh process, ROUNDS (2) rounds, and greedy once
# for scale; after the top-p kernel's tests (compiled) and the engine's GPU tests. Then the
# sampler on the device at Qwen's vocabulary and the cuts side by side (top_p_gpu.py).
#     bash benchmarks/device/ab_top_p.sh        (carry .whl, .gpu and .ab_old)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
python3 -m pytest -q tests/unit/test_triton_top_p.py 2>&1 | tail -2
BATON_TEST_MODEL=.gpu/smollm2-shape python3 -m pytest -q -m gpu tests/gpu/test_engine_gpu.py \
    2>&1 | tail -2
old="import sys, glob; sys.path[:0] = sorted(glob.glob('.ab_old/libs/*'))"
top_p=(--shapes qwen --batches 0 --temperature 1 --top-p 0.9)
for round in $(seq 1 "${ROUNDS:-2}"); do
  ab_variant search "" "${top_p[@]}"
  ab_variant sort "$old" "${top_p[@]}"
done
ab_variant greedy "" --shapes qwen --batches 0
python3 benchmarks/bench_sampler.py --device cuda --vocab 151936 --rows 64,256 --iters 20
python3 benchmarks/device/top_p_gpu.py
