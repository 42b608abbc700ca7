"""Draft networks: EAGLE (fc over [embedding; feature] + decoder layer), EAGLE3 (three-layer
features, reduced vocabulary), and a standalone small LM. Each maps (tokens, features,
positions) to a draft hidden state `g` and ranks next tokens from `g`.

`position_offset` (delta): the draft's KV entry for token x_j sits at position j - 1 + delta.
EAGLE pairs x_j with the target's hidden state at j - 1 (delta 0); a standalone LM keeps
x_j at j (delta 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config.kernels import REFERENCE, Kernels
from specserve.model.config import ModelConfig
from specserve.model.layers import MLP, Attention, DecoderLayer, RMSNorm
from specserve.ops.attention import ForwardContext
from specserve.ops.sampling import topk_logprobs
from specserve.speculative.draft_vocab import DraftVocab


class DraftHead(nn.Module):
    position_offset = 0
    target_feature: str = "final"  # 'final' (normed last hidden), 'aux' (captured layers), 'none'
    config: ModelConfig

    def forward(self, input_ids, features, positions, ctx: ForwardContext) -> torch.Tensor:
        raise NotImplementedError

    def topk(
        self, g: torch.Tensor, k: int, kernels: Kernels = REFERENCE
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities [T, k] float32, target token ids [T, k]) of the k likeliest next
        tokens (log-softmax in float32 over the logits as the head computes them)."""
        return topk_logprobs(self.logits(g, kernels), k, self.vocab_ids(), kernels)

    def logits(self, g: torch.Tensor, kernels: Kernels = REFERENCE) -> torch.Tensor:
        """[T, draft vocab] in the head's dtype or float32."""
        raise NotImplementedError

    def vocab_ids(self) -> torch.Tensor | None:
        """int64 [draft vocab] on the logits' device: the target token id of each logit
        column; None: column c is token c."""
        return None

    def prepare_for_serving(self, kernels: Kernels) -> None:
        """Called once the head sits on its serving device (TreeDrafter): cache what every
        step would otherwise recompute."""

    takes_request_tokens = False  # observe_tokens does something (a growing vocabulary)

    def observe_tokens(self, tokens_by_request: Mapping[str, Sequence[int]]) -> None:
        """Prompt and output tokens of running requests: a growing draft vocabulary
        (speculative/draft_vocab.py) takes those it lacks."""

    def release_tokens(self, request_ids: Iterable[str]) -> None:
        """These requests are done: their tokens may leave a growing vocabulary."""


class _EagleLayer0(DecoderLayer):
    """EAGLE-1's first layer has no input norm: fc's output goes straight into attention."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.input_layernorm = nn.Identity()


class EagleHead(DraftHead):
    target_feature = "final"

    def __init__(
        self,
        cfg: ModelConfig,
        target_embed: nn.Embedding,
        target_lm_head: torch.Tensor,
        fc_bias: bool = True,
    ):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(
            (_EagleLayer0(cfg, 0) if i == 0 else DecoderLayer(cfg, i))
            for i in range(cfg.num_layers)
        )
        self._embed = [target_embed]  # shared, not a submodule (not saved, not moved twice)
        self._lm_head = [target_lm_head]
        self.vocab: DraftVocab | None = None  # restrict_vocab's reduced vocabulary
        self._fc_qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see below

    def forward(self, input_ids, features, positions, ctx):
        embed = self._embed[0].weight
        features = features.to(self.fc.weight.dtype)
        if ctx.kernels.fused_norms and embed.dtype == features.dtype:
            # one launch for the gather and the concat (ops/triton_embed_concat.py)
            from specserve.ops.triton_embed_concat import embed_concat

            x = embed_concat(embed, input_ids.contiguous(), features.contiguous())
        else:
            x = torch.cat([self._embed[0](input_ids), features], dim=-1)
        layers = iter(self.layers)
        if self._fc_qkv is not None and ctx.kernels.draft_fc_qkv:
            weight, bias = self._fc_qkv
            hidden = self.fc.out_features
            h, qkv = F.linear(x, weight, bias).split([hidden, weight.shape[0] - hidden], dim=-1)
            h = next(layers)(h, positions, ctx, qkv=qkv)
        else:
            h = self.fc(x)
        for layer in layers:
            h = layer(h, positions, ctx)
        return h

    def prepare_for_serving(self, kernels: Kernels) -> None:
        # A GPU at batch 1 is bound by launches, a CPU by arithmetic (the fused GEMM does
        # ~45% more multiply-adds than fc and qkv for SmolLM2's draft): the kernels decide.
        self._fc_qkv = None
        if kernels.draft_fc_qkv:
            self.fuse_fc_and_qkv()

    def fuse_fc_and_qkv(self) -> None:
        """The first layer has no input norm, so its qkv projection of fc(x) is linear in x:
        one GEMM over [W_fc; W_qkv W_fc] (bias [b_fc; W_qkv b_fc + b_qkv], products in
        float32) gives h and qkv together, one launch fewer per draft forward (inference
        only; training keeps the two layers)."""
        first = self.layers[0]
        if not isinstance(first, _EagleLayer0):
            return
        proj = first.self_attn.qkv_proj
        w_fc, w_qkv = self.fc.weight.float(), proj.weight.float()
        weight = torch.cat([w_fc, w_qkv @ w_fc]).to(self.fc.weight.dtype)
        bias = None
        if self.fc.bias is not None or proj.bias is not None:
            b_fc = self.fc.bias.float() if self.fc.bias is not None else w_fc.new_zeros(len(w_fc))
            b_qkv = w_qkv @ b_fc + (proj.bias.float() if proj.bias is not None else 0)
            bias = torch.cat([b_fc, b_qkv]).to(self.fc.weight.dtype)
        self._fc_qkv = (weight.contiguous(), bias)

    def logits(self, g, kernels=REFERENCE):
        if self.vocab is None:
            return F.linear(g, self._lm_head[0])
        return F.linear(g, self.vocab.weight, self.vocab.bias)

    def restrict_vocab(self, token_ids: torch.Tensor, growth: int = 0) -> None:
        """Draft only among `token_ids` (speculative/token_map.py), plus up to `growth` tokens of the
        requests being served (speculative/draft_vocab.py): the lm_head becomes those rows of the
        target's (a copy; the target's own is untouched)."""
        if self.vocab is not None:
            raise ValueError("restrict_vocab: the vocabulary is already restricted")
        self.vocab = DraftVocab(self._lm_head[0], token_ids, growth)
        self.takes_request_tokens = self.vocab.grows

    def vocab_ids(self):
        return None if self.vocab is None else self.vocab.ids

    def observe_tokens(self, tokens_by_request):
        if self.vocab is not None:
            self.vocab.add(tokens_by_request)

    def release_tokens(self, request_ids):
        if self.vocab is not None:
            self.vocab.release(request_ids)


class _Eagle3Attention(Attention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, 0, input_size=2 * cfg.hidden_size)


class Eagle3Head(DraftHead):
    """One decoder layer whose attention reads [norm(embedding); norm(feature)] (2H wide);
    the 3H feature from three target layers is first projected by fc; later draft steps feed
    the draft's own H-wide output instead. Its lm_head covers a reduced vocabulary and
    `d2t[i]` maps draft id i to target id i + d2t[i]."""

    target_feature = "aux"

    def __init__(self, cfg: ModelConfig, draft_vocab_size: int, target_embed: nn.Embedding):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = _Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self._embed = [target_embed]
        self._ids: torch.Tensor | None = None  # prepare_for_serving's cache of vocab_ids

    def forward(self, input_ids, features, positions, ctx):
        feats = features.to(self.fc.weight.dtype)
        if feats.shape[-1] != self.config.hidden_size:
            feats = self.fc(feats)
        kernels = ctx.kernels
        embed = self.input_layernorm(self._embed[0](input_ids), kernels)
        x = torch.cat([embed, self.hidden_norm(feats, kernels)], dim=-1)
        h = feats + self.self_attn(x, positions, ctx)
        return h + self.mlp(self.post_attention_layernorm(h, kernels), kernels)

    def logits(self, g, kernels=REFERENCE):
        return self.lm_head(self.norm(g, kernels))

    def vocab_ids(self):
        if self._ids is not None:
            return self._ids
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t.long()

    def prepare_for_serving(self, kernels: Kernels) -> None:
        self._ids = None
        self._ids = self.vocab_ids()  # d2t is fixed from here on


class StandaloneHead(DraftHead):
    """Any smaller LM with the target's vocabulary."""

    position_offset = 1
    target_feature = "none"

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, input_ids, features, positions, ctx):
        return self.model(input_ids, positions, ctx).hidden

    def logits(self, g, kernels=REFERENCE):
        return self.model.compute_logits(g, kernels)
