"""Training an EAGLE-1 draft head on self-distilled features, with training-time test.

The head (`EagleHead`: fc over [embedding(x_{p+1}); feature h_p], one decoder layer, the
target's frozen embedding and lm_head) is trained exactly as it is used by
`spec/drafter.py` (position offset 0: token x_{p+1} sits at position p with feature h_p):

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
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.spec.draft_heads import EagleHead
from specserve.spec.eagle_checkpoint import hf_style_config, save_eagle_checkpoint
from specserve.train.features import _attend, _split_heads

ARCHITECTURE = "LlamaForCausalLMEagle"


@dataclass
class TrainArgs:
    epochs: float = 2.0
    lr: float = 1e-3
    batch_size: int = 16  # sequences per step (grouped by length)
    ttt_steps: int = 2  # extra unrolled steps on the head's own features
    ttt_decay: float = 0.8
    feature_weight: float = 1.0
    token_weight: float = 0.1
    weight_decay: float = 0.0
    warmup: float = 0.03  # share of the steps
    min_lr_ratio: float = 0.05
    grad_clip: float = 0.5
    max_len: int = 1024  # longer sequences are cut
    val_fraction: float = 0.02
    init_layer: int | None = None  # copy this target layer into the head's decoder layer
    autocast: str = "bfloat16"  # compute dtype of matmuls ('float32': none)
    seed: int = 0
    device: str = "cpu"
    save_every: int = 200  # steps between resumable checkpoints
    log_every: int = 20


# ---- data ---------------------------------------------------------------------------------------
class SeqData:
    """Sequences of a dataset folder, kept flat in memory."""

    def __init__(self, shards: list[dict], max_len: int):
        self.items: list[tuple] = []  # (shard, start, length, prompt_len, ended)
        self.shards = shards
        for s, sh in enumerate(shards):
            offs = sh["offsets"].tolist()
            for j in range(len(offs) - 1):
                n = min(offs[j + 1] - offs[j], max_len)
                pl = int(sh["prompt_lens"][j])
                ended = bool(sh["ended"][j]) and offs[j + 1] - offs[j] <= max_len
                if n - pl >= 2:
                    self.items.append((s, offs[j], n, pl, ended))

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, idx: list[int], device) -> dict[str, torch.Tensor]:
        """Right-padded [B, N] tensors plus the loss mask over training positions p (token
        x_{p+1}, feature h_p, targets at p + 1)."""
        items = [self.items[i] for i in idx]
        width = max(it[2] for it in items)
        b = len(items)
        sh0 = self.shards[0]
        hsz, k = sh0["hidden"].shape[1], sh0["top_ids"].shape[1]
        ids = torch.zeros(b, width, dtype=torch.int64)
        hidden = torch.zeros(b, width, hsz, dtype=torch.float16)
        top_ids = torch.zeros(b, width, k, dtype=torch.int64)
        top_probs = torch.zeros(b, width, k, dtype=torch.float16)
        mask = torch.zeros(b, width - 1, dtype=torch.bool)
        for r, (s, start, n, pl, ended) in enumerate(items):
            sh = self.shards[s]
            ids[r, :n] = sh["input_ids"][start : start + n]
            hidden[r, :n] = sh["hidden"][start : start + n]
            top_ids[r, :n] = sh["top_ids"][start : start + n]
            top_probs[r, :n] = sh["top_probs"][start : start + n]
            # target index t = p + 1 in [pl - 1, last]: predictions of answer tokens (and of
            # the token after a cut answer; nothing after a final EOS)
            last = n - 2 if ended else n - 1
            mask[r, max(0, pl - 2) : last] = True
        return {
            "ids": ids.to(device),
            "hidden": hidden.to(device),
            "top_ids": top_ids.to(device),
            "top_probs": top_probs.to(device),
            "mask": mask.to(device),
        }


def epoch_batches(data: SeqData, indices: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """Shuffled batches of similar lengths (sorted within windows of 32 batches)."""
    rng = random.Random(seed)
    order = list(indices)
    rng.shuffle(order)
    window = batch_size * 32
    batches = []
    for i in range(0, len(order), window):
        chunk = sorted(order[i : i + window], key=lambda j: data.items[j][2])
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


# ---- the head in training -----------------------------------------------------------------------
def ttt_mask(t: int, k: int, device) -> torch.Tensor:
    """bool [T, (k+1)T] over keys [step 0 | step 1 | ... | step k] for step-k queries."""
    p = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    blocks = [j <= p - k] + [j == p - k + i for i in range(1, k + 1)]
    return torch.cat(blocks, dim=1)


def head_step(head: EagleHead, tokens, feats, positions, caches, mask):
    """One unrolled step of the head over [B, T]: returns g [B, T, H]; appends each layer's
    K/V to `caches` (one list of (k, v) per layer). mask None: causal (step 0)."""
    h = head.fc(torch.cat([head._embed[0](tokens).to(feats.dtype), feats], dim=-1))
    for li, layer in enumerate(head.layers):
        attn = layer.self_attn
        q, k, v = _split_heads(attn, layer.input_layernorm(h), positions)
        caches[li].append((k, v))
        if mask is None:
            out = _attend(attn, q, k, v, is_causal=True)
        else:
            ks = torch.cat([c[0] for c in caches[li]], dim=2)
            vs = torch.cat([c[1] for c in caches[li]], dim=2)
            out = _attend(attn, q, ks, vs, mask=mask)
        h = h + out
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


class _LinearSoftCE(torch.autograd.Function):
    """Cross-entropy of lm_head(g) against soft targets over a few token ids, without keeping
    [rows, vocab] logits for the backward: the gradient is formed chunk by chunk in the
    forward ((softmax - target) @ W) and scaled in the backward. Returns per-row losses and
    per-row top-1 hits (the target's likeliest token is the head's argmax)."""

    @staticmethod
    def forward(ctx, g, weight, ids, probs, chunk: int):
        losses, hits, grads = [], [], []
        for s in range(0, g.shape[0], chunk):
            logits = F.linear(g[s : s + chunk].to(weight.dtype), weight).float()
            m = logits.amax(-1, keepdim=True)
            picked = logits.gather(1, ids[s : s + chunk])
            hits.append(picked[:, 0] >= m[:, 0])
            e = logits.sub_(m).exp_()
            z = e.sum(-1, keepdim=True)
            p = probs[s : s + chunk]
            losses.append((m + z.log())[:, 0] - (p * picked).sum(-1))
            e.div_(z).scatter_add_(1, ids[s : s + chunk], -p)
            grads.append(e.to(weight.dtype) @ weight)
        ctx.save_for_backward(torch.cat(grads))
        ctx.g_dtype = g.dtype
        return torch.cat(losses), torch.cat(hits)

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits):
        (grad,) = ctx.saved_tensors
        return (grad.float() * grad_loss[:, None]).to(ctx.g_dtype), None, None, None, None


def unrolled_losses(head, lm_head_w, batch, args: TrainArgs, ce_chunk: int = 1024):
    """Per unrolled step k: (feature loss, token loss, top-1 agreement, rows)."""
    ids, hidden, mask = batch["ids"], batch["hidden"], batch["mask"]
    b, n = ids.shape
    t = n - 1
    tokens = ids[:, 1:]
    target = hidden[:, 1:].float()
    top_ids = batch["top_ids"][:, 1:]
    top_p = batch["top_probs"][:, 1:].float()
    top_p = top_p / top_p.sum(-1, keepdim=True).clamp(min=1e-6)
    positions = torch.arange(t, device=ids.device).expand(b, t)
    feats = hidden[:, :-1].float()
    caches: list[list] = [[] for _ in head.layers]
    out = []
    for k in range(args.ttt_steps + 1):
        m = None if k == 0 else ttt_mask(t, k, ids.device)
        g = head_step(head, tokens, feats, positions, caches, m)
        valid = mask.clone()
        valid[:, :k] = False
        rows = valid.nonzero(as_tuple=True)
        gs = g[rows]
        f_loss = F.smooth_l1_loss(gs.float(), target[rows])
        t_rows, hits = _LinearSoftCE.apply(gs, lm_head_w, top_ids[rows], top_p[rows], ce_chunk)
        out.append((f_loss, t_rows.mean(), hits.float().mean().item(), len(rows[0])))
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
def make_head(target, seed: int, init_layer: int | None = None) -> EagleHead:
    cfg = target.config.with_changes(num_layers=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    head = EagleHead(cfg, target.model.embed_tokens, target.lm_head_weight, fc_bias=True)
    if init_layer is not None:
        src = target.model.layers[init_layer].state_dict()
        dst = head.layers[0].state_dict()
        head.layers[0].load_state_dict(
            {k: src[k].to(v.dtype) for k, v in dst.items() if k in src}, strict=False
        )
    return head


def lr_at(step: int, total: int, args: TrainArgs) -> float:
    warm = max(1, int(args.warmup * total))
    if step < warm:
        return args.lr * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return args.lr * (
        args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    )


def _autocast(args: TrainArgs, device: torch.device):
    if args.autocast == "float32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=getattr(torch, args.autocast))


@torch.no_grad()
def evaluate(head, lm_head_w, data: SeqData, indices, args: TrainArgs, device) -> dict:
    """Top-1 agreement with the target per unrolled step on held-back sequences."""
    if not indices:
        return {}
    head.eval()
    hits = [0.0] * (args.ttt_steps + 1)
    count = [0] * (args.ttt_steps + 1)
    for idx in epoch_batches(data, indices, args.batch_size, 0):
        with _autocast(args, device):
            losses = unrolled_losses(head, lm_head_w, data.batch(idx, device), args)
        for k, (_, _, acc, rows) in enumerate(losses):
            hits[k] += acc * rows
            count[k] += rows
    head.train()
    return {f"val_acc_{k}": round(hits[k] / max(1, count[k]), 4) for k in range(len(hits))}


def save_draft(folder: str, head: EagleHead, extra: dict | None = None) -> None:
    """The head in the published layout, float16, without the shared embedding / lm_head."""
    out = EagleHead(head.config, head._embed[0], head._lm_head[0], fc_bias=head.fc.bias is not None)
    out.load_state_dict(head.state_dict())
    out = out.half()
    cfg = hf_style_config(head.config, ARCHITECTURE, torch_dtype="float16")
    save_eagle_checkpoint(folder, out, cfg, extra)


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
    draft to `out_dir` (config.json, model.safetensors) and resumable state to
    `work_dir/checkpoint.pt` (default: out_dir) every `save_every` steps and at the end.
    Returns a summary (write it with `write_training_args`)."""
    from specserve.train.data import load_shards

    device = torch.device(args.device)
    os.makedirs(out_dir, exist_ok=True)
    data = SeqData(load_shards(data_dir), args.max_len)
    if len(data) == 0:
        raise ValueError(f"{data_dir}: no sequence with an answer")
    rng = random.Random(args.seed)
    all_idx = list(range(len(data)))
    rng.shuffle(all_idx)
    n_val = int(len(all_idx) * args.val_fraction)
    val_idx, train_idx = all_idx[:n_val], all_idx[n_val:]
    steps_per_epoch = math.ceil(len(train_idx) / args.batch_size)
    total_steps = max(1, int(round(args.epochs * steps_per_epoch)))

    head = make_head(target, args.seed, args.init_layer).to(device).float().train()
    head.requires_grad_(True)
    compute_dtype = torch.float32 if args.autocast == "float32" else getattr(torch, args.autocast)
    lm_head_w = target.lm_head_weight.detach().to(device, compute_dtype)
    opt = torch.optim.AdamW(
        head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    work_dir = work_dir or out_dir
    os.makedirs(work_dir, exist_ok=True)
    ckpt_path = os.path.join(work_dir, "checkpoint.pt")
    step, history, elapsed0 = 0, [], 0.0
    if resume and os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, weights_only=False, map_location=device)
        if state["total_steps"] != total_steps:
            log(f"resume: schedule had {state['total_steps']} steps, now {total_steps}")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step, history, elapsed0 = state["step"], state["history"], state["elapsed"]
        log(f"resumed from {ckpt_path} at step {step}")

    def checkpoint() -> None:
        tmp = ckpt_path + ".tmp"
        torch.save(
            {
                "head": head.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "total_steps": total_steps,
                "history": history,
                "elapsed": elapsed0 + time.perf_counter() - t0,
                "args": asdict(args),
            },
            tmp,
        )
        os.replace(tmp, ckpt_path)

    t0 = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step")
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        batches = epoch_batches(data, train_idx, args.batch_size, args.seed * 1000 + epoch)
        for idx in batches[in_epoch:]:
            if step >= total_steps:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total_steps, args)
            batch = data.batch(idx, device)
            want_acc = (step + 1) % args.log_every == 0
            with _autocast(args, device):
                losses = unrolled_losses(head, lm_head_w, batch, args)
                loss = total_loss(losses, args)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
            opt.step()
            step += 1
            bar.update(1)
            if want_acc:
                row = {
                    "step": step,
                    "loss": round(float(loss), 4),
                    "feature_loss": [round(float(x[0]), 4) for x in losses],
                    "token_loss": [round(float(x[1]), 3) for x in losses],
                    "acc": [round(x[2], 3) for x in losses],
                    "lr": opt.param_groups[0]["lr"],
                }
                history.append(row)
                bar.set_postfix(loss=row["loss"], acc0=row["acc"][0], accN=row["acc"][-1])
            if step % args.save_every == 0 and step < total_steps:
                checkpoint()
    bar.close()
    elapsed = elapsed0 + time.perf_counter() - t0
    metrics = evaluate(head, lm_head_w, data, val_idx, args, device)
    log(f"trained {step} steps in {elapsed:.0f}s; held-back accuracy {metrics}")
    save_draft(out_dir, head)
    summary = {
        "args": asdict(args),
        "data_dir": os.path.abspath(data_dir),
        "num_sequences": len(data),
        "num_train_sequences": len(train_idx),
        "steps": step,
        "train_seconds": round(elapsed, 1),
        "final": metrics,
        "history_tail": history[-5:],
    }
    checkpoint()
    return summary


def write_training_args(out_dir: str, summary: dict) -> None:
    with open(os.path.join(out_dir, "training_args.json"), "w") as f:
        json.dump(summary, f, indent=2)
