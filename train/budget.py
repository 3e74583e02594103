"""Train for a wall-clock budget: the cosine schedule runs on elapsed time, not on a step count.

A schedule sized in epochs is cut short (at a high learning rate) on a slow or shared machine.
`TimeBudget` keeps the warmup in steps, then anneals the learning rate on whichever is further along:
the share of the budget spent or the share of `max_epochs` done. So the run always ends annealed, with a
last validation (its last epoch, or its stop at the budget or at `max_steps`, validates even between
`check_val_every_n_epoch` epochs), at the budget or at `max_epochs`, whichever comes first:

    trainer:
      max_epochs: 30
      callbacks:
        - class_path: train.budget.TimeBudget
          init_args: {minutes: 25}

Under DDP every process follows rank 0's clock (broadcast each step, as Lightning's `Timer` does), so the ranks
keep one learning rate and stop at the same step.
"""

from __future__ import annotations

import math
import time

from lightning.pytorch import Callback, LightningModule, Trainer


class TimeBudget(Callback):
    """Anneal the learning rate over `minutes` of training and stop when they are spent.

    The model's warmup (`warmup_epochs`) and floor (`min_lr`) are kept; only the cosine runs on time.
    The time spent is saved in checkpoints, so a resumed run continues where the budget stood.

    Args:
        minutes: training time, from the first training step (the folder scan and cache come before it).
    """

    def __init__(self, minutes: float):
        if minutes <= 0:
            raise ValueError(f"TimeBudget minutes must be positive, got {minutes}")
        self.budget = 60.0 * minutes
        self.spent_before = 0.0  # seconds of earlier runs of a resumed fit
        self.warm_end: float | None = None  # seconds into the budget when warmup ended
        self._start: float | None = None
        self._clock = 0.0  # rank 0's elapsed() at the start of the current batch

    def elapsed(self) -> float:
        return self.spent_before + (time.monotonic() - self._start if self._start is not None else 0.0)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.monotonic()
        hp = pl_module.hparams
        warmup = int(hp.get("warmup_epochs", 0.0) * max(1, trainer.num_training_batches))
        floor = hp.get("min_lr", 0.0) / hp.get("lr", 1.0)
        total = max(warmup + 1, int(trainer.estimated_stepping_batches))
        for config in trainer.lr_scheduler_configs:
            sched = config.scheduler
            if hasattr(sched, "lr_lambdas"):
                sched.lr_lambdas = [self._factor(warmup, total, floor)] * len(sched.lr_lambdas)

    def _factor(self, warmup: int, total: int, floor: float):
        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if self.warm_end is None:  # the cosine covers what is left of the budget after warmup
                self.warm_end = self._clock
            by_time = (self._clock - self.warm_end) / max(1e-9, self.budget - self.warm_end)
            t = min(1.0, max(by_time, (step - warmup) / (total - warmup)))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

        return factor

    def on_train_batch_start(self, trainer: Trainer, *args) -> None:
        self._clock = trainer.strategy.broadcast(self.elapsed())  # one process: returned as it is

    def on_train_epoch_start(self, trainer: Trainer, *args) -> None:
        if trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1:
            trainer.check_val_every_n_epoch = 1  # the last epoch validates, whatever the interval

    def on_train_batch_end(self, trainer: Trainer, *args) -> None:
        last_step = 0 < trainer.max_steps <= trainer.global_step
        if self._clock >= self.budget or last_step:
            trainer.should_stop = True  # Lightning validates once more, then stops
            trainer.check_val_every_n_epoch = 1  # that validation is due even between validation epochs

    def state_dict(self) -> dict:
        return {"spent": self.elapsed(), "warm_end": self.warm_end}

    def load_state_dict(self, state_dict: dict) -> None:
        self.spent_before = float(state_dict.get("spent", 0.0))
        self.warm_end = state_dict.get("warm_end")
