# Fifty-fifth session, last call: the FP8 layers' kernels compiled after their fixes (the
# quantization kernel's scale as torch's, the tensor-core few-row kernel), the engine's FP8 GPU
# test, the few-row product's launches timed (fp8gemv55.py: the best tensor-core launch over
# Llama's projections at 1 row), then batch-1 decode of both shapes with FP8 layers on the CUDA
# cores against the tensor cores at that launch (and Llama's bf16, the comparison on this card),
# each in a fresh process.
#     bash benchmarks/device/fp8dot55.sh   (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_fp8_linear.py -rf \
    --tb=line 2>&1 | tail -4
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
    -k "fp8_layers or graph_decode_matches_reference" 2>&1 | tail -3
echo "tests ended $(date +%T)"
gemv="${OUT:-$ab_tmp}/fp8gemv55.txt"  # (the whole table comes back in $OUT)
timeout 200 python3 benchmarks/device/fp8gemv55.py > "$gemv" 2>&1
grep -E "WRONG|Error" "$gemv" | head -5
grep -E "^llama (qkv|down) +1 " "$gemv"
sed -n '/^llama M=1/,$p' "$gemv"
best=$(grep '^BEST' "$gemv" | cut -d' ' -f2)
echo "gemv ended $(date +%T), best $best"
[ -z "$best" ] && exit 1
export -f ab_variant
export ab_tmp
dot="import baton_kernels.triton.quant as t; t.GEMV_DOT = $best"
for run in "llama bf16" "llama cores" "llama dot" "qwen cores" "qwen dot"; do
  set -- $run
  patch="" q="--quantization fp8"
  [ "$2" = bf16 ] && q=""
  [ "$2" = dot ] && patch="$dot"
  timeout 150 bash -c 'ab_variant "$@"' _ "$1-b1-$2" "$patch" --shapes "$1" --batches 1 $q
done
echo "ended $(date +%T)"
