"""Held-back evaluation: per unrolled step, how often the head's top token is the target's."""

from __future__ import annotations

import torch

from specserve.train.sequences import SeqData
from specserve.train.train_args import TrainArgs, autocast_for, ce_chunk_for
from specserve.train.unroll import total_loss, unrolled_losses


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
        with autocast_for(args, device):
            losses = unrolled_losses(
                head,
                lm_head_w,
                data.batch(idx, args.ttt_steps),
                args,
                lookup,
                ce_chunk_for(args, device),
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
