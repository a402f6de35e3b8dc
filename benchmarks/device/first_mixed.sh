# The first mixed step's 14-20 ms in _prepare_inputs (thirty-third session): Qwen 256 at K=4,
# the first run's step PROFILE_STEP (default 1, the first mixed step) under cProfile
# (step_timeline.py --profile-step); with EAGER=1 also a plain timeline with CUDA's eager module
# loading (a lazily loaded kernel's first launch waits for the device).
#     bash benchmarks/device/first_mixed.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeline() {
  timeout 200 python3 benchmarks/device/step_timeline.py --shape qwen --batch 256 --runs 2 \
      --num-scheduler-steps 4 "$@" 2>&1 | grep -vE "^\s*$" \
      | grep -E -A27 "under cProfile|prompt phase and" | grep -vE "^--$"
}
timeline --profile-step "${PROFILE_STEP:-1}"
if [ -n "${EAGER:-}" ]; then
  echo "== CUDA_MODULE_LOADING=EAGER $(date +%T)"
  CUDA_MODULE_LOADING=EAGER timeline
fi
echo "ended $(date +%T)"
