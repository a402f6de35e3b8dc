# Fifty-second session, second part: Qwen3's q/k norms in one in-place launch
# (fused_ops.head_rms_norm_) and each token's expert rows summed by a Triton kernel
# (moe.sum_pairs), against torch's (F.rms_norm on copies of q and k; x.sum(dim=1)): the whole
# Qwen3-30B-A3B model at batch 1 and 64, each variant in a fresh process, then the decode
# step's kernels (decode_parts.py) with the new forms.
#     bash benchmarks/device/moe52b.sh        (carry .whl)
source benchmarks/device/setup.sh || exit 1
source benchmarks/device/ab_variant.sh
export PYTHONUNBUFFERED=1
echo "started $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export -f ab_variant
export ab_tmp
torch_forms="import baton_engine.models.llama as l, baton_kernels.triton.moe as k
fused0 = l.LlamaForCausalLM.use_fused_kernels
def fused_but_qk(self):
    fused0(self)
    for m in self.modules():
        if isinstance(m, l.Attention) and m.q_norm is not None:
            m.q_norm.fused = False
l.LlamaForCausalLM.use_fused_kernels = fused_but_qk
k.sum_pairs = lambda x: x.sum(dim=1)"
for b in ${BATCHES:-1 64}; do
  for v in new torch-forms; do
    patch=""
    [ $v = torch-forms ] && patch=$torch_forms
    timeout "${RUN_S:-140}" bash -c 'ab_variant "$@"' _ "moe-b$b-$v" "$patch" \
        --shapes qwen3moe --batches "$b" --num-prompts $((b * 2)) --output-len 128 \
        --gpu-memory-utilization 0.9
  done
done
echo "engine ended $(date +%T)"
for b in ${PARTS_BATCHES-1 64}; do
  echo "== decode parts, batch $b"
  timeout 200 python3 benchmarks/device/decode_parts.py --shape qwen3moe --batch "$b" \
      --num-prompts "$b" --output-len 96 2>&1 | grep -vE "^\s*$|INFO|WARNING|UserWarn|_warn_once" \
      | tail -62
done
echo "ended $(date +%T)"
