# Sleep mode with requests kept (mode "keep") on the GPU, the GPU sleep tests, and where
# waking the weights spends its second (copy back, unlock, free of the host copy).
#     bash benchmarks/device/pause61.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "started $(date +%T)"
timeout 240 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "sleep" 2>&1 | tail -4
timeout 100 python3 benchmarks/device/pin_register.py 15 16
echo "ended $(date +%T)"
