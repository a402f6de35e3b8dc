# Qwen 256's decode step as two half batches on two streams (two_halves.py: graph times against
# the engine's one-stream graph); then the decode attention's stages at one split a request
# (decode_attention.ONE_SPLIT_STAGES, 2 since the thirtieth session; "stages3": 3, as before)
# in the engine, graph times, fresh processes, for each word of RUNS (SHAPE:BATCH).
# The thirtieth session's first run of this script (Qwen 256, the patch then set the launch's
# default num_stages to 2 for every split count): graph 1.672 / 1.679 ms against 1.703 / 1.698.
#     bash benchmarks/device/two_halves.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
if [[ -z "${NO_HALVES:-}" ]]; then
  timeout ${HALVES_S:-150} python3 benchmarks/device/two_halves.py 2>&1 | grep -v Warning | tail -6
fi
stages3="import baton_kernels.triton.decode_attention as d; d.ONE_SPLIT_STAGES = 3"
for round in $(seq 1 "${ROUNDS:-1}"); do
  for run in ${RUNS:-llama:256 llama:64}; do
    args=(--shapes "${run%%:*}" --batches "${run#*:}")
    ab_variant stages3 "$stages3" "${args[@]}"
    ab_variant stages2 "" "${args[@]}"
  done
done
echo "ended $(date +%T)"
