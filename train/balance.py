"""Class imbalance: when a folder's classes are uneven enough to act on, and what `--data.balance auto` does then.

`resolve_balance` is the one place that decides: the data module reports its answer in `reports/data.json`, and
the model's loss (or the data module's sampler) follows it.
"""

from __future__ import annotations

AUTO_RATIO = 3.0  # `--data.balance auto` acts from this imbalance ratio (largest class over smallest) on
METHOD = "logit_adjusted"  # what `auto` does: chosen by measurement (BENCHMARKS.md, "Imbalanced folders")
BALANCE_CHOICES = ("auto", "none")


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
