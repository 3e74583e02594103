"""The LightningModule: a `vit.VisionTransformer` trained as an image classifier.

AdamW (no weight decay on norms, biases, position embedding and tokens), cosine schedule with
linear warmup, optional layer-wise LR decay, optional EMA of the weights (validated and saved),
mixup/cutmix with soft-target cross-entropy, label smoothing, top-1/top-5 accuracy and a
confusion matrix written into the run directory.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from timm.data import Mixup
from timm.data.mixup import mixup_target
from timm.loss import SoftTargetCrossEntropy
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from timm.utils import ModelEmaV3
from torch import nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from serve.runtime.images import Preprocess
from train.checkpoint_format import META_KEY, RNG_KEY, check_class_names, rng_states, set_rng_states
from train.errors import first_line
from train.finite_checks import check_finite_loss, check_finite_weights
from train.reports import write_confusion_csv, write_confusion_png
from vit.model import VisionTransformer, create_model
from vit.timm_compat import from_timm


def build_network(
    num_classes: int,
    img_size: int,
    variant: str,
    net_args: dict[str, Any] | None,
    pretrained: str | None,
) -> VisionTransformer:
    """A named variant (fresh weights) or pretrained timm weights with a fresh head for `num_classes`."""
    overrides = {**(net_args or {}), "num_classes": num_classes, "img_size": img_size}
    if pretrained is None:
        return create_model(variant, **overrides)
    is_file = Path(pretrained).suffix in (".safetensors", ".pth", ".pt", ".bin")
    if is_file:
        try:
            return from_timm(pretrained, variant, **overrides)
        except (OSError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 (safetensors' and pickle's errors: not a weights file)
            raise ValueError(
                f"--model.pretrained {pretrained} is not a readable timm weights file ({first_line(e)}); give the "
                f".safetensors or .pth file of a timm {variant} model"
            ) from None
    return from_timm(pretrained, pretrained=True, **overrides)


class ViTClassifier(pl.LightningModule):
    """Image classifier around `vit.VisionTransformer`.

    Args:
        num_classes: number of classes (linked from the data module).
        img_size: input side in pixels (linked from the data module).
        variant: a `vit.VARIANTS` name: the architecture (and, with `pretrained`, the timm architecture
            of a local checkpoint file).
        net_args: `VisionTransformer` arguments that override the variant's (e.g. drop_path_rate).
        pretrained: start from timm weights: a timm model name (downloaded when the hub is reachable)
            or a local .safetensors/.pth/.bin file. The head is always fresh.
        lr: peak learning rate (after warmup).
        min_lr: learning rate at the end of the cosine schedule.
        weight_decay: AdamW weight decay (never on norms, biases, position embedding or tokens).
        betas: AdamW betas.
        warmup_epochs: linear warmup length, in epochs (fractions allowed).
        layer_decay: layer-wise LR decay (e.g. 0.75 for fine-tuning), by timm's `param_groups_layer_decay`: the
            head gets lr, block i (from 0) lr * decay^(depth - i), the embeddings lr * decay^(depth + 1).
        label_smoothing: label smoothing of the cross-entropy.
        mixup_alpha: mixup strength (0 disables mixup).
        cutmix_alpha: cutmix strength (0 disables cutmix).
        mix_prob: probability of mixing a batch when mixup or cutmix is on.
        ema_decay: keep an exponential moving average of the weights with this decay; it is what
            validation scores and the checkpoint exports. None disables it.
        channels_last: feed images in channels-last memory format (faster patch embedding on GPU).
        compile: run the network through `torch.compile`.
    """

    def __init__(
        self,
        num_classes: int = 1000,
        img_size: int = 224,
        variant: str = "vit_tiny_patch16_224",
        net_args: dict[str, Any] | None = None,
        pretrained: str | None = None,
        lr: float = 1.0e-3,
        min_lr: float = 1.0e-6,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_epochs: float = 5.0,
        layer_decay: float | None = None,
        label_smoothing: float = 0.1,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        mix_prob: float = 1.0,
        ema_decay: float | None = None,
        channels_last: bool = False,
        compile: bool = False,
    ):
        super().__init__()
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a positive number, got {lr}")
        if not (math.isfinite(min_lr) and 0 <= min_lr):
            raise ValueError(f"min_lr must be zero or a positive number, got {min_lr}")
        self.save_hyperparameters()
        self.net = build_network(num_classes, img_size, variant, net_args, pretrained)
        self.ema = ModelEmaV3(self.net, decay=ema_decay).requires_grad_(False) if ema_decay else None
        self.mixup = None
        if mixup_alpha > 0 or cutmix_alpha > 0:
            self.mixup = Mixup(
                mixup_alpha, cutmix_alpha, prob=mix_prob, label_smoothing=label_smoothing, num_classes=num_classes
            )
        self.train_loss = (
            SoftTargetCrossEntropy() if self.mixup else nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        )
        self.val_acc = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")
        self.val_confmat = MulticlassConfusionMatrix(num_classes)
        self.class_names = [str(i) for i in range(num_classes)]
        self._data_classes: list[str] | None = None  # the folder's classes, once a data module is attached
        self.preprocess: dict[str, Any] | None = None
        self.best_acc = -1.0
        self._compiled = None

    @property
    def eval_net(self) -> VisionTransformer:
        """The network that validation scores and the checkpoint exports: the EMA copy when there is one."""
        return self.ema.module if self.ema is not None else self.net

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.hparams.channels_last else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args:
            x: normalised images (B, 3, H, W).

        Returns:
            Logits (B, K) of the evaluated network.
        """
        return self.eval_net(self._inputs(x))

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if dm is not None and hasattr(dm, "classes"):
            self.class_names = list(dm.classes)
            self._data_classes = list(dm.classes)
            self.preprocess = dm.preprocess.to_dict()
        if self.hparams.channels_last:
            self.net.to(memory_format=torch.channels_last)
        if self.hparams.compile and self._compiled is None:
            # kept off the module tree, so the checkpoint holds the weights once, under "net."
            object.__setattr__(self, "_compiled", torch.compile(self.net))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, 3, H, W), (B,)
        if self.mixup is not None:
            x, y = self._mix(x, y)  # y becomes (B, K) soft targets
        logits = (self._compiled or self.net)(self._inputs(x))  # (B, K)
        loss = self.train_loss(logits, y)
        check_finite_loss(loss, self.trainer, self.hparams.lr)  # before backward: the weights stay finite
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _mix(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """timm's mixup/cutmix, which pairs images and so refuses an odd batch: an odd one (a training set smaller
        than one batch, or its last batch) mixes all but its last image, which keeps its own smoothed label."""
        if len(x) % 2 == 0:
            return self.mixup(x, y)
        last = mixup_target(y[-1:], self.mixup.num_classes, 1.0, self.mixup.label_smoothing)  # (1, K)
        if len(x) == 1:
            return x, last
        mixed, soft = self.mixup(x[:-1], y[:-1])
        return torch.cat([mixed, x[-1:]]), torch.cat([soft, last])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is not None:
            self.ema.update(self.net, step=self.global_step)

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> None:
        x, y = batch
        logits = self(x)  # (B, K)
        self.log(f"{prefix}/loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.val_acc5(logits, y)
        self.val_confmat(logits, y)
        self.log(f"{prefix}/acc", self.val_acc, prog_bar=True)
        self.log(f"{prefix}/acc5", self.val_acc5)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).softmax(-1)  # (B, K) probabilities

    def _epoch_report(self) -> None:
        confmat = self.val_confmat.compute().cpu().numpy()  # (K, K), summed over ranks
        self.val_confmat.reset()
        if self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        acc = float(np.trace(confmat) / max(confmat.sum(), 1))
        fitting = self.trainer.state.fn == "fit"
        if fitting and acc <= self.best_acc:
            return
        self.best_acc = max(self.best_acc, acc)
        reports = Path(self.trainer.default_root_dir) / "reports"
        write_confusion_csv(confmat, self.class_names, reports)
        self._confmat = (confmat, f"epoch {self.current_epoch}: accuracy {acc:.4f}")
        if not fitting:
            write_confusion_png(confmat, self.class_names, reports / "confusion_matrix.png", self._confmat[1])

    def on_validation_epoch_end(self) -> None:
        self._epoch_report()

    def on_test_epoch_end(self) -> None:
        self._epoch_report()

    def on_fit_end(self) -> None:
        if self.trainer.is_global_zero and getattr(self, "_confmat", None) is not None:
            confmat, title = self._confmat
            reports = Path(self.trainer.default_root_dir) / "reports"
            write_confusion_png(confmat, self.class_names, reports / "confusion_matrix.png", "best " + title)

    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW groups from timm: no decay on 1-d parameters and tokens; with `layer_decay`, each layer's
        LR scaled by decay^(distance from the head), read from the network's `group_matcher`."""
        hp, net = self.hparams, self.net
        skip = net.no_weight_decay()
        if hp.layer_decay:
            groups = param_groups_layer_decay(
                net, weight_decay=hp.weight_decay, no_weight_decay_list=skip, layer_decay=hp.layer_decay
            )
        else:
            groups = param_groups_weight_decay(net, weight_decay=hp.weight_decay, no_weight_decay_list=skip)
        for g in groups:
            g["lr"] = hp.lr * g.setdefault("lr_scale", 1.0)
        return groups

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        opt = torch.optim.AdamW(self.param_groups(), lr=hp.lr, betas=tuple(hp.betas))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        epochs = max(1, self.trainer.max_epochs or 1)
        warmup = min(int(hp.warmup_epochs * total / epochs), total - 1)
        floor = hp.min_lr / hp.lr

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            t = (step - warmup) / max(1, total - warmup)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the RNG states, and the plain-data entry `train.checkpoint_format.load_network` rebuilds the net from.

        Raises:
            TrainingError: a weight is NaN or infinite; such a model is never saved.
        """
        import lightning
        import timm

        check_finite_weights(self, self.hparams.lr)
        checkpoint[RNG_KEY] = rng_states()  # so a resumed run shuffles and augments as the uninterrupted one
        checkpoint[META_KEY] = {
            "model_config": dict(self.net.config),
            "class_names": list(self.class_names),
            "preprocess": self.preprocess or Preprocess(self.hparams.img_size).to_dict(),
            "weights_prefix": "ema.module." if self.ema is not None else "net.",
            "variant": self.hparams.variant,
            "best_val_acc": self.best_acc,  # so a resumed run keeps the best reports, not the next epoch's
            "versions": {
                "torch": str(torch.__version__),
                "lightning": str(lightning.__version__),
                "timm": str(timm.__version__),
            },
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        meta = checkpoint.get(META_KEY)
        self.class_names = check_class_names(meta, self._data_classes)
        self.preprocess = meta.get("preprocess", self.preprocess)
        self.best_acc = float(meta.get("best_val_acc", self.best_acc))
        if RNG_KEY in checkpoint and self._trainer is not None and self._trainer.state.fn == "fit":
            set_rng_states(checkpoint[RNG_KEY])
