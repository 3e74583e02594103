"""What a fit ends with: `summary.json` in the run directory and the "Training finished." lines that say what
to run next (`report_fit`, rank 0 only)."""

from __future__ import annotations

import json
import logging
import math
import shlex
from pathlib import Path

from lightning.pytorch import LightningDataModule, LightningModule, Trainer

from train.run_dir import CKPT_DIR

log = logging.getLogger(__name__)


def report_fit(trainer: Trainer, model: LightningModule, datamodule: LightningDataModule, seconds: float) -> None:
    """Write `summary.json` (not for a fast_dev_run) and log the best checkpoint and how to export it."""
    ckpt = trainer.checkpoint_callback
    best = Path(ckpt.best_model_path) if ckpt and ckpt.best_model_path else None
    score = ckpt.best_model_score if ckpt is not None else None
    scores = getattr(model, "best_scores", {})  # every validation score of the best epoch
    summary = {
        "monitor": None if ckpt is None else ckpt.monitor,  # what chose best_checkpoint
        "best_score": None if score is None else float(score),
        **{f"best_val_{k}": v for k, v in scores.items()},  # best_val_acc: the best checkpoint's accuracy
        "best_checkpoint": None if best is None else str(best),
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        "fit_seconds": round(seconds, 2),
        "train_images": len(getattr(datamodule, "train_set", [])),
    }
    if not trainer.fast_dev_run:
        (Path(trainer.default_root_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = ["", "Training finished."]
    if score is not None:
        lines.append(f"  best {ckpt.monitor}: {float(score):.4f}")
    if "acc" in scores:
        lines.append(f"  its validation accuracy: {scores['acc']:.4f}")
    kind = "best"
    if best is None and ckpt is not None and not trainer.fast_dev_run:
        log.warning("no best.ckpt was chosen: %s", _why_no_best(trainer, validated=bool(scores)))
        last = Path(trainer.default_root_dir) / CKPT_DIR / "last.ckpt"  # LastCheckpoint's, written every epoch
        best, kind = (last, "last") if last.is_file() else (None, kind)
    if best is not None:
        lines += [
            f"  {kind} checkpoint: {best}",
            "  next: export it to ONNX with",
            f"    vit-export {shlex.quote(str(best))} -o model.onnx",
        ]
    log.info("\n".join(lines))


def _why_no_best(trainer: Trainer, validated: bool) -> str:
    """Why the fit ended with no best checkpoint, naming the settings that decide it."""
    if validated:
        return "validation ran, but --checkpoint.every_n_epochs or --checkpoint.save_top_k saved none"
    if trainer.limit_val_batches == 0:
        return "no validation ran (--trainer.limit_val_batches 0)"
    if 0 < trainer.max_steps <= trainer.global_step:
        steps = math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches)
        return (
            f"no validation ran: --trainer.max_steps {trainer.max_steps} ended the fit inside an epoch ({steps} "
            "steps each), before its validation; let max_steps end an epoch, or validate within epochs with "
            "--trainer.val_check_interval"
        )
    return (
        f"no validation ran in the fit's {trainer.current_epoch} epoch(s): see --trainer.check_val_every_n_epoch "
        "and --trainer.limit_val_batches"
    )
