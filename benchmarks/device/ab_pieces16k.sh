# Qwen 256's prompt steps (16,384 tokens) run eagerly (PIECE_MAX_TOKENS 8,192): on a slow host
# their launches took as long as their kernels (thirty-third session, prompt_phase.sh: "fwd"
# 14.8-19.7 ms a step against a 26 ms GPU span). With pieces captured up to 16,384: the step
# timeline (host launch time and GPU span a step), then fresh processes against the default,
# K=4 both.
#     bash benchmarks/device/ab_pieces16k.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
p16="import baton_engine.runner.cuda_graphs as c; c.PIECE_MAX_TOKENS = 16384"
timeout 150 python3 -c "
import runpy, sys
$p16
sys.argv = ['step_timeline.py', *sys.argv[1:]]
runpy.run_path('benchmarks/device/step_timeline.py', run_name='__main__')
" --shape qwen --batch 256 --runs 2 --num-scheduler-steps 4 2>&1 | grep -vE "^\s*$" \
    | grep -A 13 -E "^== run"
for round in $(seq ${ROUNDS:-1}); do
  ab_variant pieces16k "$p16" --shapes qwen --batches 0 --num-scheduler-steps 4
  ab_variant default "" --shapes qwen --batches 0 --num-scheduler-steps 4
done
echo "ended $(date +%T)"
