"""Training an EAGLE-1 draft head on self-distilled features, with training-time test.

The head (`EagleHead`: fc over [embedding(x_{p+1}); feature h_p], one decoder layer, the
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

import json
import math
import os
import random
import time
import zlib
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.speculative.draft_heads import Eagle3Head, EagleHead
from specserve.speculative.eagle_checkpoint import hf_style_config, save_eagle_checkpoint
from specserve.train.features import _attend, _split_heads

ARCHITECTURE = "LlamaForCausalLMEagle"
ARCHITECTURE_EAGLE3 = "LlamaForCausalLMEagle3"


@dataclass
class TrainArgs:
    epochs: float = 4.0  # passes over the data (0: no limit; then time_budget must be set)
    time_budget: float = 0.0  # seconds of training (0: none); the schedule follows the clock
    finish_by: float = 0.0  # a time.time() value by which training must be done (0: none)
    # a time.time() value at which to save and stop WITHOUT shortening the schedule, so that a
    # --resume run continues it (training spread over several sessions or device calls)
    pause_by: float = 0.0
    lr: float = 1e-3
    batch_size: int = 4  # sequences per step (grouped by length), when batch_tokens is 0
    batch_tokens: int = 0  # padded tokens per step (0: batch_size sequences)
    ttt_steps: int = 2  # extra unrolled steps on the head's own features
    ttt_decay: float = 0.8
    feature_weight: float = 1.0
    token_weight: float = 1.0
    weight_decay: float = 0.0
    warmup: float = 0.03  # share of the schedule (steps, or time with a time budget)
    min_lr_ratio: float = 0.05
    grad_clip: float = 0.5
    max_len: int = 1024  # longer sequences are cut
    val_fraction: float = 0.02
    init_layer: int | None = None  # copy this target layer into the head's decoder layer
    head: str = "eagle"  # 'eagle' (EAGLE-1: final hidden state) or 'eagle3' (three layers)
    draft_layers: int = 1  # EAGLE-1: decoder layers in the head (EAGLE3 heads have one)
    draft_vocab: int = 16384  # EAGLE3: the draft's vocabulary, most frequent first (0: all)
    ce_vocab: int = 0  # EAGLE: cross-entropy over the most frequent target candidates (0: all)
    ce_chunk: int = 0  # rows per lm_head chunk of the cross-entropy (0: 1024 CPU, 8192 GPU)
    scale_init: bool = True  # fc's input columns start divided by each input's RMS
    autocast: str = "bfloat16"  # compute dtype of matmuls ('float32': none)
    seed: int = 0
    device: str = "cpu"
    save_every: int = 200  # steps between resumable checkpoints (0: only by time)
    save_every_seconds: float = 0.0  # seconds between checkpoints (0: only by steps)
    log_every: int = 20
    curve_file: str | None = None  # training curves JSON (default: <out>/train_curve.json)


# ---- data ---------------------------------------------------------------------------------------
class SeqData:
    """The sequences of a dataset folder as flat tensors on `device` (a GPU keeps all of it:
    batches are gathered there, never copied from the host) plus host-side metadata.

    Training position p of a sequence feeds token x_{p+1} and feature h_p; its targets are
    h_{p+1} and the target's next-token candidates at p + 1. Positions with a loss are the
    ones the drafter uses when serving: p from prompt_len - 1 (the root after prefill is the
    first answer token) to the position predicting the last token (the final EOS, or for a
    cut answer the token after the cut)."""

    def __init__(self, shards: list[dict], max_len: int, device="cpu", feature: str = "hidden"):
        """feature: 'hidden' (EAGLE: the final normed hidden state) or 'aux' (EAGLE3: the
        residual streams of three target layers, recorded with `DataArgs.eagle3`)."""
        self.device = torch.device(device)
        ids, features, top_ids, top_probs = [], [], [], []
        starts, lens, pls, ended, groups = [], [], [], [], []
        base = 0
        for sh in shards:
            offs = sh["offsets"].numpy()
            host_ids = sh["input_ids"].cpu().numpy()
            pl_sh = sh["prompt_lens"].numpy()
            # a sequence's group is its prompt: passes over one prompt share it
            groups.append(
                np.array(
                    [zlib.crc32(host_ids[o : o + p_].tobytes()) for o, p_ in zip(offs[:-1], pl_sh)],
                    dtype=np.int64,
                )
            )
            full = offs[1:] - offs[:-1]
            n = np.minimum(full, max_len)
            starts.append(offs[:-1] + base)
            lens.append(n)
            pls.append(sh["prompt_lens"].numpy().astype(np.int64))
            ended.append(sh["ended"].numpy() & (full <= max_len))
            base += int(offs[-1])
            ids.append(sh["input_ids"].to(self.device))
            if feature not in sh:
                raise ValueError(
                    f"the dataset has no {feature!r} features"
                    + (" (generate it with --eagle3-features)" if feature == "aux" else "")
                )
            features.append(sh[feature].to(self.device))
            top_ids.append(sh["top_ids"].to(self.device))
            top_probs.append(sh["top_probs"].to(self.device))
        self.ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)
        self.features = torch.cat(features) if features else torch.zeros(0, 1)
        if not bool(torch.isfinite(self.features).all()):  # e.g. float16 storage overflowed
            raise ValueError(f"the dataset's {feature!r} features hold inf or nan values")
        self.top_ids = torch.cat(top_ids) if top_ids else torch.zeros(0, 1, dtype=torch.int32)
        self.top_probs = torch.cat(top_probs) if top_probs else torch.zeros(0, 1)
        cat = (lambda xs: np.concatenate(xs)) if shards else (lambda xs: np.zeros(0, np.int64))
        start, n, pl, en = cat(starts), cat(lens), cat(pls), cat(ended).astype(bool)
        group = cat(groups)
        lo = pl - 1
        hi = np.where(en, n - 2, n - 1)
        keep = hi > lo  # at least one position with a loss
        self.start, self.n, self.lo, self.hi = start[keep], n[keep], lo[keep], hi[keep]
        self.group = group[keep]
        self.num_loss_positions = int((self.hi - self.lo).sum())

    def __len__(self) -> int:
        return len(self.start)

    def batch(self, idx, ttt_steps: int = 0) -> dict:
        """Right-padded [B, N] tensors gathered on the device, and for every unrolled step k
        the flat indices (b * (N - 1) + p) of the positions with a loss (p >= k)."""
        idx = np.asarray(idx)
        st, n, lo, hi = self.start[idx], self.n[idx], self.lo[idx], self.hi[idx]
        width = int(n.max())
        t = width - 1
        pos = np.arange(width)
        gather = st[:, None] + np.minimum(pos[None, :], n[:, None] - 1)  # padding repeats
        cnt = hi - lo
        p = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
        rows = np.repeat(np.arange(len(idx)), cnt) * t + p
        g = _to_device(gather, self.device)
        rows_d = [_to_device(rows, self.device)]
        for k in range(1, ttt_steps + 1):
            ok = p >= k
            rows_d.append(rows_d[0] if ok.all() else _to_device(rows[ok], self.device))
        return {
            "ids": self.ids[g].long(),
            "features": self.features[g],
            "top_ids": self.top_ids[g].long(),
            "top_probs": self.top_probs[g],
            "rows": rows_d,
            "tokens": int(len(idx) * width),
        }

    def batches(
        self, indices, seed: int, batch_size: int = 4, batch_tokens: int = 0
    ) -> list[np.ndarray]:
        """Shuffled batches of similar lengths (sorted within windows of many batches): of
        `batch_size` sequences, or with `batch_tokens` of at most that many padded tokens."""
        rng = np.random.default_rng(seed)
        order = rng.permutation(np.asarray(indices, dtype=np.int64))
        out: list[np.ndarray] = []
        if batch_tokens <= 0:
            window = batch_size * 32
            for i in range(0, len(order), window):
                chunk = order[i : i + window]
                chunk = chunk[np.argsort(self.n[chunk], kind="stable")]
                out += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
        else:
            mean = max(1.0, float(self.n.mean())) if len(self.n) else 1.0
            window = max(64, int(32 * batch_tokens / mean))
            for i in range(0, len(order), window):
                chunk = order[i : i + window]
                chunk = chunk[np.argsort(self.n[chunk], kind="stable")]
                cur: list[int] = []
                for j in chunk.tolist():  # ascending lengths: the newest sets the width
                    if cur and (len(cur) + 1) * int(self.n[j]) > batch_tokens:
                        out.append(np.asarray(cur))
                        cur = []
                    cur.append(j)
                if cur:
                    out.append(np.asarray(cur))
        perm = rng.permutation(len(out))
        return [out[i] for i in perm]


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ---- the head in training -----------------------------------------------------------------------
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


class _LinearSoftCE(torch.autograd.Function):
    """sum_r w_r * CE(softmax(x_r W^T), p_r): the cross-entropy of lm_head(x) against soft
    targets over a few token ids, weighted per row, without keeping [rows, vocab] logits for
    the backward. The gradients ((softmax - target) @ W for x and, when W trains,
    (softmax - target)^T @ x for W) are formed chunk by chunk in the forward and scaled in the
    backward. Returns the scalar loss and per-row top-1 hits (the target's likeliest token is
    the head's argmax). Reference: `soft_ce_reference`."""

    @staticmethod
    def forward(ctx, x, weight, ids, probs, row_w, chunk: int):
        # in the weight's dtype (bfloat16 under autocast): float32 copies of [rows, vocab]
        # cost more than the matmuls; sums accumulate in float32
        want_w = ctx.needs_input_grad[1]
        ctx.dtypes = (x.dtype, weight.dtype)
        x = x.to(weight.dtype)
        loss = torch.zeros((), device=x.device, dtype=torch.float32)
        hits, grads = [], []
        grad_w = torch.zeros(weight.shape, device=x.device, dtype=torch.float32) if want_w else None
        for s in range(0, x.shape[0], chunk):
            xs = x[s : s + chunk]
            logits = F.linear(xs, weight)
            m = logits.amax(-1, keepdim=True)
            picked = logits.gather(1, ids[s : s + chunk])
            hits.append(picked[:, 0] >= m[:, 0])
            e = logits.sub_(m).exp_()
            z = e.sum(-1, keepdim=True, dtype=torch.float32)
            p = probs[s : s + chunk]
            w = row_w[s : s + chunk].float()
            lse = m[:, 0].float() + z[:, 0].log()
            loss += (w * (lse - (p * picked.float()).sum(-1))).sum()
            # d loss / d logits = w * (softmax - target); w (about 1/rows) is applied in float32
            # outside the low-precision product, where 1/vocab * 1/rows would underflow
            e.div_(z.to(e.dtype)).scatter_add_(1, ids[s : s + chunk], -p.to(e.dtype))
            grads.append((e @ weight).float() * w[:, None])
            if want_w:  # weights relative to the chunk's largest keep the product near 1
                top = w.max().clamp(min=1e-30)
                rel = (xs.float() * (w / top)[:, None]).to(e.dtype)
                grad_w += (e.t() @ rel).float() * top
        ctx.save_for_backward(torch.cat(grads), grad_w if want_w else torch.zeros(0))
        hits = torch.cat(hits)
        ctx.mark_non_differentiable(hits)
        return loss, hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits):
        grad_x, grad_w = ctx.saved_tensors
        gx = (grad_x * grad_loss).to(ctx.dtypes[0])
        gw = (grad_w * grad_loss).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None, None


def soft_ce_reference(x, weight, ids, probs, row_w) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-autograd `_LinearSoftCE` (float32): the weighted loss and the top-1 hits."""
    logits = F.linear(x.float(), weight.float())
    logp = torch.log_softmax(logits, dim=-1)
    loss = -(row_w.float() * (probs.float() * logp.gather(1, ids)).sum(-1)).sum()
    hits = logits.gather(1, ids[:, :1])[:, 0] >= logits.amax(-1)
    return loss, hits


def linear_soft_ce(x, weight, ids, probs, row_w, chunk: int):
    """Each row of `probs` sums to 1 (or its row weight is 0): the loss is formed as
    logsumexp - sum(p * logit)."""
    if not torch.is_grad_enabled():  # needs_input_grad ignores no_grad: skip the W gradient
        weight = weight.detach()
    return _LinearSoftCE.apply(x, weight, ids, probs, row_w, chunk)


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


# ---- the loop -----------------------------------------------------------------------------------
def split_by_prompt(data: SeqData, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(held-back, training) sequence indices; every answer to a held-back prompt is held
    back, so held-back accuracy measures prompts never trained on."""
    prompts = sorted(set(data.group.tolist()))
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: int(len(prompts) * fraction)])
    is_val = np.fromiter((g in held for g in data.group.tolist()), dtype=bool, count=len(data))
    return np.nonzero(is_val)[0], np.nonzero(~is_val)[0]


def make_head(
    target,
    seed: int,
    init_layer: int | None = None,
    kind: str = "eagle",
    draft_ids: torch.Tensor | None = None,
    num_layers: int = 1,
):
    """A fresh head for `target`. kind 'eagle': EagleHead of `num_layers` decoder layers
    (target's embedding and lm_head shared); 'eagle3': Eagle3Head (one layer) over the sorted
    target ids `draft_ids` (default: the whole vocabulary), its lm_head rows and final norm
    starting as the target's. init_layer: copy that target layer into the head's first."""
    if num_layers < 1 or (kind == "eagle3" and num_layers != 1):
        raise ValueError(
            f"draft_layers must be >= 1 for an EAGLE head and 1 for an EAGLE3 head, got {num_layers}"
        )
    cfg = target.config.with_changes(
        num_layers=num_layers, tie_word_embeddings=False, attention_bias=False, qk_norm=False
    )
    torch.manual_seed(seed)
    if kind == "eagle3":
        vocab = target.config.vocab_size
        ids = torch.arange(vocab) if draft_ids is None else draft_ids.cpu().long()
        head = Eagle3Head(cfg, len(ids), target.model.embed_tokens)
        with torch.no_grad():
            head.d2t.copy_(ids - torch.arange(len(ids)))
            w = target.lm_head_weight
            head.lm_head.weight.copy_(w[ids.to(w.device)].to(head.lm_head.weight))
            head.norm.weight.copy_(target.model.norm.weight.to(head.norm.weight))
        return head
    if kind != "eagle":
        raise ValueError(f"head must be 'eagle' or 'eagle3', got {kind!r}")
    head = EagleHead(cfg, target.model.embed_tokens, target.lm_head_weight, fc_bias=True)
    if init_layer is not None:
        src = target.model.layers[init_layer].state_dict()
        dst = head.layers[0].state_dict()
        head.layers[0].load_state_dict(
            {k: src[k].to(v.dtype) for k, v in dst.items() if k in src}, strict=False
        )
    return head


@torch.no_grad()
def scale_fc_init_(head, data: SeqData, sample: int = 65536) -> None:
    """Divide fc's weight columns by the RMS of their inputs. EAGLE: token embeddings and
    feature dimensions (the embedding is ~15x smaller than the feature, whose dimensions range
    1x..20x; at the default init fc would all but ignore the token the draft must condition
    on). EAGLE3: the three layers' residual streams, whose scales differ by orders of
    magnitude. An initialization only; the architecture is unchanged."""
    n = min(sample, data.features.shape[0])
    dev = head.fc.weight.device
    f_rms = data.features[:n].to(dev).float().pow(2).mean(0).sqrt().clamp(min=1e-3)
    if isinstance(head, Eagle3Head):
        head.fc.weight /= f_rms.to(head.fc.weight)
        return
    emb = head._embed[0](data.ids[:n].long().to(dev)).float()
    e_rms = emb.pow(2).mean(0).sqrt().clamp(min=1e-3)
    hsz = head.config.hidden_size
    head.fc.weight[:, :hsz] /= e_rms.to(head.fc.weight)
    head.fc.weight[:, hsz:] /= f_rms.to(head.fc.weight)


def ce_vocabulary(data: SeqData, size: int, vocab_size: int | None = None) -> torch.Tensor:
    """`size` sorted token ids ranked by (k + 1) * (times the target's likeliest next token) +
    (times among its other k candidates), over every recorded position: top-1 occurrences
    dominate, candidates break ties and rank the rest. With `vocab_size`, padded with unseen
    ids (in id order) to exactly `size`."""
    top = data.top_ids.long()
    n = vocab_size or int(top.max()) + 1
    counts = torch.bincount(top[:, 0], minlength=n) * top.shape[1]
    counts += torch.bincount(top.reshape(-1), minlength=n)
    counts = counts.cpu()
    order = torch.sort(counts, descending=True, stable=True).indices
    keep = order[:size] if vocab_size else order[:size][counts[order[:size]] > 0]
    return keep.sort().values


def vocab_lookup(ids: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    """[vocab_size] int64: the index of every target id in `ids`, -1 outside."""
    lookup = torch.full((vocab_size,), -1, dtype=torch.int64, device=device)
    lookup[ids.to(device)] = torch.arange(len(ids), device=device)
    return lookup


def schedule_seconds(args: TrainArgs, trained: float) -> float:
    """Seconds of training the learning-rate schedule spans (0: it follows steps): the time
    budget, shortened so that a finish_by deadline is met, counting `trained` seconds done
    before this run (a resumed run continues its schedule). 15 s stay in reserve for the final
    evaluation and saving."""
    budget = args.time_budget
    if args.finish_by > 0:
        left = args.finish_by - time.time() - 15.0
        budget = min(budget, trained + left) if budget > 0 else trained + left
        budget = max(budget, trained + 1.0)
    return budget


def lr_at(progress: float, args: TrainArgs) -> float:
    """Linear warm-up over `warmup` of the schedule, then cosine down to min_lr_ratio."""
    if args.warmup > 0 and progress < args.warmup:
        return args.lr * max(progress / args.warmup, 0.01)
    frac = min(1.0, (progress - args.warmup) / max(1e-9, 1.0 - args.warmup))
    return args.lr * (
        args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    )


def _autocast(args: TrainArgs, device: torch.device):
    if args.autocast == "float32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=getattr(torch, args.autocast))


def _ce_chunk(args: TrainArgs, device: torch.device) -> int:
    return args.ce_chunk or (8192 if device.type == "cuda" else 1024)


@torch.no_grad()
def evaluate(head, lm_head_w, data: SeqData, indices, args: TrainArgs, device, lookup=None) -> dict:
    """Top-1 agreement with the target per unrolled step over the vocabulary serving drafts
    from (EAGLE: the target's whole lm_head; EAGLE3: its draft vocabulary, `lookup`), and the
    mean loss, on held-back sequences."""
    if len(indices) == 0:
        return {}
    was_training = head.training
    head.eval()
    k1 = args.ttt_steps + 1
    hits = torch.zeros(k1, device=device)
    count = [0] * k1
    loss_sum = torch.zeros((), device=device)
    n_batches = 0
    for idx in data.batches(indices, 0, args.batch_size, args.batch_tokens):
        with _autocast(args, device):
            losses = unrolled_losses(
                head,
                lm_head_w,
                data.batch(idx, args.ttt_steps),
                args,
                lookup,
                _ce_chunk(args, device),
            )
            loss_sum += total_loss(losses, args).float()
        n_batches += 1
        for k, (_, _, h, rows) in enumerate(losses):
            hits[k] += h
            count[k] += rows
    head.train(was_training)
    acc = (hits / torch.tensor([max(1, c) for c in count], device=device)).tolist()
    out = {f"val_acc_{k}": round(a, 4) for k, a in enumerate(acc)}
    out["val_loss"] = round(float(loss_sum) / max(1, n_batches), 4)
    return out


def save_draft(
    folder: str, head, extra: dict | None = None, capture_layers: list[int] | None = None
) -> None:
    """The head in the published layout, float16, without the shared embedding (and for EAGLE
    the shared lm_head). EAGLE3: `capture_layers` (the target layers whose input residual
    stream the features are) go to config.json as the published ids (the layer before)."""
    if isinstance(head, Eagle3Head):
        out = Eagle3Head(head.config, head.lm_head.out_features, head._embed[0])
        arch = ARCHITECTURE_EAGLE3
        extra = {"draft_vocab_size": head.lm_head.out_features, **(extra or {})}
        if capture_layers:
            ids = [int(i) - 1 for i in capture_layers]
            extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    else:
        out = EagleHead(
            head.config, head._embed[0], head._lm_head[0], fc_bias=head.fc.bias is not None
        )
        arch = ARCHITECTURE
    out.load_state_dict(head.state_dict())
    out = out.half()
    cfg = hf_style_config(head.config, arch, torch_dtype="float16")
    tmp = folder.rstrip("/") + ".tmp"
    save_eagle_checkpoint(tmp, out.cpu(), cfg, extra)
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(tmp):  # each file replaced whole: a reader never sees a torn one
        os.replace(os.path.join(tmp, name), os.path.join(folder, name))
    os.rmdir(tmp)


def _stamp(msg: str) -> str:
    return f"[{time.strftime('%H:%M:%S')}] {msg}"


def train(
    target,
    data_dir: str,
    out_dir: str,
    args: TrainArgs,
    resume: bool = False,
    work_dir: str | None = None,
    log=print,
) -> dict:
    """Train a head for `target` (a `LlamaForCausalLM`) on the dataset in `data_dir`; write the
    draft to `out_dir` (config.json, model.safetensors, train_curve.json) and resumable state
    to `work_dir/checkpoint.pt` (default: out_dir) at every checkpoint and at the end.

    Stops after `epochs` passes or `time_budget` seconds (whichever comes first; with a time
    budget the learning-rate schedule runs on the clock, so it anneals whatever the speed).
    Returns a summary (write it with `write_training_args`)."""
    from specserve.train.data import load_shards

    t_start = time.time()
    device = torch.device(args.device)
    if args.epochs <= 0 and args.time_budget <= 0 and args.finish_by <= 0:
        raise ValueError("give epochs > 0 or a time budget")
    os.makedirs(out_dir, exist_ok=True)
    if args.head not in ("eagle", "eagle3"):
        raise ValueError(f"head must be 'eagle' or 'eagle3', got {args.head!r}")
    eagle3 = args.head == "eagle3"
    capture: list[int] = []
    manifest_path = os.path.join(data_dir, "manifest.json")
    if os.path.isfile(manifest_path):
        with open(manifest_path) as f:
            capture = list(json.load(f).get("capture_layers") or [])
    if eagle3 and args.init_layer is not None:
        raise ValueError("init_layer applies to EAGLE heads only (an EAGLE3 layer reads 2H)")
    if args.draft_vocab < 0 or args.ce_vocab < 0:
        raise ValueError("draft_vocab and ce_vocab must be >= 0 (0: the whole vocabulary)")
    if eagle3 and (args.ce_vocab or args.feature_weight != TrainArgs.feature_weight):
        log(_stamp("EAGLE3: --ce-vocab and --feature-weight do not apply (no feature loss)"))
    feature = "aux" if eagle3 else "hidden"
    shards = load_shards(data_dir, device, drop=("hidden",) if eagle3 else ("aux",))
    data = SeqData(shards, args.max_len, device, feature)
    del shards
    if len(data) == 0:
        raise ValueError(f"{data_dir}: no sequence with an answer")
    val_idx, train_idx = split_by_prompt(data, args.val_fraction, args.seed)
    if len(train_idx) == 0:
        raise ValueError(f"{data_dir}: no training sequence left after holding back prompts")
    budget = schedule_seconds(args, 0.0)
    first_epoch = data.batches(train_idx, args.seed * 1000, args.batch_size, args.batch_tokens)
    total_steps = int(round(args.epochs * len(first_epoch))) if args.epochs > 0 else 0
    limits = [f"{total_steps} steps" if total_steps else "no step limit"]
    limits.append(f"{budget:.0f}s budget" if budget > 0 else "no time limit")
    log(
        _stamp(
            f"train: {len(train_idx)} sequences ({data.num_loss_positions} positions with a "
            f"loss), {len(val_idx)} held back; {len(first_epoch)} steps per epoch; "
            f"{', '.join(limits)}; device {device}"
        )
    )

    vocab = target.config.vocab_size

    def vocabulary(size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(sorted ids, lookup target id -> index or -1, share of top-1 tokens covered)."""
        keep = ce_vocabulary(data, size, vocab if eagle3 else None)
        lookup = vocab_lookup(keep, vocab, device)
        covered = (lookup[data.top_ids[:, 0].long().to(device)] >= 0).float().mean()
        return keep, lookup, float(covered)

    compute_dtype = torch.float32 if args.autocast == "float32" else getattr(torch, args.autocast)
    lm_head_w = target.lm_head_weight.detach().to(device, compute_dtype)
    ce_w, lookup, draft_ids = lm_head_w, None, None
    if eagle3:
        ce_w = None
        if 0 < args.draft_vocab < vocab:
            draft_ids, lookup, cover = vocabulary(args.draft_vocab)
            log(
                _stamp(
                    f"draft vocabulary: {len(draft_ids)} of {vocab} tokens, covering "
                    f"{100 * cover:.2f}% of the target's next tokens in the data"
                )
            )
    elif 0 < args.ce_vocab < vocab:
        keep, lookup, cover = vocabulary(args.ce_vocab)
        ce_w = lm_head_w[keep.to(device)].contiguous()
        log(_stamp(f"cross-entropy over {len(keep)} of {vocab} tokens ({100 * cover:.2f}%)"))
    eval_w, eval_lookup = (None, lookup) if eagle3 else (lm_head_w, None)
    head = make_head(target, args.seed, args.init_layer, args.head, draft_ids, args.draft_layers)
    head = head.to(device).float().train()
    if args.scale_init and not resume:
        scale_fc_init_(head, data)
    head.requires_grad_(True)
    opt_kw = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(
        head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, **opt_kw
    )
    work_dir = work_dir or out_dir
    os.makedirs(work_dir, exist_ok=True)
    ckpt_path = os.path.join(work_dir, "checkpoint.pt")
    step, epoch, in_epoch, history, evals, elapsed0 = 0, 0, 0, [], [], 0.0
    if resume and os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, weights_only=False, map_location=device)
        saved = state.get("args", {})
        for key in ("head", "draft_vocab", "draft_layers"):
            if (
                key in saved
                and saved[key] != getattr(args, key)
                and (eagle3 or key != "draft_vocab")
            ):
                raise ValueError(
                    f"{ckpt_path} was trained with {key}={saved[key]!r}, not "
                    f"{getattr(args, key)!r}: resume with the same value or another --work-dir"
                )
        head.load_state_dict(state["head"])
        if eagle3:  # the checkpoint's vocabulary, whatever this data would choose
            draft_ids = head.vocab_ids()
            lookup = eval_lookup = vocab_lookup(draft_ids, vocab, device)
        opt.load_state_dict(state["optimizer"])
        step, history, elapsed0 = state["step"], state["history"], state["elapsed"]
        epoch, in_epoch = state.get("epoch", 0), state.get("in_epoch", 0)
        evals = state.get("evals", [])
        log(_stamp(f"resumed from {ckpt_path} at step {step} ({elapsed0:.0f}s trained)"))
        budget = schedule_seconds(args, elapsed0)
    ce_chunk = _ce_chunk(args, device)
    t0 = time.perf_counter()

    def elapsed() -> float:
        return elapsed0 + time.perf_counter() - t0

    def progress() -> float:
        p = step / total_steps if total_steps else 0.0
        return max(p, elapsed() / budget) if budget > 0 else p

    def stop() -> bool:
        """The schedule is done, or this run must pause (its schedule goes on at --resume)."""
        return progress() >= 1.0 or (args.pause_by > 0 and time.time() >= args.pause_by - 15.0)

    def checkpoint(final: bool = False) -> dict:
        metrics = evaluate(head, eval_w, data, val_idx, args, device, eval_lookup)
        evals.append({"step": step, "elapsed": round(elapsed(), 1), **metrics})
        log(_stamp(f"step {step}, {elapsed():.0f}s: held-back {metrics}"))
        tmp = ckpt_path + ".tmp"
        torch.save(
            {
                "head": head.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "epoch": epoch,
                "in_epoch": in_epoch,
                "total_steps": total_steps,
                "history": history,
                "evals": evals,
                "elapsed": elapsed(),
                "args": asdict(args),
            },
            tmp,
        )
        os.replace(tmp, ckpt_path)
        save_draft(out_dir, head, capture_layers=capture)
        curve = args.curve_file or os.path.join(out_dir, "train_curve.json")
        with open(curve + ".tmp", "w") as f:
            json.dump({"final": final, "history": history, "evals": evals}, f)
        os.replace(curve + ".tmp", curve)
        return metrics

    bar = tqdm(total=total_steps or None, initial=step, desc="train", unit="step", mininterval=5)
    last_save = time.perf_counter()
    tokens_done = 0
    window_t, window_tok = time.perf_counter(), 0
    acc_sum = None
    done = stop()
    while not done:
        batches = (
            first_epoch
            if epoch == 0
            else data.batches(
                train_idx, args.seed * 1000 + epoch, args.batch_size, args.batch_tokens
            )
        )
        while in_epoch < len(batches):
            idx = batches[in_epoch]
            lr = lr_at(progress(), args)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = data.batch(idx, args.ttt_steps)
            with _autocast(args, device):
                losses = unrolled_losses(head, ce_w, batch, args, lookup, ce_chunk)
                loss = total_loss(losses, args)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
            opt.step()
            step += 1
            in_epoch += 1
            tokens_done += batch["tokens"]
            window_tok += batch["tokens"]
            bar.update(1)
            # rows are host ints: a host tensor moved to the device would synchronise
            acc = torch.stack([x[2].float() / max(1, x[3]) for x in losses])
            acc_sum = acc if acc_sum is None else acc_sum + acc
            if step % args.log_every == 0:  # the one host read of device values per window
                stats = torch.stack(
                    [loss.detach().float()]
                    + [x[0].detach().float() for x in losses]
                    + [x[1].detach().float() for x in losses]
                ).tolist()
                k1 = len(losses)
                now = time.perf_counter()
                row = {
                    "step": step,
                    "elapsed": round(elapsed(), 1),
                    "loss": round(stats[0], 4),
                    "feature_loss": [round(x, 4) for x in stats[1 : 1 + k1]],
                    "token_loss": [round(x, 3) for x in stats[1 + k1 :]],
                    "acc": [round(x, 3) for x in (acc_sum / args.log_every).tolist()],
                    "lr": lr,
                    "tokens_per_s": round(window_tok / max(1e-9, now - window_t)),
                }
                acc_sum, window_t, window_tok = None, now, 0
                history.append(row)
                bar.set_postfix(loss=row["loss"], acc0=row["acc"][0], accN=row["acc"][-1])
                if device.type != "cpu" or step % (args.log_every * 10) == 0:
                    log(
                        _stamp(
                            f"step {step} {row['elapsed']:.0f}s loss {row['loss']} acc "
                            f"{row['acc']} lr {lr:.2e} {row['tokens_per_s']} tok/s"
                        )
                    )
            done = stop()
            if done:
                break
            by_steps = args.save_every > 0 and step % args.save_every == 0
            by_time = (
                args.save_every_seconds > 0
                and time.perf_counter() - last_save >= args.save_every_seconds
            )
            if by_steps or by_time:
                checkpoint()
                last_save = time.perf_counter()
        if not done:
            epoch, in_epoch = epoch + 1, 0
    bar.close()
    metrics = checkpoint(final=True)
    log(
        _stamp(
            f"trained {step} steps ({epoch + in_epoch / max(1, len(first_epoch)):.2f} epochs) in {elapsed():.0f}s"
        )
    )
    return {
        "args": asdict(args),
        "data_dir": os.path.abspath(data_dir),
        "num_sequences": len(data),
        "num_train_sequences": int(len(train_idx)),
        "num_loss_positions": data.num_loss_positions,
        "steps": step,
        "epochs": round(epoch + in_epoch / max(1, len(first_epoch)), 3),
        "train_seconds": round(elapsed(), 1),
        "wall_seconds": round(time.time() - t_start, 1),
        "padded_tokens_this_run": tokens_done,
        "final": metrics,
        "history_tail": history[-5:],
        "evals": evals,
    }


def write_training_args(out_dir: str, summary: dict) -> None:
    with open(os.path.join(out_dir, "training_args.json"), "w") as f:
        json.dump(summary, f, indent=2)
