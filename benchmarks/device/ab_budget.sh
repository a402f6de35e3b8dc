# The step budget (max_num_batched_tokens) of issue 5's workload: 8,192 (the benchmark's so far)
# against 16,384 (vLLM's default for its offline LLM on GPUs of >= 70 GiB), with steps above
# 8,192 tokens eager (PIECE_MAX_TOKENS) or, with PIECES16K=1, captured too. Each measurement a
# fresh process; RUNS (words SHAPE:BATCHES, default "qwen:0") picks the workloads.
#     bash benchmarks/device/ab_budget.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
pieces16k="import baton_engine.runner.cuda_graphs as c; c.PIECE_MAX_TOKENS = 16384"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for run in ${RUNS:-qwen:0}; do
    args=(--shapes "${run%%:*}" --batches "${run#*:}")
    ab_variant budget8k "" "${args[@]}" --max-num-batched-tokens 8192
    ab_variant budget16k "" "${args[@]}" --max-num-batched-tokens 16384
    if [ -n "${PIECES16K:-}" ]; then
      ab_variant budget16k+pieces "$pieces16k" "${args[@]}" --max-num-batched-tokens 16384
    fi
  done
done
