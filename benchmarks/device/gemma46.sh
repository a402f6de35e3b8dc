# Forty-sixth session: sliding windows and softcaps on the GPU. Two calls of up to ~10 min each
# (on a fresh machine every Triton kernel compiles first; the session's own attempt, with
# shorter limits, finished 11 kernel tests and no engine test, RESULTS):
#     bash benchmarks/device/gemma46.sh tests     (carry .whl) the kernels' window/softcap tests
#                                                  at real shapes, then the engine's on Gemma 2,
#                                                  Gemma 3 and a Mistral-7B-v0.1 kind (GPU
#                                                  defaults against the eager torch reference)
#     bash benchmarks/device/gemma46.sh bench     (carry .whl) Gemma 3 1B's shape (5 of 6 layers
#                                                  attend to their last 512 tokens) at 256 and 1
#                                                  requests, against bench_gpu_engine.roofline
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
if [ "$1" = tests ]; then
  timeout 240 python3 -m pytest -q -rf -p no:warnings -p no:cacheprovider \
      tests/gpu/test_triton_attention_gpu.py -k "window or softcap or replays" 2>&1 | tail -6
  echo "kernel tests ended $(date +%T)"
  timeout 330 python3 -m pytest -q -rf -p no:warnings -p no:cacheprovider \
      tests/gpu/test_engine_gpu.py -k "sliding" 2>&1 | tail -6
else
  ab_variant "gemma3-256" "" --shapes gemma3 --batches 0
  ab_variant "gemma3-b1" "" --shapes gemma3 --batches 1
fi
echo "ended $(date +%T)"
