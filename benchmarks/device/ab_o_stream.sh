# Twenty-seventh session's last call: the fixed-grid GEMV's tests compiled on the H200, then
# the engine (bench_gpu_engine.py --no-hf --no-checks, each a fresh process): Llama-3.1-8B at
# batch 1 with its o_proj on the fixed grid (the default, gemv.choose_launch) against the
# one-program-a-block kernel ("old"), two pairs; then Qwen at 256, the default against glibc's
# malloc for Python's objects with its heap on transparent huge pages ("thp": is a slow
# process one with few huge pages?), in turns while the call has time (STOP_AFTER, 240 s).
#     bash benchmarks/device/ab_o_stream.sh        (carry .whl)
source benchmarks/device/setup.sh
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
start=$SECONDS
echo "started $(date +%T)"
echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
timeout ${TEST_S:-90} python3 -m pytest -q -p no:warnings tests/unit/test_triton_gemv.py \
    -k "fixed_grid or choose_launch" 2>&1 | tail -2
old="import baton_kernels.triton.gemv as g; g.choose_launch = lambda n, k: (g.choose_config(n, k), 0)"
for round in 1 2; do
  ab_variant default "" --shapes llama --batches 1
  ab_variant old "$old" --shapes llama --batches 1
done
echo "llama ended $(date +%T)"
for round in 1 2 3; do
  if (( SECONDS - start > ${STOP_AFTER:-240} )); then break; fi
  ab_variant default "" --shapes qwen --batches 0
  PYTHONMALLOC=malloc GLIBC_TUNABLES=glibc.malloc.hugetlb=1 ab_variant thp "" --shapes qwen --batches 0
done
echo "ended $(date +%T)"
