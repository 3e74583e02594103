"""The LightningModule: a `vit.VisionTransformer` trained as an image classifier.

AdamW (no weight decay on norms, biases, position embedding and tokens), cosine schedule with
linear warmup, optional layer-wise LR decay, optional EMA of the weights (validated and saved),
mixup/cutmix with soft-target cross-entropy, label smoothing, a loss for imbalanced classes (`train.balance`),
top-1/top-5 accuracy, balanced accuracy and macro F1, and the best epoch's confusion matrix and per-class
precision and recall written into the run directory.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from timm.data import Mixup
from timm.data.mixup import mixup_target
from timm.loss import SoftTargetCrossEntropy
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from timm.utils import ModelEmaV3
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
    MulticlassRecall,
)

from serve.runtime.images import Preprocess
from train.balance import LOSS_METHODS, BalancedLoss
from train.checkpoint_format import META_KEY, RNG_KEY, check_checkpoint_fits, resume_states, rng_states
from train.distill import distillation_loss, load_teacher, student_net_args
from train.errors import first_line
from train.finite_checks import check_finite_loss, check_finite_weights
from train.options import WEIGHTS_SUFFIXES, check_balance, check_model_options, check_net_args, check_pretrained
from train.reports import write_confusion_csv, write_confusion_png, write_per_class_csv
from vit.model import VisionTransformer, create_model
from vit.timm_compat import from_timm

log = logging.getLogger(__name__)


def compile_blocker(device_type: str) -> str | None:
    """Why `torch.compile` cannot run on this device type, or None: on CPU it writes C++ kernels that `$CXX`
    (g++ unless set) must build, and a slim image often has no compiler."""
    if device_type != "cpu":
        return None
    cxx = os.environ.get("CXX", "g++")
    return None if shutil.which(cxx) else f"no C++ compiler ({cxx!r} is not on PATH: install g++ or set CXX)"


def build_network(
    num_classes: int,
    img_size: int,
    variant: str,
    net_args: dict[str, Any] | None,
    pretrained: str | None,
) -> VisionTransformer:
    """A named variant (fresh weights) or pretrained timm weights with a fresh head for `num_classes`."""
    check_net_args(net_args, img_size, num_classes, variant, pretrained)
    overrides = {**(net_args or {}), "num_classes": num_classes, "img_size": img_size}
    if pretrained is None:
        return create_model(variant, **overrides)
    check_pretrained(pretrained)
    if Path(pretrained).suffix in WEIGHTS_SUFFIXES:
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
        class_counts: training images per class (linked from the data module): what a balancing loss weighs by.
        balance: how training counters class imbalance, one of `train.balance.METHODS` or None (linked from the
            data module's `--data.balance`, which chooses it). The loss methods act here; `sampler` is the data
            module's. Inference is unchanged: a plain argmax over the logits.
        teacher: distil from this trained run (its `best.ckpt`): the network gets a distillation token and a
            second head that learns the teacher's top class on every augmented batch (DeiT's hard distillation,
            Touvron et al. 2021). The teacher must have the same classes and preprocessing. It is not saved: the
            checkpoint and the ONNX file hold the student alone, which answers with the mean of its two heads.
        distill_weight: the distillation head's share of the loss (DeiT: 0.5); the class head has the rest.
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
        class_counts: list[int] | None = None,
        balance: str | None = None,
        teacher: str | None = None,
        distill_weight: float = 0.5,
    ):
        """Check the arguments (above) and build the parts. It reads better whole: its length is the signature, one
        argument a line as LightningCLI lists them, and the body builds the parts in the order training uses them."""
        super().__init__()
        check_model_options(
            lr, min_lr, tuple(betas), ema_decay=ema_decay or 0.0, label_smoothing=label_smoothing, mix_prob=mix_prob,
            distill_weight=distill_weight, weight_decay=weight_decay, mixup_alpha=mixup_alpha,
            cutmix_alpha=cutmix_alpha, warmup_epochs=warmup_epochs, layer_decay=layer_decay or 0.0,
        )  # fmt: skip
        check_balance(balance, class_counts, num_classes)
        self.save_hyperparameters()
        net_args = student_net_args(net_args, teacher, distill_weight)
        self.net = build_network(num_classes, img_size, variant, net_args, pretrained)
        self.net.distilled_training = teacher is not None
        self.ema = ModelEmaV3(self.net, decay=ema_decay).requires_grad_(False) if ema_decay else None
        self.mixup = None
        if mixup_alpha > 0 or cutmix_alpha > 0:
            self.mixup = Mixup(
                mixup_alpha, cutmix_alpha, prob=mix_prob, label_smoothing=label_smoothing, num_classes=num_classes
            )
        if balance in LOSS_METHODS:
            self.train_loss = BalancedLoss(class_counts, balance, label_smoothing)
        elif self.mixup:
            self.train_loss = SoftTargetCrossEntropy()
        else:
            self.train_loss = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.val_acc = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_bacc = MulticlassRecall(num_classes, average="macro")  # balanced accuracy: mean per-class recall
        self.val_f1 = MulticlassF1Score(num_classes, average="macro")
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")
        self.val_confmat = MulticlassConfusionMatrix(num_classes)
        self.class_names = [str(i) for i in range(num_classes)]
        self._data_classes: list[str] | None = None  # the folder's classes, once a data module is attached
        self.preprocess: dict[str, Any] | None = None
        self.best_score = -1.0  # the selection metric's best value (`selection_metric`)
        self.best_scores: dict[str, float] = {}  # every validation score of that epoch
        self._compiled = None
        self._teacher: nn.Module | None = None  # loaded in `setup`, off the module tree: never saved

    @property
    def eval_net(self) -> VisionTransformer:
        """The network that validation scores and the checkpoint exports: the EMA copy when there is one."""
        return self.ema.module if self.ema is not None else self.net

    @property
    def train_net(self) -> nn.Module:
        """The network a training step runs: the `torch.compile`d one with `compile`. (Not `compiled or net`: a
        compiled module has no truth value, and `or` asks for its length, which it refuses.)"""
        return self._compiled if self._compiled is not None else self.net

    def _train_logits(self, x: torch.Tensor) -> torch.Tensor:
        """`train_net(x)`; a compile that fails (at the first step, or a recompile for a new batch size) is
        logged and training goes on eager, rather than the run failing over an optional speed-up."""
        try:
            return self.train_net(x)
        except BackendCompilerFailed as e:  # its own first line only names the backend: say what failed inside
            why = f"{type(e.inner_exception).__name__}: {first_line(e.inner_exception)}"
            log.warning("--model.compile failed, training goes on eager: %s", why)
            object.__setattr__(self, "_compiled", None)
            return self.net(x)

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
        if stage == "fit" and self.hparams.teacher is not None and self._teacher is None:
            object.__setattr__(
                self, "_teacher", load_teacher(self.hparams.teacher, self._data_classes, self.preprocess)
            )
        if stage == "fit" and self.hparams.compile and self._compiled is None:  # validation runs eval_net, eager
            blocker = compile_blocker(self.trainer.strategy.root_device.type)
            if blocker is not None:
                log.warning("--model.compile: %s; training runs eager", blocker)
            else:  # kept off the module tree, so the checkpoint holds the weights once, under "net."
                object.__setattr__(self, "_compiled", torch.compile(self.net))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, 3, H, W), (B,)
        if self.mixup is not None:
            x, y = self._mix(x, y)  # y becomes (B, K) soft targets
        logits = self._train_logits(self._inputs(x))  # (B, K)
        if self._teacher is not None:
            w = self.hparams.distill_weight
            loss = distillation_loss(self._teacher, self._inputs(x), logits, y, self.train_loss, w)
        else:
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
        self.val_bacc(logits, y)
        self.val_f1(logits, y)
        self.val_confmat(logits, y)
        self.log(f"{prefix}/acc", self.val_acc, prog_bar=True)
        self.log(f"{prefix}/acc5", self.val_acc5)
        self.log(f"{prefix}/balanced_acc", self.val_bacc, prog_bar=True)
        self.log(f"{prefix}/macro_f1", self.val_f1)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).softmax(-1)  # (B, K) probabilities

    @property
    def selection_metric(self) -> str:
        """What picks the best epoch: the best checkpoint's monitor when it is one of ours, else balanced accuracy.

        The reports of the best epoch follow the same metric as `best.ckpt`, so they describe that checkpoint.
        """
        ckpt = self.trainer.checkpoint_callback if self._trainer is not None else None
        name = (getattr(ckpt, "monitor", None) or "").removeprefix("val/")
        ours = name in ("acc", "balanced_acc", "macro_f1") and getattr(ckpt, "mode", "max") == "max"
        return name if ours else "balanced_acc"

    def _epoch_report(self) -> None:
        confmat = self.val_confmat.compute().cpu().numpy()  # (K, K), summed over ranks
        self.val_confmat.reset()
        # computed on every rank (a DDP sync); Lightning reuses these values when it logs them
        scores = {"acc": self.val_acc, "balanced_acc": self.val_bacc, "macro_f1": self.val_f1}
        scores = {k: float(m.compute()) for k, m in scores.items()}
        if self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        metric = self.selection_metric
        fitting = self.trainer.state.fn == "fit"
        if fitting and scores[metric] <= self.best_score:
            return
        self.best_score, self.best_scores = max(self.best_score, scores[metric]), scores
        reports = Path(self.trainer.default_root_dir) / "reports"
        write_confusion_csv(confmat, self.class_names, reports)
        write_per_class_csv(confmat, self.class_names, reports)
        title = f"epoch {self.current_epoch}: balanced accuracy {scores['balanced_acc']:.4f}"
        title += f", accuracy {scores['acc']:.4f}"
        self._confmat = (confmat, title)
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
            # so a resumed run keeps the best reports, not the next epoch's
            "best_val": {"metric": self.selection_metric, "score": self.best_score, "scores": self.best_scores},
            "versions": {
                "torch": str(torch.__version__),
                "lightning": str(lightning.__version__),
                "timm": str(timm.__version__),
            },
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        meta = checkpoint.get(META_KEY)
        self.class_names = check_checkpoint_fits(meta, self._data_classes, self.net.config, self.preprocess)
        self.preprocess = meta.get("preprocess", self.preprocess)
        best = meta.get("best_val") or {}
        if best.get("metric") == self.selection_metric:  # a best score by another metric is no benchmark for this one
            self.best_score, self.best_scores = float(best["score"]), dict(best.get("scores") or {})
        if self._trainer is not None and self._trainer.state.fn == "fit":  # a resume: its optimizer, its RNG states
            resume_states(checkpoint, len(self.param_groups()))
