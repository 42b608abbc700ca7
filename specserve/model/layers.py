"""The layers of a Llama-family decoder, each with its fused GPU variant.

Which variant runs is the caller's `Kernels` (config/kernels.py), carried in the
`ForwardContext`: `fused_mode` reads it per call.
- mode 2, few tokens: every linear layer is the skinny Triton GEMM (ops/triton_linear.py),
  which also applies the RMSNorm before qkv / gate_up, the SiLU-and-mul before down and the
  residual add after o / down, so a layer runs no elementwise kernel between its matmuls;
- mode 1: F.linear with the fused Triton RMSNorm, residual-add + RMSNorm and SiLU-and-mul
  (ops/triton_norm.py);
- mode 3, deterministic inference: every linear layer, for any token count, is the
  batch-invariant GEMM (ops/triton_invariant_linear.py) with the residual add in its
  epilogue, beside the fused norm and SiLU-and-mul kernels (each row in one program);
- mode 4, few tokens of a model whose weight shapes have tuned tiles (the Llama-3-8B ones on
  an H200): those linear layers run the batch-invariant GEMM for speed, as in mode 3, the
  others F.linear beside the fused norm kernels; a layer keeps mode 1's arrangement unless
  every one of its matmuls has a tuned tile (`arrangement_mode`);
- mode 0: the plain torch ops below (CPU, training, the reference every kernel is tested
  against).
Kernels read the parameters at call time, so weights loaded after construction are used as
they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config.kernels import REFERENCE, Kernels
from specserve.model.config import ModelConfig
from specserve.model.rope import RotaryEmbedding
from specserve.ops.attention import ForwardContext


def fused_mode(x: torch.Tensor, kernels: Kernels) -> int:
    """0: plain torch ops; 1: F.linear + fused elementwise kernels; 2: skinny GEMM;
    3: the batch-invariant GEMM; 4: the batch-invariant GEMM for the tuned weight shapes."""
    if kernels.batch_invariant_matmul:
        return 3
    rows = x.numel() // max(1, x.shape[-1])
    if kernels.skinny_applies(rows, x.shape[-1]):
        return 2
    if kernels.invariant_gemm_applies(rows, x.shape[-1]):
        return 4
    return 1 if kernels.fused_norms else 0


def arrangement_mode(x: torch.Tensor, kernels: Kernels, linears) -> int:
    """`fused_mode`, for a caller choosing how a layer's ops are arranged around `linears`:
    mode 4's arrangement (norms before, residual adds inside the GEMMs) only where every one
    of them has a tuned tile, which is what was measured (the Llama-3-8B shapes); elsewhere
    mode 1's (add+RMSNorm kernels, the residual carried into the next norm), with each tuned
    matmul still run by the batch-invariant GEMM (`fused_linear` checks each weight)."""
    mode = fused_mode(x, kernels)
    if mode == 4 and not all(kernels.invariant_gemm_tuned(lin.weight.shape) for lin in linears):
        return 1 if kernels.fused_norms else 0
    return mode


def invariant_gemm_runs(mode: int, weight: torch.Tensor, kernels: Kernels) -> bool:
    """Whether a matmul with this weight runs the batch-invariant GEMM in `mode`."""
    return mode == 3 or (mode == 4 and kernels.invariant_gemm_tuned(weight.shape))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: Kernels = REFERENCE) -> torch.Tensor:
        if kernels.fused_norms:
            from specserve.ops.triton_norm import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def silu_mul(gate_up: torch.Tensor, kernels: Kernels) -> torch.Tensor:
    if kernels.fused_norms:
        from specserve.ops.triton_norm import silu_and_mul

        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_linear(
    x: torch.Tensor,
    lin: nn.Linear,
    mode: int,
    kernels: Kernels,
    *,
    norm: RMSNorm | None = None,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """[residual +] lin(f(x)), f = norm or SiLU-and-mul or identity; one kernel in mode 2.
    accumulate: the sum may be written into `residual` (mode 1: GEMM with beta = 1)."""
    if mode == 2 and lin.weight.dtype == x.dtype:
        from specserve.ops.triton_linear import skinny_linear

        return skinny_linear(
            x,
            lin.weight,
            lin.bias,
            norm_weight=None if norm is None else norm.weight,
            eps=1e-6 if norm is None else norm.eps,
            silu_mul=silu,
            residual=residual,
            pdl=kernels.programmatic_launch,
        )
    if norm is not None:
        x = norm(x, kernels)
    if silu:
        x = silu_mul(x, kernels)
    if invariant_gemm_runs(mode, lin.weight, kernels) and lin.weight.dtype == x.dtype:
        from specserve.ops.triton_invariant_linear import invariant_linear

        # The norm and SiLU-and-mul ran as their own kernels above (one program per row, so
        # batch-invariant too), the residual add rides in the GEMM's epilogue: in its
        # prologue they took the matmuls of a Llama-3-8B step on an H200 from 4.3 to 6.6 ms
        # at one row (every program of a layer recomputed its rows' norm, or the SiLU of its
        # K range).
        return invariant_linear(x, lin.weight, lin.bias, residual=residual)
    if (
        accumulate
        and residual is not None
        and lin.bias is None
        and x.dim() == 2
        and residual.dtype == x.dtype == lin.weight.dtype  # addmm_ does not promote
    ):
        # one GEMM with beta = 1 instead of a GEMM and an add kernel; residual is the
        # caller's own fresh tensor (its value is not needed afterwards)
        return residual.addmm_(x, lin.weight.t())
    y = F.linear(x, lin.weight, lin.bias)
    return y if residual is None else residual + y


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, input_size: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        in_size = input_size or cfg.hidden_size
        self.qkv_proj = nn.Linear(in_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        *,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
        qkv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[residual +] attention(norm(x)); norm and residual fused into the matmuls when
        `fused_mode` allows. qkv: the projection of x, already computed by the caller."""
        kernels = ctx.kernels
        mode = fused_mode(x, kernels)
        if qkv is None:
            qkv = fused_linear(x, self.qkv_proj, mode, kernels, norm=norm)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, kernels), self.k_norm(k, kernels)
        if ctx.fused_rope_write and not torch.is_grad_enabled():
            # one kernel rotates q and k and writes k, v into the cache (ops/triton_rope.py)
            from specserve.ops.triton_rope import rope_and_write

            k_cache, v_cache = ctx.kv_cache.layer(self.layer_id)
            if self.rotary.q_scale != 1.0:  # (what self.rotary applies)
                q = q * self.rotary.q_scale
            q = rope_and_write(
                q, k, v, positions, self.rotary.inv_freq, k_cache, v_cache,
                ctx.write_slots,
            )  # fmt: skip
            out = ctx.attention(self.layer_id, q, None, None)
        else:
            q, k = self.rotary(positions, q, k)
            out = ctx.attention(self.layer_id, q, k, v)
        out = out.reshape(-1, self.q_size)
        return fused_linear(out, self.o_proj, mode, kernels, residual=residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        kernels: Kernels = REFERENCE,
        *,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> torch.Tensor:
        """[residual +] down(silu(gate) * up) of norm(x); accumulate: into residual in place."""
        mode = fused_mode(x, kernels)
        gate_up = fused_linear(x, self.gate_up_proj, mode, kernels, norm=norm)
        return fused_linear(
            gate_up,
            self.down_proj,
            mode,
            kernels,
            silu=True,
            residual=residual,
            accumulate=accumulate,
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    @property
    def linears(self) -> tuple[nn.Linear, ...]:
        attn, mlp = self.self_attn, self.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        qkv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # h = h + attn(norm1(h)); h + mlp(norm2(h)), with the norms and adds fused where the
        # kernels allow (input_layernorm may be Identity: EAGLE's first draft layer, whose
        # caller may pass qkv = qkv_proj(h), computed together with h)
        kernels = ctx.kernels
        norm1 = self.input_layernorm if isinstance(self.input_layernorm, RMSNorm) else None
        if qkv is not None and norm1 is not None:
            raise ValueError("a precomputed qkv needs an identity input norm")
        x = h if norm1 is not None else self.input_layernorm(h)
        norm2 = self.post_attention_layernorm
        if arrangement_mode(h, kernels, self.linears) == 1:  # h + o and norm2 in one kernel
            from specserve.ops.triton_norm import add_rmsnorm

            o = self.self_attn(x, positions, ctx, norm=norm1, qkv=qkv)
            if o.dtype == h.dtype:  # (autocast could make them differ: torch promotes)
                h, x = add_rmsnorm(o, h, norm2.weight, norm2.eps)
                return self.mlp(x, kernels, residual=h, accumulate=True)  # h: a new tensor
            h = h + o
            return self.mlp(h, kernels, norm=norm2, residual=h)
        h = self.self_attn(x, positions, ctx, norm=norm1, residual=h, qkv=qkv)
        return self.mlp(h, kernels, norm=norm2, residual=h)

    def forward_deferred(
        self, h: torch.Tensor, pending: torch.Tensor | None, positions, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The F.linear path (`fused_mode` 1) with the residual stream kept as h + pending:
        the previous layer's MLP output is added inside this layer's first norm kernel, and
        this layer's is returned unadded. One add kernel fewer per layer."""
        from specserve.ops.triton_norm import add_rmsnorm

        kernels = ctx.kernels
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if pending is None:
            x = norm1(h, kernels) if isinstance(norm1, RMSNorm) else norm1(h)
        elif isinstance(norm1, RMSNorm):
            h, x = add_rmsnorm(pending, h, norm1.weight, norm1.eps)
        else:
            h = h + pending
            x = norm1(h)
        o = self.self_attn(x, positions, ctx)
        h, x = add_rmsnorm(o, h, norm2.weight, norm2.eps)
        return h, self.mlp(x, kernels)
