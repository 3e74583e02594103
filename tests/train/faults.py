"""Faults that tests inject into a real training run through `--trainer.callbacks+=tests.train.faults.<Name>`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


class PoisonBatch(Callback):
    """From epoch `epoch` on, every training batch holds NaN pixels (a corrupt input or an overflow upstream).

    Args:
        epoch: the first poisoned epoch.
        rank: poison this DDP process only (None: every process).
    """

    def __init__(self, epoch: int = 1, rank: int | None = None):
        self.epoch, self.rank = epoch, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.current_epoch >= self.epoch and self.rank in (None, trainer.global_rank):
            batch[0].fill_(float("nan"))


class SlowSave(Callback):
    """Make every checkpoint `mb` MB bigger (so that writing it takes a while) and mark when a save starts.

    The padding is a plain tensor, so the file still loads with `weights_only=True`. `save_started` is
    touched in the run directory before the file is written, so a test can kill the run while it writes.
    """

    def __init__(self, mb: int = 200):
        self.mb = mb

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        checkpoint["padding"] = torch.ones(self.mb * (1 << 18))  # float32: 4 bytes each
        (Path(trainer.default_root_dir) / "save_started").touch()


class HangAfter(Callback):
    """Stop making progress after an optimizer step (a hung node), and touch `hung` in the run directory, so
    that a test kills the run at a known point.

    Args:
        step: the optimizer step after which the run hangs.
    """

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            (Path(trainer.default_root_dir) / "hung").touch()
            time.sleep(3600)  # the hang itself: the test kills the process


class LateStart(Callback):
    """One DDP process starts training `seconds` later than the others (a slow node), after the callbacks
    before it in the list have started their clocks.

    Args:
        seconds: how long the process waits.
        rank: the late process.
    """

    def __init__(self, seconds: float = 3.0, rank: int = 1):
        self.seconds, self.rank = seconds, rank

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)  # the delay itself: the other process waits for this one at its first step


class Stop(Callback):
    """At the start of epoch `epoch`, the process gets `signal`: SIGTERM as from `docker stop`, SIGINT as from Ctrl-C.
    With `group`, its whole process group does, DataLoader workers included, as from `timeout`, systemd, SLURM or a
    terminal (run it in a session of its own)."""

    def __init__(self, epoch: int = 1, group: bool = False, signal: str = "SIGTERM"):
        self.epoch, self.group, self.signal = epoch, group, signal

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            number = signal.Signals[self.signal]
            os.killpg(os.getpgid(0), number) if self.group else os.kill(os.getpid(), number)
