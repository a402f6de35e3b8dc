# Where Qwen 256's decode phase spends its time beyond a median step, and the prompt step's
# kernels on the current code (twenty-ninth session). Three step_timeline.py processes (the
# default, the cyclic GC frozen after the warm-up, the GC off), each three runs of issue 5's
# workload in one engine (per-step JSON under $OUT), then profile_gpu_steps.py.
#     bash benchmarks/device/qwen256_steps.sh            (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
for gcmode in ${GC_MODES:-default off freeze}; do
  echo "== gc $gcmode $(date +%T)"
  timeout "${TIMEOUT:-150}" python benchmarks/device/step_timeline.py --shape qwen --batch 256 \
    --runs 3 --gc "$gcmode" --output-json "$OUT/steps_$gcmode.json" > "$OUT/steps_$gcmode.txt" 2>&1
  grep -E "^== |^prompt |^decode |above the median|fewer requests|wall median" "$OUT/steps_$gcmode.txt"
done
if [[ -z "${NO_PROFILE:-}" ]]; then
  echo "== profile $(date +%T)"
  timeout "${TIMEOUT:-150}" python benchmarks/profile_gpu_steps.py --shapes qwen --rows 24 \
    > "$OUT/profile_qwen.txt" 2>&1
  grep -E "round|---" "$OUT/profile_qwen.txt"
fi
echo "done $(date +%T)"
