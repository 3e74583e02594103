"""Callbacks for the DDP tests: each rank saves its weights, or a fingerprint of every image it trained on."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


class SaveRankWeights(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        out = Path(trainer.default_root_dir) / f"rank{trainer.global_rank}.pt"
        torch.save({k: v.detach().cpu() for k, v in pl_module.net.state_dict().items()}, out)


class SaveRankSamples(Callback):
    def __init__(self):
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen += [hash(x.numpy().tobytes()) for x in batch[0].cpu()]

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.seen, Path(trainer.default_root_dir) / f"samples{trainer.global_rank}.pt")
