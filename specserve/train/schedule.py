"""The learning-rate schedule and when a run stops: the schedule follows the steps of
`epochs` passes or, with epochs 0, the clock of the time budget; a time budget also stops a
run whose schedule goes on (a later --resume run continues it)."""

from __future__ import annotations

import math
import time

from specserve.train.train_args import TrainArgs


def lr_at(progress: float, args: TrainArgs) -> float:
    """Linear warm-up over `warmup` of the schedule, then cosine down to min_lr_ratio."""
    if args.warmup > 0 and progress < args.warmup:
        return args.lr * max(progress / args.warmup, 0.01)
    frac = min(1.0, (progress - args.warmup) / max(1e-9, 1.0 - args.warmup))
    return args.lr * (
        args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    )


def schedule_seconds(args: TrainArgs, trained: float) -> float:
    """Seconds of training the schedule spans (0: it follows the steps): with epochs 0, the
    `trained` seconds of earlier runs plus this run's budget, so every run ends annealed."""
    return trained + args.time_budget if args.epochs <= 0 else 0.0


class RunClock:
    """Training seconds of this run and of all runs before it (`trained`, from the
    checkpoint), and where the schedule stands after `step` steps of `total_steps`."""

    def __init__(self, args: TrainArgs, total_steps: int, trained: float = 0.0):
        self.args = args
        self.total_steps = total_steps
        self.trained = trained
        self.seconds = schedule_seconds(args, trained)
        self.t0 = time.perf_counter()

    def this_run(self) -> float:
        return time.perf_counter() - self.t0

    def elapsed(self) -> float:
        return self.trained + self.this_run()

    def progress(self, step: int) -> float:
        if self.seconds > 0:
            return self.elapsed() / self.seconds
        return step / self.total_steps if self.total_steps else 0.0

    def lr(self, step: int) -> float:
        return lr_at(self.progress(step), self.args)

    def done(self, step: int) -> bool:
        """The schedule is over, or this run's time budget is spent."""
        budget = self.args.time_budget
        return self.progress(step) >= 1.0 or (budget > 0 and self.this_run() >= budget)
