"""A Llama-family decoder over a flat batch of tokens (Llama 2/3, SmolLM2, Qwen2, Qwen3).

Tokens of all requests in a step are concatenated into one [T] sequence; the attention
backend in `ForwardContext` knows which token belongs to which request and which cached
KV it may see. Parameter names follow Hugging Face, except that q/k/v and gate/up are
stored fused (`qkv_proj`, `gate_up_proj`); `load_weights` does the stacking.

Fused kernels (CUDA, fp16/bf16, no autograd; `fused_mode`): with at most
`FUSED.max_tokens` tokens every linear layer is the skinny Triton GEMM
(`ops/triton_linear.py`), which also applies the RMSNorm before qkv/gate_up, the SiLU-and-mul
before down and the residual add after o/down, so a layer runs no elementwise kernel between
its matmuls; with more tokens F.linear with the fused Triton RMSNorm, residual-add + RMSNorm
and SiLU-and-mul (`ops/triton_norm.py`). On the CPU, in float32, under autograd, or with
`set_fused_ops(...)` / SPECSERVE_DISABLE_TRITON_LINEAR=1 / SPECSERVE_DISABLE_TRITON_ELEMENTWISE=1,
the plain torch ops below run, unchanged. Kernels read the parameters at call time, so
weights loaded after construction are used as they are.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.config import ModelConfig
from specserve.model.rope import RotaryEmbedding
from specserve.ops import env_flag, triton_available
from specserve.ops.attention import ForwardContext


@dataclass
class FusedOps:
    linear: bool  # skinny Triton GEMM (with its fused norm / SiLU-mul / residual) for few tokens
    elementwise: bool  # Triton RMSNorm, residual-add + RMSNorm, SiLU-and-mul otherwise
    max_tokens: int  # largest token count (rows of x) that takes the skinny GEMM
    max_hidden: int  # widest input (hidden size) that takes it


# Where the skinny GEMM is used, from H200 measurements (docs/PERFORMANCE.md). At 2..16
# tokens it lost to F.linear. At one token, small models (SmolLM2-135M, hidden 576) gain
# more from its fused norm / SiLU / residual (fewer launches) than they lose (999 vs 712
# tok/s), while for large ones (8B shape, hidden 4096) cuBLAS streams weights faster (195
# vs 172 tok/s).
SKINNY_MAX_TOKENS = 1
SKINNY_MAX_HIDDEN = 2048
FUSED = FusedOps(
    linear=not env_flag("SPECSERVE_DISABLE_TRITON_LINEAR"),
    elementwise=not env_flag("SPECSERVE_DISABLE_TRITON_ELEMENTWISE"),
    max_tokens=int(os.environ.get("SPECSERVE_SKINNY_MAX_TOKENS", SKINNY_MAX_TOKENS)),
    max_hidden=int(os.environ.get("SPECSERVE_SKINNY_MAX_HIDDEN", SKINNY_MAX_HIDDEN)),
)
_HALF = (torch.float16, torch.bfloat16)


def set_fused_ops(
    linear: bool | None = None,
    elementwise: bool | None = None,
    max_tokens: int | None = None,
    max_hidden: int | None = None,
) -> FusedOps:
    """Turn the fused GPU paths on or off (None: unchanged); returns the previous settings.
    Takes effect at the next forward (a captured CUDA graph keeps what it captured)."""
    prev = FusedOps(FUSED.linear, FUSED.elementwise, FUSED.max_tokens, FUSED.max_hidden)
    if linear is not None:
        FUSED.linear = linear
    if elementwise is not None:
        FUSED.elementwise = elementwise
    if max_tokens is not None:
        FUSED.max_tokens = max_tokens
    if max_hidden is not None:
        FUSED.max_hidden = max_hidden
    return prev


@contextmanager
def fused_ops_kept() -> Iterator[None]:
    """Every `set_fused_ops` change made inside is undone on exit (benchmarks, tests)."""
    prev = set_fused_ops()
    try:
        yield
    finally:
        set_fused_ops(**asdict(prev))


def _eligible(x: torch.Tensor) -> bool:
    """Fused kernels apply: CUDA fp16/bf16 activations, no autograd, Triton importable."""
    return (
        x.device.type == "cuda"
        and x.dtype in _HALF
        and not torch.is_grad_enabled()
        and triton_available()
    )


def fused_mode(x: torch.Tensor) -> int:
    """0: plain torch ops; 1: F.linear + fused elementwise kernels; 2: skinny GEMM."""
    if not (FUSED.linear or FUSED.elementwise) or not _eligible(x):
        return 0
    if (
        FUSED.linear
        and x.numel() <= FUSED.max_tokens * x.shape[-1]
        and x.shape[-1] <= FUSED.max_hidden
    ):
        return 2
    return 1 if FUSED.elementwise else 0


_FP32_GEMM: dict[str, bool] = {}  # "ok": torch.mm(a16, b16, torch.float32) runs here


def _fp32_output_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """cuBLAS can write float32 from these 16-bit operands (torch >= 2.8 on CUDA; probed once,
    outside any graph capture, which runs its warm-up eagerly first)."""
    if not (
        x.device.type == "cuda"
        and x.dtype in _HALF
        and weight.dtype == x.dtype
        and not torch.is_grad_enabled()
    ):
        return False
    if "ok" not in _FP32_GEMM:
        ok = not env_flag("SPECSERVE_DISABLE_FP32_LOGITS")
        if ok:
            try:
                probe = torch.ones(2, 2, dtype=x.dtype, device=x.device)
                ok = torch.mm(probe, probe, torch.float32).dtype == torch.float32
            except (RuntimeError, TypeError):
                ok = False
        _FP32_GEMM["ok"] = ok
    return _FP32_GEMM["ok"]


def elementwise_on(x: torch.Tensor) -> bool:
    """The fused elementwise / row kernels apply to x (CUDA half activations, no autograd)."""
    return FUSED.elementwise and _eligible(x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the skinny Triton GEMM where `fused_mode` says so."""
    if fused_mode(x) == 2 and weight.dtype == x.dtype:
        from specserve.ops.triton_linear import skinny_linear

        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if elementwise_on(x):
            from specserve.ops.triton_norm import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if elementwise_on(gate_up):
        from specserve.ops.triton_norm import silu_and_mul

        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _fused_linear(
    x: torch.Tensor,
    lin: nn.Linear,
    mode: int,
    *,
    norm: RMSNorm | None = None,
    silu_mul: bool = False,
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
            silu_mul=silu_mul,
            residual=residual,
        )
    if norm is not None:
        x = norm(x)
    if silu_mul:
        x = _silu_mul(x)
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
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        in_size = input_size or cfg.hidden_size
        self.qkv_proj = Linear(in_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
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
        mode = fused_mode(x)
        if qkv is None:
            qkv = _fused_linear(x, self.qkv_proj, mode, norm=norm)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.fused_rope_write and not torch.is_grad_enabled():
            # one kernel rotates q and k and writes k, v into the cache (ops/triton_rope.py)
            from specserve.ops.triton_rope import rope_and_write

            k_cache, v_cache = ctx.kv_cache.layer(self.layer_id)
            q = rope_and_write(
                q, k, v, positions, self.rotary.inv_freq, k_cache, v_cache,
                ctx.meta.out_cache_loc,
            )  # fmt: skip
            out = ctx.attention(self.layer_id, q, None, None)
        else:
            q, k = self.rotary(positions, q, k)
            out = ctx.attention(self.layer_id, q, k, v)
        return _fused_linear(out.reshape(-1, self.q_size), self.o_proj, mode, residual=residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        *,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> torch.Tensor:
        """[residual +] down(silu(gate) * up) of norm(x); accumulate: into residual in place."""
        mode = fused_mode(x)
        gate_up = _fused_linear(x, self.gate_up_proj, mode, norm=norm)
        return _fused_linear(
            gate_up, self.down_proj, mode, silu_mul=True, residual=residual, accumulate=accumulate
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

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
        norm1 = self.input_layernorm if isinstance(self.input_layernorm, RMSNorm) else None
        if qkv is not None and norm1 is not None:
            raise ValueError("a precomputed qkv needs an identity input norm")
        x = h if norm1 is not None else self.input_layernorm(h)
        if fused_mode(h) == 1:  # F.linear path: h + o and norm2 in one kernel
            from specserve.ops.triton_norm import add_rmsnorm

            o = self.self_attn(x, positions, ctx, norm=norm1, qkv=qkv)
            norm2 = self.post_attention_layernorm
            if o.dtype == h.dtype:  # (autocast could make them differ: torch promotes)
                h, x = add_rmsnorm(o, h, norm2.weight, norm2.eps)
                return self.mlp(x, residual=h, accumulate=True)  # h is add_rmsnorm's new tensor
            h = h + o
            return self.mlp(h, norm=norm2, residual=h)
        h = self.self_attn(x, positions, ctx, norm=norm1, residual=h, qkv=qkv)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)

    def forward_deferred(
        self, h: torch.Tensor, pending: torch.Tensor | None, positions, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The F.linear path (`fused_mode` 1) with the residual stream kept as h + pending:
        the previous layer's MLP output is added inside this layer's first norm kernel, and
        this layer's is returned unadded. One add kernel fewer per layer."""
        from specserve.ops.triton_norm import add_rmsnorm

        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if pending is None:
            x = norm1(h)
        elif isinstance(norm1, RMSNorm):
            h, x = add_rmsnorm(pending, h, norm1.weight, norm1.eps)
        else:
            h = h + pending
            x = norm1(h)
        o = self.self_attn(x, positions, ctx)
        h, x = add_rmsnorm(o, h, norm2.weight, norm2.eps)
        return h, self.mlp(x)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Pass the weight: Embedding's own init calls normal_, which on the meta device (where
        # the loader builds models) imports torch._dynamo, seconds of start-up for nothing.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [T, H] after the final norm: what lm_head reads (EAGLE's feature)
    aux_hidden: list[torch.Tensor]  # residual stream entering each captured layer (EAGLE3)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> ModelOutput:
        h = self.embed(input_ids)
        aux: list[torch.Tensor] = []
        # F.linear path: the residual adds ride in the next norm's kernel (forward_deferred)
        deferred = fused_mode(h) == 1 and not torch.is_autocast_enabled()
        pending = None  # the last MLP output, not yet added to h
        for i, layer in enumerate(self.model.layers):
            if i in ctx.capture_layers:  # a layer named twice is captured twice
                if pending is not None:
                    h, pending = h + pending, None
                aux.extend(h for c in ctx.capture_layers if c == i)
            if deferred:
                h, pending = layer.forward_deferred(h, pending, positions, ctx)
            else:
                h = layer(h, positions, ctx)
        norm = self.model.norm
        if pending is None:
            return ModelOutput(hidden=norm(h), aux_hidden=aux)
        from specserve.ops.triton_norm import add_rmsnorm

        _, hidden = add_rmsnorm(pending, h, norm.weight, norm.eps)
        return ModelOutput(hidden=hidden, aux_hidden=aux)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits, float32. On CUDA in 16 bits the GEMM itself writes float32: logits rounded
        to bf16 tie often enough to change argmaxes (1.4% of SmolLM2-135M's greedy tokens, 9
        of 16 held-out answers, measured on the CPU), and verification and batched decoding
        must take the same argmax as one-token decoding. Elsewhere F.linear in the model's
        dtype, then upcast (upcast=False: left in that dtype, for argmax-only callers)."""
        weight = self.lm_head_weight
        if fused_mode(hidden) == 2 and weight.dtype == hidden.dtype:
            from specserve.ops.triton_linear import skinny_linear

            return skinny_linear(hidden, weight, out_dtype=torch.float32)  # no bf16 rounding
        if _fp32_output_gemm(hidden, weight):
            flat = torch.mm(hidden.reshape(-1, hidden.shape[-1]), weight.t(), torch.float32)
            return flat.view(*hidden.shape[:-1], weight.shape[0])
        logits = F.linear(hidden, weight)
        return logits.float() if upcast else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up on the way."""
        load_hf_named_weights(self, weights)


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_hf_named_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into `module`, whose q/k/v and gate/up are fused.

    Every parameter of the module must be written exactly once; a missing or unexpected
    name raises, so a wrong checkpoint never runs with random weights.
    """
    params = dict(module.named_parameters())
    written: set[str] = set()
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and "lm_head.weight" not in params:
            continue  # tied embeddings: some checkpoints still carry a copy
        pieces = name.split(".")
        fused = next(((i, _FUSED[p]) for i, p in enumerate(pieces) if p in _FUSED), None)
        if fused is not None:
            i, (target, shard) = fused
            target_name = ".".join(pieces[:i] + [target] + pieces[i + 1 :])
            parts.setdefault(target_name, {})[shard] = tensor
            continue
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
        _copy(params[name], tensor, name)
        written.add(name)
    for target_name, shards in parts.items():
        if target_name not in params:
            raise KeyError(f"checkpoint tensors for {target_name!r} have no place in the model")
        _copy_stacked(params[target_name], [shards[i] for i in sorted(shards)], target_name)
        written.add(target_name)
    missing = sorted(set(params) - written)
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")


def _copy_stacked(param: torch.Tensor, shards: list[torch.Tensor], name: str) -> None:
    """Copy shards stacked along dim 0 into `param` (what torch.cat then _copy would do,
    without materializing the concatenation)."""
    shape = (sum(s.shape[0] for s in shards), *shards[0].shape[1:])
    if tuple(param.shape) != shape or any(s.shape[1:] != shards[0].shape[1:] for s in shards):
        got = [tuple(s.shape) for s in shards]
        raise ValueError(
            f"{name}: checkpoint shards {got} do not stack to model shape {tuple(param.shape)}"
        )
    offset = 0
    with torch.no_grad():
        for s in shards:
            param[offset : offset + s.shape[0]].copy_(s.to(param.dtype))
            offset += s.shape[0]


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
