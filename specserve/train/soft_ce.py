"""The cross-entropy of lm_head(x) against the target's soft next-token labels, without
keeping [rows, vocab] logits for the backward (the lm_head is the largest matmul of a step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
