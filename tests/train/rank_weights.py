"""A callback for the DDP test: each rank saves its network weights when training ends."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


class SaveRankWeights(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        out = Path(trainer.default_root_dir) / f"rank{trainer.global_rank}.pt"
        torch.save({k: v.detach().cpu() for k, v in pl_module.net.state_dict().items()}, out)
