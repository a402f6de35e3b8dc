# The step budget (max_num_batched_tokens) of issue 5's Qwen workload at 256: 8,192 (the
# benchmark's so far) against 16,384 (vLLM's default for its offline LLM on GPUs of >= 70 GiB),
# with steps above 8,192 tokens eager (PIECE_MAX_TOKENS) or captured too. Each measurement a
# fresh process.
#     bash benchmarks/device/ab_budget.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
pieces16k="import baton_engine.runner.cuda_graphs as c; c.PIECE_MAX_TOKENS = 16384"
for round in $(seq 1 "${ROUNDS:-2}"); do
  ab_variant budget8k "" --shapes qwen --batches 0 --max-num-batched-tokens 8192
  ab_variant budget16k "" --shapes qwen --batches 0 --max-num-batched-tokens 16384
  ab_variant budget16k+pieces "$pieces16k" --shapes qwen --batches 0 --max-num-batched-tokens 16384
done
