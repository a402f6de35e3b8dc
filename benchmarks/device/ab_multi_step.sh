# Multi-step scheduling on the H200 (issue 5: Qwen2.5-0.5B at 256 is host-bound on the slow
# hosts): the GPU test of its tokens, the host's work per decode step on this machine's CPU
# (bench_host_step.py, 1 and 4 passes a step), then issue 5's workload in fresh processes,
# --num-scheduler-steps 1 against 4 and 8 (ROUNDS rounds, default 2), and the other Qwen
# batches and Llama's batch 1 at 1 and 4.
#     bash benchmarks/device/ab_multi_step.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout 150 python3 -m pytest -q -p no:warnings tests/gpu/test_engine_gpu.py \
    tests/gpu/test_triton_attention_gpu.py -k "multi_step or graph_decode or async" 2>&1 | tail -3
echo "tests ended $(date +%T)"
for k in 1 4; do
  timeout 60 python3 benchmarks/bench_host_step.py --steps 100 --num-scheduler-steps $k 2>&1 \
      | tail -5 | sed "s/^/host k=$k /"
done
for round in $(seq ${ROUNDS:-2}); do
  for k in 1 4 8; do
    ab_variant "k$k" "" --shapes qwen --batches 0 --num-scheduler-steps $k
  done
done
echo "qwen 256 ended $(date +%T)"
for k in 1 4; do
  ab_variant "k$k" "" --shapes qwen --batches 64 --num-scheduler-steps $k
  ab_variant "k$k" "" --shapes qwen --batches 1 --num-scheduler-steps $k
  ab_variant "k$k" "" --shapes llama --batches 1 --num-scheduler-steps $k
done
echo "ended $(date +%T)"
