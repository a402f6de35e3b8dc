# Where the CUDA caching allocator goes to the driver during Qwen 256's run (alloc_probe.py, two
# runs in one engine), then the step timeline of two runs at K=4 (step_timeline.py) to place the
# slow steps.
#     bash benchmarks/device/alloc.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout 200 python3 benchmarks/device/alloc_probe.py --shape qwen --batch 256 --runs 2 \
    --num-scheduler-steps 4 2>&1 | grep -vE "Warn|^\s*$" | tail -60
echo "probe ended $(date +%T)"
timeout 200 python3 benchmarks/device/step_timeline.py --shape qwen --batch 256 --runs 2 \
    --num-scheduler-steps 4 2>&1 | grep -vE "^\s*$" | grep -B2 -A14 "prompt phase and"
echo "ended $(date +%T)"
