# Every GPU test (pytest -m gpu) on the H200 with Baton's Triton launch cache on (FAST=0: off),
# in parallel groups so that Triton's compiles use the host's cores: the engine's and the launch
# cache's tests in one process, disaggregation and tensor parallel (skipped on one GPU) then
# LoRA, mixtures of experts and structured output in another, the attention kernels' cases in
# three. (With a seventh group beside them, 2026-12-06 on an H100, 20 of the engine's 23 tests
# failed within a minute, their messages cut from the output; run alone, its first 14 passed.) Then what launches cost the host (launch_cost.py --launches-only) and
# Qwen 256 at K=4 in fresh processes, cache on and off, ROUNDS rounds (default 2; 0: none).
#     bash benchmarks/device/gpu_tests.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1 BATON_FAST_LAUNCH=${FAST:-1}
echo "started $(date +%T), BATON_FAST_LAUNCH=$BATON_FAST_LAUNCH"
logs=$(mktemp -d)
python3 -m pytest --collect-only -q tests/gpu/test_triton_attention_gpu.py | grep "::" > "$logs/cases"
split -n r/3 "$logs/cases" "$logs/attention."
group() {
  local name=$1
  shift
  timeout "${TESTS_S:-400}" python3 -m pytest -q -p no:warnings -p no:cacheprovider "$@" \
      > "$logs/$name.log" 2>&1
  echo "rc $?" >> "$logs/$name.log"
}
group engine tests/gpu/test_engine_gpu.py tests/gpu/test_triton_launch_gpu.py &
group disagg tests/gpu/test_disagg_gpu.py tests/gpu/test_tensor_parallel_gpu.py \
    tests/gpu/test_lora_gpu.py tests/gpu/test_moe_gpu.py tests/gpu/test_structured_output_gpu.py &
for f in "$logs"/attention.*; do
  mapfile -t cases < "$f"
  group "$(basename "$f")" "${cases[@]}" &
done
wait
for f in "$logs"/*.log; do
  echo "-- $(basename "$f" .log)"
  grep -E "^(FAILED|ERROR)|passed|failed|skipped|^rc " "$f" | tail -12
done
echo "tests ended $(date +%T)"
timeout 60 python3 benchmarks/device/launch_cost.py --launches-only 2>&1 | grep -E " us|host time"
for round in $(seq "${ROUNDS:-2}"); do
  for fast in 1 0; do
    export BATON_FAST_LAUNCH=$fast
    ab_variant "fast$fast" "" --shapes qwen --batches 0 --num-scheduler-steps 4
  done
done
echo "ended $(date +%T)"
