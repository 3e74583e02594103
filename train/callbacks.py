"""Callbacks that make a resumed run continue the interrupted one, not start a second one."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint


class KeepBestScore(Callback):
    """Restore every `ModelCheckpoint`'s best score on resume, however the run directory is spelled.

    Lightning restores `best_model_score` only when the checkpoint's stored `dirpath` equals the
    callback's as a string: `runs/a/checkpoints` saved and `/home/me/runs/a/checkpoints` resumed (or a
    symlink, or another working directory) lose it, and the next epoch, however bad, replaces
    `best.ckpt`. A checkpoint resumed from the callback's own folder, or whose stored folder is the
    same directory, is this run's: its stored dirpath is rewritten to the callback's before the load.
    """

    def on_load_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("callbacks", {})
        ckpt_path = trainer.ckpt_path
        for cb in trainer.checkpoint_callbacks:
            state = states.get(cb.state_key) if isinstance(cb, ModelCheckpoint) else None
            if not state or not cb.dirpath or not isinstance(state.get("dirpath"), str):
                continue
            here = os.path.realpath(cb.dirpath)
            resumed_here = ckpt_path is not None and os.path.realpath(os.path.dirname(str(ckpt_path))) == here
            if resumed_here or os.path.realpath(state["dirpath"]) == here:
                state["dirpath"] = cb.dirpath
