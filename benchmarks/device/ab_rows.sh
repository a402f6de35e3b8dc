# Decode-step host work on the GPU, Qwen at batch 1 and 256, each measurement a fresh process,
# ROUNDS (2) rounds:
#   head    the code as it is: the LM head and argmax of a greedy decode step replayed from a
#           graph per size (DecodeGraphs.greedy_ids);
#   nohead  the same code launching them as before (greedy_ids patched to return None);
#   old     the libraries in .ab_old (`git archive <commit> libs | tar -x -C .ab_old`): before
#           the per-row inputs went into one copy, and before the head graphs.
#     bash benchmarks/device/ab_rows.sh        (carry .whl and .ab_old)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
nohead="import baton_engine.runner.cuda_graphs as c; c.DecodeGraphs.greedy_ids = lambda s, n: None"
old="import sys, glob; sys.path[:0] = sorted(glob.glob('.ab_old/libs/*'))"
for round in $(seq 1 "${ROUNDS:-2}"); do
  ab_variant head "" --shapes qwen --batches 1,0
  ab_variant nohead "$nohead" --shapes qwen --batches 1,0
  ab_variant old "$old" --shapes qwen --batches 1,0
done
