# A decoding request calls the KV manager once per block it fills when steps run ahead (async
# scheduling), not twice, against the code before (.ab_old: `git archive <commit> libs | tar -x
# -C .ab_old`): Qwen at 256, each measurement a fresh process, ROUNDS (2) rounds; one step
# timeline of the new code (host phases per decode step). Then the sampler on the device at
# Qwen's vocabulary, and top-p's sort against a sort-free cut (top_p_gpu.py).
#     bash benchmarks/device/ab_kv_calls.sh        (carry .whl and .ab_old)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
old="import sys, glob; sys.path[:0] = sorted(glob.glob('.ab_old/libs/*'))"
for round in $(seq 1 "${ROUNDS:-2}"); do
  ab_variant new "" --shapes qwen --batches 0
  ab_variant old "$old" --shapes qwen --batches 0
done
python3 benchmarks/device/step_timeline.py --shape qwen --batch 256 --runs 2 \
    > "${OUT:-/tmp}/qwen_timeline_new.txt" 2>&1
grep -E "^(==|phase|prompt|decode)" "${OUT:-/tmp}/qwen_timeline_new.txt"
python3 benchmarks/bench_sampler.py --device cuda --vocab 151936 --rows 64,256 --iters 20
python3 benchmarks/device/top_p_gpu.py
