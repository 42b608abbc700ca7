"""Training a draft head on a self-distilled dataset: `train()`.

AdamW over length-grouped batches (`sequences.py`), the losses of the head unrolled as it
drafts (`unroll.py`), the schedule and the time budget (`schedule.py`), held-back evaluation
(`evaluate.py`) and, every `save_every` steps or `save_every_seconds` and at the end, the
draft plus a resumable checkpoint (`checkpoint.py`).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from specserve.errors import InvalidArgument
from specserve.train.checkpoint import load_state, save_draft, save_state, write_curve
from specserve.train.evaluate import evaluate
from specserve.train.head_init import ce_vocabulary, make_head, scale_fc_init_, vocab_lookup
from specserve.train.progress_log import stamp
from specserve.train.schedule import RunClock
from specserve.train.sequences import SeqData, split_by_prompt
from specserve.train.train_args import TrainArgs, autocast_for, ce_chunk_for
from specserve.train.unroll import total_loss, unrolled_losses


def _check_args(args: TrainArgs) -> None:
    if args.epochs <= 0 and args.time_budget <= 0:
        raise ValueError("give epochs > 0 or a time budget")
    if args.head not in ("eagle", "eagle3"):
        raise ValueError(f"head must be 'eagle' or 'eagle3', got {args.head!r}")
    if args.head == "eagle3" and args.init_layer is not None:
        raise ValueError("init_layer applies to EAGLE heads only (an EAGLE3 layer reads 2H)")
    if args.draft_vocab < 0 or args.ce_vocab < 0:
        raise ValueError("draft_vocab and ce_vocab must be >= 0 (0: the whole vocabulary)")


def _refuse_diverged(head, step: int, lr: float, loss: float | None = None) -> None:
    """Training that diverged stops before it writes a draft (an earlier checkpoint's draft
    stays): a head of non-finite weights would be served as a draft that is never accepted."""
    if loss is None and bool(
        torch.stack([torch.isfinite(p).all() for p in head.parameters()]).all()
    ):
        return  # (one read of the device for every parameter)
    what = f"the loss is {loss}" if loss is not None else "the head's weights are not finite"
    raise InvalidArgument(
        "--lr",
        f"training diverged at step {step}: {what} (lr {lr:g}); lower --lr, or lengthen --warmup",
    )


def _capture_layers(data_dir: str) -> list[int]:
    """The target layers whose inputs the dataset recorded as EAGLE3 features."""
    path = os.path.join(data_dir, "manifest.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return list(json.load(f).get("capture_layers") or [])


@dataclass
class _Head:
    """A head to train and the vocabularies its loss and its evaluation rank over."""

    head: torch.nn.Module
    ce_w: torch.Tensor | None  # EAGLE: the (reduced) target lm_head of the loss; EAGLE3: None
    lookup: torch.Tensor | None  # target id -> index in the reduced vocabulary, -1 outside
    eval_w: torch.Tensor | None
    eval_lookup: torch.Tensor | None


def _build_head(target, data: SeqData, args: TrainArgs, device, resume: bool, log) -> _Head:
    """The head, its reduced vocabulary (EAGLE3: `draft_vocab`; EAGLE: `ce_vocab` of the loss
    only) chosen from the data's next-token candidates."""
    eagle3 = args.head == "eagle3"
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
                stamp(
                    f"draft vocabulary: {len(draft_ids)} of {vocab} tokens, covering "
                    f"{100 * cover:.2f}% of the target's next tokens in the data"
                )
            )
    elif 0 < args.ce_vocab < vocab:
        keep, lookup, cover = vocabulary(args.ce_vocab)
        ce_w = lm_head_w[keep.to(device)].contiguous()
        log(stamp(f"cross-entropy over {len(keep)} of {vocab} tokens ({100 * cover:.2f}%)"))
    head = make_head(target, args.seed, args.init_layer, args.head, draft_ids, args.draft_layers)
    head = head.to(device).float().train()
    if args.scale_init and not resume:
        scale_fc_init_(head, data)
    head.requires_grad_(True)
    eval_w, eval_lookup = (None, lookup) if eagle3 else (lm_head_w, None)
    return _Head(head, ce_w, lookup, eval_w, eval_lookup)


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

    Stops after `epochs` passes or when this run's `time_budget` seconds are spent (with
    epochs 0 the learning-rate schedule runs on that clock, so it anneals whatever the speed).
    resume: continue from the checkpoint's step, optimizer state and schedule.
    Returns a summary (write it with `write_training_args`)."""
    from specserve.train.data import load_shards

    t_start = time.time()
    device = torch.device(args.device)
    _check_args(args)
    eagle3 = args.head == "eagle3"
    capture = _capture_layers(data_dir)
    if eagle3 and (args.ce_vocab or args.feature_weight != TrainArgs.feature_weight):
        log(stamp("EAGLE3: --ce-vocab and --feature-weight do not apply (no feature loss)"))
    feature = "aux" if eagle3 else "hidden"
    shards = load_shards(data_dir, device, drop=("hidden",) if eagle3 else ("aux",))
    data = SeqData(shards, args.max_len, device, feature)
    del shards
    if len(data) == 0 and data.num_with_answer:
        raise InvalidArgument(
            "--max-len",
            f"no sequence of {data_dir} has an answer token within its first {args.max_len} "
            "tokens: raise --max-len above the prompts' lengths",
        )
    if len(data) == 0:
        raise ValueError(f"{data_dir}: no sequence with an answer")
    val_idx, train_idx = split_by_prompt(data, args.val_fraction, args.seed)
    if len(train_idx) == 0:
        raise ValueError(f"{data_dir}: no training sequence left after holding back prompts")
    first_epoch = data.batches(train_idx, args.seed * 1000, args.batch_size, args.batch_tokens)
    # (at least one step: a fraction of an epoch that rounds to none would mean "no limit")
    total_steps = max(1, round(args.epochs * len(first_epoch))) if args.epochs > 0 else 0
    limits = [f"{total_steps} steps" if total_steps else "no step limit"]
    limits.append(f"{args.time_budget:.0f}s budget" if args.time_budget > 0 else "no time limit")
    log(
        stamp(
            f"train: {len(train_idx)} sequences ({data.num_loss_positions} positions with a "
            f"loss), {len(val_idx)} held back; {len(first_epoch)} steps per epoch; "
            f"{', '.join(limits)}; device {device}"
        )
    )

    work_dir = work_dir or out_dir
    os.makedirs(work_dir, exist_ok=True)
    ckpt_path = os.path.join(work_dir, "checkpoint.pt")
    # (--resume with no checkpoint yet starts fresh, initialized as a run without it)
    resume = resume and os.path.isfile(ckpt_path)
    if not resume:
        log(stamp(f"no checkpoint at {ckpt_path}: starting fresh"))
    h = _build_head(target, data, args, device, resume, log)
    head = h.head
    opt_kw = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(
        head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, **opt_kw
    )
    step, epoch, in_epoch, history, evals, trained = 0, 0, 0, [], [], 0.0
    if resume:
        state = load_state(ckpt_path, args, device)
        head.load_state_dict(state["head"])
        if eagle3:  # the checkpoint's vocabulary, whatever this data would choose
            h.lookup = h.eval_lookup = vocab_lookup(
                head.vocab_ids(), target.config.vocab_size, device
            )
        opt.load_state_dict(state["optimizer"])
        step, history, trained = state["step"], state["history"], state["elapsed"]
        epoch, in_epoch = state.get("epoch", 0), state.get("in_epoch", 0)
        evals = state.get("evals", [])
        log(stamp(f"resumed from {ckpt_path} at step {step} ({trained:.0f}s trained)"))
    ce_chunk = ce_chunk_for(args, device)
    clock = RunClock(args, total_steps, trained)

    def checkpoint(final: bool = False) -> dict:
        _refuse_diverged(head, step, args.lr)
        metrics = evaluate(head, h.eval_w, data, val_idx, args, device, h.eval_lookup)
        evals.append({"step": step, "elapsed": round(clock.elapsed(), 1), **metrics})
        log(stamp(f"step {step}, {clock.elapsed():.0f}s: held-back {metrics}"))
        progress = {
            "step": step,
            "epoch": epoch,
            "in_epoch": in_epoch,
            "total_steps": total_steps,
            "history": history,
            "evals": evals,
            "elapsed": clock.elapsed(),
        }
        save_state(ckpt_path, head, opt, args, progress)
        save_draft(out_dir, head, capture_layers=capture)
        write_curve(
            args.curve_file or os.path.join(out_dir, "train_curve.json"), final, history, evals
        )
        return metrics

    bar = tqdm(total=total_steps or None, initial=step, desc="train", unit="step", mininterval=5)
    last_save = time.perf_counter()
    tokens_done = 0
    window = _LogWindow()
    done = clock.done(step)
    while not done:
        batches = (
            first_epoch
            if epoch == 0
            else data.batches(
                train_idx, args.seed * 1000 + epoch, args.batch_size, args.batch_tokens
            )
        )
        while in_epoch < len(batches):
            lr = clock.lr(step)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = data.batch(batches[in_epoch], args.ttt_steps)
            with autocast_for(args, device):
                losses = unrolled_losses(head, h.ce_w, batch, args, h.lookup, ce_chunk)
                loss = total_loss(losses, args)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
            opt.step()
            step += 1
            in_epoch += 1
            tokens_done += batch["tokens"]
            bar.update(1)
            window.add(losses, batch["tokens"])
            if step % args.log_every == 0:
                row = window.row(step, clock.elapsed(), loss, losses, lr, args.log_every)
                if not math.isfinite(row["loss"]):
                    _refuse_diverged(head, step, args.lr, row["loss"])
                history.append(row)
                bar.set_postfix(loss=row["loss"], acc0=row["acc"][0], accN=row["acc"][-1])
                if device.type != "cpu" or step % (args.log_every * 10) == 0:
                    log(
                        stamp(
                            f"step {step} {row['elapsed']:.0f}s loss {row['loss']} acc "
                            f"{row['acc']} lr {lr:.2e} {row['tokens_per_s']} tok/s"
                        )
                    )
            done = clock.done(step)
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
    epochs_done = epoch + in_epoch / max(1, len(first_epoch))
    log(stamp(f"trained {step} steps ({epochs_done:.2f} epochs) in {clock.elapsed():.0f}s"))
    return {
        "args": asdict(args),
        "data_dir": os.path.abspath(data_dir),
        "num_sequences": len(data),
        "num_train_sequences": int(len(train_idx)),
        "num_loss_positions": data.num_loss_positions,
        "steps": step,
        "epochs": round(epochs_done, 3),
        "train_seconds": round(clock.elapsed(), 1),
        "wall_seconds": round(time.time() - t_start, 1),
        "padded_tokens_this_run": tokens_done,
        "final": metrics,
        "history_tail": history[-5:],
        "evals": evals,
    }


class _LogWindow:
    """Accuracies and tokens since the last log line; the device values are read once per
    line (every read of a device value waits for the device)."""

    def __init__(self):
        self.t, self.tokens, self.acc_sum = time.perf_counter(), 0, None

    def add(self, losses, tokens: int) -> None:
        # rows are host ints: a host tensor moved to the device would synchronise
        acc = torch.stack([x[2].float() / max(1, x[3]) for x in losses])
        self.acc_sum = acc if self.acc_sum is None else self.acc_sum + acc
        self.tokens += tokens

    def row(self, step: int, elapsed: float, loss, losses, lr: float, steps: int) -> dict:
        stats = torch.stack(
            [loss.detach().float()]
            + [x[0].detach().float() for x in losses]
            + [x[1].detach().float() for x in losses]
        ).tolist()
        k1 = len(losses)
        now = time.perf_counter()
        row = {
            "step": step,
            "elapsed": round(elapsed, 1),
            "loss": round(stats[0], 4),
            "feature_loss": [round(x, 4) for x in stats[1 : 1 + k1]],
            "token_loss": [round(x, 3) for x in stats[1 + k1 :]],
            "acc": [round(x, 3) for x in (self.acc_sum / steps).tolist()],
            "lr": lr,
            "tokens_per_s": round(self.tokens / max(1e-9, now - self.t)),
        }
        self.t, self.tokens, self.acc_sum = now, 0, None
        return row
