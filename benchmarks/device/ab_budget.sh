# The step budget (max_num_batched_tokens) of issue 5's workload: 8,192 (the benchmark's so far)
# against 16,384 (vLLM's default for its offline LLM on GPUs of >= 70 GiB), with steps above
# 8,192 tokens eager (PIECE_MAX_TOKENS) or, with PIECES16K=1, captured too. Each measurement a
# fresh process; RUNS (words SHAPE:BATCHES, default "qwen:0") picks the workloads, BUDGETS
# (default "8192 16384") the budgets. Next to try (twenty-seventh session, not run): 32,768,
# half as many prompt steps, each twice as long for the same ~300 eager launches from the host
# (the prompt phase took 0.26 s in slow-host processes against 0.205 s in fast ones). EXTRA adds
# arguments to every run (e.g. "--num-scheduler-steps 4").
#     BUDGETS="16384 32768" EXTRA="--num-scheduler-steps 4" bash benchmarks/device/ab_budget.sh
#     bash benchmarks/device/ab_budget.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
echo "started $(date +%T)"
pieces16k="import baton_engine.runner.cuda_graphs as c; c.PIECE_MAX_TOKENS = 16384"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for run in ${RUNS:-qwen:0}; do
    # shellcheck disable=SC2206
    args=(--shapes "${run%%:*}" --batches "${run#*:}" ${EXTRA:-})
    for budget in ${BUDGETS:-8192 16384}; do
      ab_variant "budget$budget" "" "${args[@]}" --max-num-batched-tokens "$budget"
    done
    if [ -n "${PIECES16K:-}" ]; then
      ab_variant budget16k+pieces "$pieces16k" "${args[@]}" --max-num-batched-tokens 16384
    fi
  done
done
echo "ended $(date +%T)"
