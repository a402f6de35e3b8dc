# Forty-fourth session, last GPU call: Llama batch 1 (230.2 in check44.sh, at its 230 target)
# and Qwen 256 at K=4 again, twice each, alternating, each in a fresh process, to see their spread.
#     bash benchmarks/device/repeat44.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
for i in 1 2; do
  ab_variant "llama1" "" --shapes llama --batches 1
  ab_variant "qwen256-k4" "" --shapes qwen --batches 0 --num-scheduler-steps 4
done
echo "ended $(date +%T)"
