"""The losses of one training step: the head unrolled over the target's features and then its
own (training-time test), as the drafter runs it.

An EAGLE-1 head (`EagleHead`: fc over [embedding(x_{p+1}); feature h_p], one decoder layer, the
target's frozen embedding and lm_head) is trained exactly as it is used by
`speculative/drafter.py` (position offset 0: token x_{p+1} sits at position p with feature h_p):

- step 0: the features are the target's own (`h_p`); the output g_p should be h_{p+1}
  (smooth L1, weight `feature_weight`) and lm_head(g_p) should rank the target's next
  tokens (cross-entropy against the target's top-k probabilities renormalized, weight
  `token_weight`; EAGLE's 1.0 / 0.1).
- steps 1..ttt_steps ("training-time test"): the feature at position p is the head's own
  output of the previous step at p - 1, as in drafting, where depth d + 1 reads depth d's
  output. Attention follows the drafter too: a step-k query at p sees the step-0 (true
  feature) keys at positions <= p - k and, for i = 1..k, the step-i key at p - k + i (its
  draft ancestors). Losses of step k are weighted by `ttt_decay ** k`.

Only answer positions carry loss (the draft never predicts inside a prompt at serving time).
The training attention is `F.scaled_dot_product_attention` over the head's own submodules
(qkv_proj, rotary, o_proj), so parameter names are those of `EagleHead` and the result saves
with `save_eagle_checkpoint` and loads with `load_eagle_head`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.speculative.draft_heads import Eagle3Head, EagleHead
from specserve.train.features import _attend, _split_heads
from specserve.train.soft_ce import linear_soft_ce
from specserve.train.train_args import TrainArgs


def ttt_mask(t: int, k: int, device) -> torch.Tensor:
    """bool [T, (k+1)T] over keys [step 0 | step 1 | ... | step k] for step-k queries."""
    p = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    blocks = [j <= p - k] + [j == p - k + i for i in range(1, k + 1)]
    return torch.cat(blocks, dim=1)


def _unrolled_attention(attn, x, positions, cache: list, mask) -> torch.Tensor:
    """Attention of one unrolled step: appends this step's K/V to `cache` (one layer's list
    over the steps so far); mask None: causal over this step alone (step 0), else `ttt_mask`
    over the keys of every step so far."""
    q, k, v = _split_heads(attn, x, positions)
    cache.append((k, v))
    if mask is None:
        return _attend(attn, q, k, v, is_causal=True)
    ks = torch.cat([c[0] for c in cache], dim=2)
    vs = torch.cat([c[1] for c in cache], dim=2)
    return _attend(attn, q, ks, vs, mask=mask)


def head_step(head: EagleHead, tokens, feats, positions, caches, mask):
    """One unrolled step of the head over [B, T]: returns g [B, T, H]; appends each layer's
    K/V to `caches` (one list of (k, v) per layer). mask None: causal (step 0)."""
    h = head.fc(torch.cat([head._embed[0](tokens).to(feats.dtype), feats], dim=-1))
    for li, layer in enumerate(head.layers):
        x = layer.input_layernorm(h)
        h = h + _unrolled_attention(layer.self_attn, x, positions, caches[li], mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def eagle3_step(head: Eagle3Head, tokens, feats, positions, caches, mask):
    """One unrolled step of an EAGLE3 head over [B, T] (as `Eagle3Head.forward`): the 3H
    target feature goes through fc, a draft step's own H-wide output does not."""
    if feats.shape[-1] != head.config.hidden_size:
        feats = head.fc(feats)
    x = torch.cat(
        [head.input_layernorm(head._embed[0](tokens).to(feats.dtype)), head.hidden_norm(feats)],
        dim=-1,
    )
    h = feats + _unrolled_attention(head.self_attn, x, positions, caches[0], mask)
    return h + head.mlp(head.post_attention_layernorm(h))


def unrolled_losses(
    head, lm_head_w, batch, args: TrainArgs, lookup: torch.Tensor | None = None, ce_chunk=1024
):
    """Per unrolled step k: (feature loss, token loss, top-1 hits, rows); losses and hits are
    device tensors (nothing here waits for the device), rows a host int.

    EAGLE: `lm_head_w` is the target's (frozen) lm_head, or its rows of a reduced
    cross-entropy vocabulary; EAGLE3: None, the head's own (trained) lm_head is used after its
    norm, and there is no feature loss. lookup: with a reduced vocabulary, the index of every
    target id in it, -1 outside; candidates outside it are dropped (a row whose likeliest
    candidate is outside carries no token loss and never counts as a hit)."""
    eagle3 = isinstance(head, Eagle3Head)
    ids, feats_all = batch["ids"], batch["features"]
    b, n = ids.shape
    t = n - 1
    tokens = ids[:, 1:]
    top_ids = batch["top_ids"][:, 1:].reshape(b * t, -1)
    top_p = batch["top_probs"][:, 1:].reshape(b * t, -1)
    positions = torch.arange(t, device=ids.device).expand(b, t)
    feats = feats_all[:, :-1].float()
    target = None if eagle3 else feats_all[:, 1:].reshape(b * t, -1)
    caches: list[list] = [[] for _ in range(1 if eagle3 else len(head.layers))]
    out = []
    prepared: dict[int, tuple] = {}  # rows tensor id -> its CE inputs (shared by most k)
    for k in range(args.ttt_steps + 1):
        m = None if k == 0 else ttt_mask(t, k, ids.device)
        if eagle3:
            g = eagle3_step(head, tokens, feats, positions, caches, m)
        else:
            g = head_step(head, tokens, feats, positions, caches, m)
        rows = batch["rows"][k]
        if rows.numel() == 0:  # no position of the batch reaches step k: nothing to learn
            zero = torch.zeros((), device=ids.device)
            out.append((zero, zero, zero, 0))
            feats = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
            continue
        if id(rows) not in prepared:
            r_ids, r_p = top_ids.index_select(0, rows), top_p.index_select(0, rows).float()
            ok = None
            if lookup is not None:
                r_ids = lookup[r_ids]
                r_p = torch.where(r_ids >= 0, r_p, 0.0)
                ok = r_ids[:, 0] >= 0  # the target's likeliest token must be in it
                r_ids = r_ids.clamp(min=0)
            r_p = r_p / r_p.sum(-1, keepdim=True).clamp(min=1e-6)
            if ok is None:
                row_w = torch.full((len(rows),), 1.0 / max(1, len(rows)), device=ids.device)
            else:
                row_w = ok.float() / ok.float().sum().clamp(min=1.0)
            r_target = None if target is None else target.index_select(0, rows).float()
            prepared[id(rows)] = (r_ids, r_p, ok, row_w, r_target)
        r_ids, r_p, ok, row_w, r_target = prepared[id(rows)]
        gs = g.reshape(b * t, -1).index_select(0, rows)  # backward: index_add, not index_put
        if eagle3:
            f_loss = torch.zeros((), device=ids.device)
            x, w = head.norm(gs), head.lm_head.weight
            if torch.is_autocast_enabled(ids.device.type):
                w = w.to(torch.get_autocast_dtype(ids.device.type))
        else:
            f_loss = F.smooth_l1_loss(gs.float(), r_target)
            x, w = gs, lm_head_w
        t_loss, hits = linear_soft_ce(x, w, r_ids, r_p, row_w, ce_chunk)
        hit_sum = hits.sum() if ok is None else (hits & ok).sum()
        out.append((f_loss, t_loss, hit_sum, int(rows.numel())))
        # next step: the feature at p is this step's output at p - 1
        feats = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
    return out


def total_loss(losses, args: TrainArgs) -> torch.Tensor:
    total = 0.0
    for k, (f_loss, t_loss, _, _) in enumerate(losses):
        total = total + (args.ttt_decay**k) * (
            args.feature_weight * f_loss + args.token_weight * t_loss
        )
    return total
