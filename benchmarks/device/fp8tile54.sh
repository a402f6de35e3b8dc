# Fifty-fourth session: why Qwen2.5-0.5B's decode is slower with an FP8 cache. An FP8 key row is
# half a bf16 one's bytes; the decode kernel's tiles were tuned for bf16 (keys per tile by head
# size). Qwen 256 at K=4, each in a fresh process: bf16, fp8 with the default tiles, fp8 with
# tiles of twice the keys (the same bytes a tile as bf16's).
#     bash benchmarks/device/fp8tile54.sh   (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export -f ab_variant
export ab_tmp
double="import baton_kernels.triton.decode_attention as d
orig = d.decode_launches
d.decode_launches = lambda h, n: tuple((2 * t, w, s) for t, w, s in orig(h, n))
import baton_kernels.attention.triton_backend as b
b.decode_launches = d.decode_launches"
run() {
  timeout "${RUN_S:-120}" bash -c 'ab_variant "$@"' _ "$1" "$2" \
      --shapes qwen --batches 0 --num-scheduler-steps 4 --kv-cache-dtype "$3"
}
run qwen-bf16 "" auto
run qwen-fp8 "" fp8
run qwen-fp8-2x "$double" fp8
run qwen-fp8 "" fp8
run qwen-fp8-2x "$double" fp8
echo "ended $(date +%T)"
