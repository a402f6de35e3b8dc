# Decode attention with the new token's K/V attended from registers and written after the
# cached keys are read (NEW_KEY_IN_REGISTERS, "regs") against the kernel's default, which
# writes them first, behind a barrier, and reads them back with the keys ("first"), on the
# H200: the rope tests compiled there (both paths) and the engine's greedy-equality GPU tests
# with the new path on; then the engine (each a fresh process, bench_gpu_engine.py --no-hf
# --no-checks; its "graph ms" is the decode graph at the run's last full step) on Qwen at 256
# for ROUNDS (2) rounds, and at batch 1 on Qwen and Llama.
#     bash benchmarks/device/ab_new_key.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
on="import baton_kernels.triton.decode_attention as d; d.NEW_KEY_IN_REGISTERS = True"
timeout 300 python3 -m pytest -q -p no:warnings tests/unit/test_triton_attention.py \
    -k "rotates or rope" 2>&1 | tail -2
timeout 300 python3 -c "$on
import sys, pytest
sys.exit(pytest.main(['-q', '-p', 'no:warnings', '-m', 'gpu', 'tests/gpu/test_engine_gpu.py',
                      '-k', 'graph_decode or lone']))" 2>&1 | tail -2
for round in $(seq 1 "${ROUNDS:-2}"); do
  ab_variant regs "$on" --shapes qwen --batches 0
  ab_variant first "" --shapes qwen --batches 0
done
ab_variant regs "$on" --shapes qwen --batches 1
ab_variant first "" --shapes qwen --batches 1
ab_variant regs "$on" --shapes llama --batches 1
ab_variant first "" --shapes llama --batches 1
echo "ended $(date +%T)"
