"""Triton kernels behind `specserve.ops.triton_attention.TritonAttentionBackend`.

- `common`: the online-softmax step over one block of KV gathered through slot ids.
- `decode`: split-KV (flash-decoding) attention for batches where every request has one query,
  plus the reduce that merges the splits.
- `extend`: flash-attention over a cached prefix plus a causal or custom-masked extra part
  (prefill, chunked prefill, tree verification and tree drafting); at small grids the prefix
  is split across programs and merged with the decode reduce.
"""

from specserve.ops.triton_kernels.decode import decode_attention
from specserve.ops.triton_kernels.extend import extend_attention

__all__ = ["decode_attention", "extend_attention"]
