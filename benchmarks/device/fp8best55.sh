# Fifty-fifth session, after fp8dot55.sh: the few-row FP8 product's launches timed again, in CUDA
# graphs (fp8gemv55.py; fp8dot55.sh's timing loop measured the host's launches), then, if its
# best tensor-core launch over Llama's projections at 1 row is not the default (GEMV_DOT),
# batch-1 decode of both shapes at that launch against the default, each in a fresh process.
#     bash benchmarks/device/fp8best55.sh   (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gemv="${OUT:-$ab_tmp}/fp8gemv55_graphs.txt"  # (the whole table comes back in $OUT)
timeout 240 python3 benchmarks/device/fp8gemv55.py > "$gemv" 2>&1
grep -E "WRONG|Error" "$gemv" | head -5
sed -n '/^llama M=1/,$p' "$gemv"
best=$(grep '^BEST' "$gemv" | cut -d' ' -f2)
default=$(python3 -c "import baton_kernels.triton.quant as t; print(str(t.GEMV_DOT).replace(' ', ''))")
echo "gemv ended $(date +%T), best $best, default $default"
[ -z "$best" ] || [ "$best" = "$default" ] && exit 0
export -f ab_variant
export ab_tmp
dot="import baton_kernels.triton.quant as t; t.GEMV_DOT = $best"
for run in "llama default" "llama best" "qwen default" "qwen best"; do
  set -- $run
  patch=""
  [ "$2" = best ] && patch="$dot"
  timeout 150 bash -c 'ab_variant "$@"' _ "$1-b1-$2" "$patch" --shapes "$1" --batches 1 \
      --quantization fp8
done
echo "ended $(date +%T)"
