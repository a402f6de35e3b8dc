# SiLU-and-multiply inside the down projection (silu_linear.silu_and_mul_linear, one Triton
# launch for SiLU, the down GEMM with its K split and the residual add) on the H200: the
# kernel's tests compiled; the tile sweep against the unfused kernels
# (bench_silu_linear_gpu.py, at most SWEEP_S seconds, its JSON in $OUT); then the engine
# (bench_gpu_engine.py --no-hf --no-checks, Qwen at 256, each a fresh process) without it, with
# it in the decode steps (model_runner.FUSED_DOWN_DECODE) and in the prompt steps too
# (FUSED_DOWN_PROMPT), both with the sweep's best tiles (silu_linear.TUNED), in rounds while
# the call has time (STOP_AFTER seconds); last, tests/gpu/test_engine_gpu.py with both on.
#     bash benchmarks/device/ab_silu_down.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
start=$SECONDS
echo "started $(date +%T)"
timeout 150 python3 -m pytest -q -p no:warnings tests/unit/test_triton_silu_linear.py 2>&1 \
    | tail -2
sweep=${OUT:-/tmp}/bench_silu_linear_gpu.json
timeout "${SWEEP_S:-240}" python3 benchmarks/bench_silu_linear_gpu.py \
    --shapes "${SWEEP_SHAPES:-qwen,llama}" --output-json "$sweep"
echo "sweep ended $(date +%T)"
tuned="import json
import baton_kernels.triton.silu_linear as s
points = json.load(open('$sweep'))
for n, k in {(p['n'], p['k']) for p in points}:
    rows = sorted((p['m'], s.SiluLinearConfig(*p['best'])) for p in points if (p['n'], p['k']) == (n, k))
    s.TUNED[n, k] = rows[:-1] + [(1 << 30, rows[-1][1])]
print('tuned', s.TUNED)"
runner="import baton_engine.runner.model_runner as m"
for round in 1 2 3; do
  for variant in base decode both; do
    if (( SECONDS - start > ${STOP_AFTER:-420} )); then break 2; fi
    case $variant in
      base) patch="" ;;
      decode) patch="$runner; m.FUSED_DOWN_DECODE = True
$tuned" ;;
      both) patch="$runner; m.FUSED_DOWN_DECODE = m.FUSED_DOWN_PROMPT = True
$tuned" ;;
    esac
    ab_variant "$variant" "$patch" --shapes qwen --batches 0
  done
done
echo "engine runs ended $(date +%T)"
# the engine's greedy tokens with both on (float32, the kernel's tl.dot in IEEE fp32) against
# the torch backend's
python3 -c "$runner; m.FUSED_DOWN_DECODE = m.FUSED_DOWN_PROMPT = True
$tuned
import sys, pytest
sys.exit(pytest.main(['-q', '-p', 'no:warnings', '-m', 'gpu', 'tests/gpu/test_engine_gpu.py']))
" 2>&1 | tail -3
echo "ended $(date +%T)"
