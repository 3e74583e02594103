"""Callbacks for the DDP and resume tests: each rank saves its weights, a fingerprint of every image it trained on
(at the end, or batch by batch), or how many images it validated."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


class SaveRankWeights(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        out = Path(trainer.default_root_dir) / f"rank{trainer.global_rank}.pt"
        torch.save({k: v.detach().cpu() for k, v in pl_module.net.state_dict().items()}, out)

    def on_exception(self, trainer, pl_module, exception) -> None:  # a run stopped on every rank: where it stood
        self.on_train_end(trainer, pl_module)


def fingerprints(images: torch.Tensor) -> list[str]:
    """One short digest per image, the same in every process (`hash` of bytes is salted per process)."""
    return [hashlib.blake2b(x.numpy().tobytes(), digest_size=8).hexdigest() for x in images.cpu()]


class SaveRankSamples(Callback):
    def __init__(self):
        self.seen: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen += fingerprints(batch[0])

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.seen, Path(trainer.default_root_dir) / f"samples{trainer.global_rank}.pt")


class SaveRankValImages(Callback):
    """Each rank saves how many images it validated in each epoch (sanity checks left out)."""

    def __init__(self):
        self.counts: list[int] = []

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.counts.append(0)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self.counts[-1] += len(batch[1])

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.counts, Path(trainer.default_root_dir) / f"val{trainer.global_rank}.pt")

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.on_train_end(trainer, pl_module)


class LogSamples(Callback):
    """Append `epoch step fingerprint...` for each training batch to `samples.log` in the run directory.

    Each line is flushed as its batch starts, so a killed run leaves the lines of the steps it reached.
    """

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        line = " ".join([str(trainer.current_epoch), str(trainer.global_step), *fingerprints(batch[0])])
        with open(Path(trainer.default_root_dir) / "samples.log", "a") as f:
            f.write(line + "\n")
