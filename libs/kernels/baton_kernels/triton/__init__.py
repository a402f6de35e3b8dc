"""Triton kernels for paged attention on the GPU.

Three attention kernels, each with a plain-PyTorch ``ref_*`` beside it:

- ``kv_write.write_kv_cache``: new tokens' K/V into the paged cache through the slot mapping.
- ``paged_attention.paged_attention``: a mixed batch of variable-length query chunks, causal over
  each request's cached + new tokens, FlashAttention-style tiles with an online softmax.
- ``decode_attention.decode_attention``: one query token per request, with long contexts split
  across programs (flash-decoding) and the partial results merged by a reduce kernel; on a
  decode-only step it can also rotate q and write the new token's rotated K and V itself.

All of them read the cache through its strides (each layer's view into the block-major pool is not
contiguous), accept any GQA ratio (query heads of one KV head are packed as rows of one tile, so 7
per KV head works), any head size up to 256 (64 and 128 are the tested ones), fp16/bf16/fp32.

``fused_ops`` holds fused elementwise kernels for the decoder layers, also each with a ``ref_*``:

- ``rotary_embedding_``: q and k rotated in place in one launch (rotate-half layout), cos/sin read
  from the float32 ``[max_positions, 2, head_dim]`` table at each token's position; q/k may be
  the strided views split from the fused qkv projection.
- ``silu_and_mul``: ``silu(gate) * up`` of the fused gate/up projection output.
- ``fused_add_rms_norm``: ``residual += x`` in place, then RMSNorm of the sum (float32
  statistics); ``rms_norm`` alone through the same kernel.

On a machine without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this package is imported); the launchers then upcast 16-bit tiles to fp32 inside the kernels,
because the interpreter does bf16 arithmetic on raw bit patterns.
"""
