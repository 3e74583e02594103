"""Class imbalance: when a folder's classes are uneven enough to act on, and what `--data.balance auto` does then.

`resolve_balance` is the one place that decides: the data module reports its answer in `reports/data.json`, and
the model's loss (or the data module's sampler) follows it. The methods, all at training time only (inference
stays a plain argmax over the logits, so export and serving are untouched):

- `sampler`: class-balanced sampling, each class drawn equally often (`balanced_sampler`);
- `reweight`: the cross-entropy of each class weighted by its inverse frequency;
- `logit_adjusted`: the logit-adjusted loss of Menon et al. 2021 ("Long-tail learning via logit adjustment"),
  tau = 1: the cross-entropy of `logits + log prior`;
- `balanced_softmax`: Ren et al. 2020's softmax over `logits + log n_k`. With tau = 1 it is the same loss as
  `logit_adjusted` (a softmax ignores the constant `log N` between them); it is kept so the comparison can say so.

Shapes: B batch, K classes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import WeightedRandomSampler

AUTO_RATIO = 3.0  # `--data.balance auto` acts from this imbalance ratio (largest class over smallest) on
METHOD = "sampler"  # what `auto` does: chosen by measurement (benchmarks.long_tail, BENCHMARKS.md "A long tail")
BALANCE_CHOICES = ("auto", "none")
METHODS = ("sampler", "reweight", "logit_adjusted", "balanced_softmax")
LOSS_METHODS = METHODS[1:]  # the methods that change the loss; `sampler` changes what the loss sees


def imbalance_ratio(class_counts: list[int]) -> float:
    """The largest class's image count over the smallest's (inf when a class has none)."""
    smallest, largest = min(class_counts, default=0), max(class_counts, default=0)
    return float("inf") if smallest == 0 else largest / smallest


def resolve_balance(balance: str, class_counts: list[int]) -> str | None:
    """The method `balance` ("auto" or "none") applies to a training split of `class_counts`, or None.

    Raises:
        ValueError: `balance` is not one of `BALANCE_CHOICES`.
    """
    if balance not in BALANCE_CHOICES:
        raise ValueError(f"--data.balance must be one of {', '.join(BALANCE_CHOICES)}, got {balance!r}")
    if balance == "none" or len(class_counts) < 2 or imbalance_ratio(class_counts) < AUTO_RATIO:
        return None
    return METHOD


def balanced_sampler(labels: list[int], num_classes: int) -> WeightedRandomSampler:
    """Draws (with replacement) each class equally often, an epoch as long as the training set.

    It draws from the global random stream, as the plain shuffle does, so a resumed run draws as the
    uninterrupted one would (the checkpoint restores that stream).
    """
    counts = torch.bincount(torch.as_tensor(labels), minlength=num_classes).clamp(min=1)  # (K,)
    weights = (1.0 / counts.double())[torch.as_tensor(labels)]  # (N,) per image
    return WeightedRandomSampler(weights, num_samples=len(labels), replacement=True)


class BalancedLoss(nn.Module):
    """The cross-entropy of one of `LOSS_METHODS`, for hard labels (B,) or soft targets (B, K) (mixup, cutmix).

    Hard labels are smoothed by `label_smoothing` first (soft targets arrive smoothed by timm's `Mixup`), so every
    method sees the same (B, K) targets t and computes `mean_b sum_k w_k t_bk (-log softmax(z_b + a)_k)`: with
    `reweight`, w_k = N / (K n_k) (1 on average over the training images) and a = 0; otherwise w = 1 and a is
    `log(n_k / N)` (`logit_adjusted`) or `log n_k` (`balanced_softmax`).

    Args:
        class_counts: training images per class, index = class index (a class with none counts as one).
        method: one of `LOSS_METHODS`.
        label_smoothing: the smoothing applied to hard labels.
    """

    def __init__(self, class_counts: list[int], method: str, label_smoothing: float = 0.0):
        super().__init__()
        if method not in LOSS_METHODS:
            raise ValueError(f"balance method must be one of {', '.join(LOSS_METHODS)}, got {method!r}")
        counts = torch.as_tensor(class_counts, dtype=torch.float32).clamp(min=1)  # (K,)
        K, N = len(counts), counts.sum()
        weights, shift = torch.ones(K), torch.zeros(K)
        if method == "reweight":
            weights = N / (K * counts)
        elif method == "logit_adjusted":
            shift = (counts / N).log()  # tau = 1
        else:
            shift = counts.log()
        self.method, self.label_smoothing = method, label_smoothing
        self.register_buffer("weights", weights, persistent=False)  # from the data each run, not the checkpoint
        self.register_buffer("shift", shift, persistent=False)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Args:
            logits: (B, K).
            target: (B,) class indices or (B, K) target probabilities.

        Returns:
            The mean loss, a scalar.
        """
        B, K = logits.shape
        if target.ndim == 1:
            eps = self.label_smoothing
            target = nn.functional.one_hot(target, K).to(logits.dtype) * (1 - eps) + eps / K  # (B, K)
        log_p = (logits + self.shift).log_softmax(-1)  # (B, K)
        return -(target * self.weights * log_p).sum(-1).mean()
