# A/B of the host work per decode step (issue 5: Qwen at 256 is host-bound): the code of this
# tree ("new") against the engine package copied into .ab_old/ ("old", e.g. the last commit's),
# each measurement a fresh process, after the engine's GPU tests.
#     rm -rf .ab_old && mkdir .ab_old && git archive HEAD libs/engine/baton_engine | tar -x -C .ab_old --strip-components=2
#     bash benchmarks/device/ab_host_step.sh        (carry .whl, .gpu and .ab_old)
# Env: ROUNDS (2), SHAPES (qwen), BATCHES (0 64 1; 0 is all 256 prompts at once), SKIP_TESTS,
# PROFILE (1: then the torch profiler over the new code's steps at 256).
source benchmarks/device/setup.sh
tmp=$(mktemp -d)
if [ -z "$SKIP_TESTS" ]; then
  timeout 300 python -m pytest -q -x tests/gpu/test_engine_gpu.py 2>&1 | tail -3
fi
variant() {  # name, extra PYTHONPATH, shape, batch, round
  local run="$1-$3-$4-$5"
  PYTHONPATH="$2$PYTHONPATH" python benchmarks/bench_gpu_engine.py --shapes "$3" --batches "$4" \
      --no-hf --no-checks --output-json "$tmp/$run.json" > "$tmp/$run.log" 2>&1 \
      || tail -5 "$tmp/$run.log"
  python benchmarks/device/ab_summary.py "$tmp/$run.json" "$1"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for shape in ${SHAPES:-qwen}; do
    for batch in ${BATCHES:-0 64 1}; do
      variant new "" $shape $batch $round
      variant old "$PWD/.ab_old:" $shape $batch $round
    done
  done
done
if [ "${PROFILE:-1}" = 1 ]; then
  timeout 240 python benchmarks/profile_gpu_steps.py --shapes qwen --num-prompts 256 2>&1 | tail -60
fi
