"""The knobs of a training run (`TrainArgs`) and the two device-dependent choices they imply."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainArgs:
    epochs: float = 4.0  # passes over the data (0: no limit; then time_budget must be set)
    # seconds this run may train (0: no limit); when spent, training stops with a resumable
    # checkpoint. With epochs 0 the learning-rate schedule follows this clock (a resumed run's
    # schedule spans the seconds trained before plus this budget); with epochs > 0 it follows
    # the steps, and a later --resume run continues it
    time_budget: float = 0.0
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


def autocast_for(args: TrainArgs, device: torch.device):
    if args.autocast == "float32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=getattr(torch, args.autocast))


def ce_chunk_for(args: TrainArgs, device: torch.device) -> int:
    return args.ce_chunk or (8192 if device.type == "cuda" else 1024)
