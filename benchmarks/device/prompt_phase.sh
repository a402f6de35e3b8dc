# Why Qwen 256's prompt phase follows the host's speed (0.20 s on fast hosts, 0.22-0.25 on slow
# ones, thirty-third session): where the prompt steps synchronise with the device
# (sync_probe.py), then the step timeline of two runs at K=4 (step_timeline.py: host phases,
# GPU span and gaps per step).
#     bash benchmarks/device/prompt_phase.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
python3 -c "import sys; sys.path.insert(0, 'benchmarks/device'); from cpu_speed import calibrate; print('cpu ms', round(calibrate()))"
timeout 150 python3 benchmarks/device/sync_probe.py --shape qwen --batch 256 2>&1 | grep -v Warn | tail -40
echo "probe ended $(date +%T)"
timeout 200 python3 benchmarks/device/step_timeline.py --shape qwen --batch 256 --runs 2 \
    --num-scheduler-steps 4 2>&1 | grep -vE "^\s*$" | head -80
echo "ended $(date +%T)"
