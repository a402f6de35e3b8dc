# Where Llama-3.1-8B's 256-request run spends its time (issue 5): the torch profiler over its
# prompt and decode steps (profile_gpu_steps.py), cuBLAS's rate on its projections at the
# prompt step's and the decode step's M (gemm_rates.py), and the decode attention's launch
# variants at 256 requests (decode_loop.py --points llama:256).
#     bash benchmarks/device/llama256_where.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
timeout ${LOOP_S:-150} python3 benchmarks/device/decode_loop.py --points llama:256
echo "== gemm rates $(date +%T)"
timeout ${GEMM_S:-90} python3 benchmarks/device/gemm_rates.py
echo "== profile $(date +%T)"
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
timeout ${PROFILE_S:-200} python3 benchmarks/profile_gpu_steps.py --shapes llama --rows 16 \
    > "$OUT/profile_llama.txt" 2>&1
grep -E "round|^---" "$OUT/profile_llama.txt"
echo "done $(date +%T)"
