# Decode graphs' per-row inputs in one copy (one buffer, padding rows reset on the host)
# against the code before (.ab_old: `git archive <commit> libs | tar -x -C .ab_old`), Qwen at
# batch 1 and 256, each measurement a fresh process, ROUNDS (2) rounds.
#     bash benchmarks/device/ab_rows.sh        (carry .whl and .ab_old)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
old="import sys, glob; sys.path[:0] = sorted(glob.glob('.ab_old/libs/*'))"
for round in $(seq 1 "${ROUNDS:-2}"); do
  ab_variant rows "" --shapes qwen --batches 1,0
  ab_variant old "$old" --shapes qwen --batches 1,0
done
