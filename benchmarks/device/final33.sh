# The thirty-third session's closing runs on the H200 (issue 5): the whole benchmark (checks,
# both shapes, transformers in the same run) with multi-step scheduling, K=4.
#     bash benchmarks/device/final33.sh        (carry .whl)
# QWEN=1: instead, Qwen 256 alone in fresh processes, K=4 and K=1 in turns (ROUNDS, default 3).
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
echo "started $(date +%T)"
if [[ -n "${QWEN:-}" ]]; then
  source benchmarks/device/ab_variant.sh
  for round in $(seq ${ROUNDS:-3}); do
    ab_variant k4 "" --shapes qwen --batches 0 --num-scheduler-steps 4
    ab_variant k1 "" --shapes qwen --batches 0 --num-scheduler-steps 1
  done
else
  timeout ${BENCH_S:-540} python3 benchmarks/bench_gpu_engine.py --num-scheduler-steps 4 \
      --output-json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  echo "bench rc $? ended $(date +%T)"
  grep -vE "^\s*$|Warning|warn" "$OUT/bench.txt" | grep -E "baton|hf |greedy|logprobs" | tail -40
fi
echo "ended $(date +%T)"
