"""Callbacks that make a resumed run continue the interrupted one, not start a second one, and that write a fit's
run files only once the checkpoint it resumes has passed its checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import SaveConfigCallback

from train.held_split import run_split


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
                old, state["dirpath"] = state["dirpath"], cb.dirpath
                # a run directory moved (or spelled otherwise) keeps its files' names, in its own folder
                for key in {"best_model_path", "kth_best_model_path", "last_model_path"} & set(state):
                    state[key] = _moved(state[key], old, cb.dirpath)
                if isinstance(state.get("best_k_models"), dict):
                    state["best_k_models"] = {_moved(k, old, cb.dirpath): v for k, v in state["best_k_models"].items()}


def _moved(path: Any, old: str, new: str) -> Any:
    """`path` in folder `new` when it was a file of folder `old` (as the checkpoint stored them) and `new` holds
    it; else as it is."""
    if isinstance(path, str) and path and os.path.dirname(path) == old.rstrip("/"):
        moved = os.path.join(new, os.path.basename(path))
        return moved if os.path.exists(moved) else path
    return path


class ClearReplacedRun(Callback):
    """`--overwrite true`: remove the run this fit replaces (`train.run_dir.clear_replaced_run`) as training starts,
    once every check has passed, the checkpoint's (its classes, network and preprocessing, checked as it loads)
    included. A smoke run (`--trainer.fast_dev_run`), which writes no checkpoint, leaves it."""

    def __init__(self, run_dir: str, ckpt_path: str | None):
        self.run_dir, self.ckpt_path = run_dir, ckpt_path

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        from train.run_dir import clear_replaced_run

        if trainer.is_global_zero and not trainer.fast_dev_run:
            clear_replaced_run(self.run_dir, self.ckpt_path)


class RunDirConfig(SaveConfigCallback):
    """A fit's run files as training starts, once the checkpoint it resumes has been loaded whole, its checks and
    its optimizer's state included (a refused resume leaves the run as it was): the resolved config as
    `<run_dir>/config.yaml` (not in a logger's version folder), and the data module's split and reports. Validate
    and the others keep the fit's."""

    def setup(self, trainer: pl.Trainer, pl_module, stage: str) -> None:
        pass  # Lightning's saves here, before the checkpoint is loaded and checked

    def on_train_start(self, trainer: pl.Trainer, pl_module) -> None:
        if self.already_saved or not trainer.is_global_zero:
            return
        run_dir = Path(trainer.default_root_dir)
        if hasattr(trainer.datamodule, "write_reports"):
            trainer.datamodule.write_reports(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        config = self.config.clone()
        config.overwrite, config.ckpt_path = False, None  # this command's alone: a refit of config.yaml asks again
        if config.get("data.split") == run_split(str(run_dir)):  # a resume's own: a refit into another run splits anew
            config["data.split"] = None
        self.parser.save(config, run_dir / self.config_filename, skip_none=False, overwrite=True, multifile=False)
        self.already_saved = True
