"""The README's results table: one row per figure a newcomer asks about first, each read from a result's tables,
with the date it was measured and the command that measures it. `benchmarks.report --readme README.md` writes it
between the markers below."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

START, END = "<!-- results: written by `make report` from benchmarks/results/ -->", "<!-- /results -->"


def cell(result: dict, table: int, row: str, column: str):
    """The value in `column` of the row of table `table` whose first cells start with `row` (`a | b` for two)."""
    t = result["tables"][table]
    keys = row.split(" | ")
    found = next(r for r in t["rows"] if all(str(c).startswith(k) for c, k in zip(r, keys, strict=False)))
    return found[t["columns"].index(column)]


def pct(value) -> str:
    return f"{float(value) * 100:.2f} %"


@dataclass(frozen=True)
class Row:
    """A question, the result that answers it, how to read its figure, and the command (default: the result's)."""

    question: str
    result: str
    figure: Callable[[dict], str]
    command: str = ""


def _peers(r: dict) -> str:
    return f"{cell(r, 0, 'vit-serve HTTP multipart', 'vs LitServe'):.2f}x the req/s"


def _grpc(r: dict) -> str:
    ratios = [cell(r, t, "vit-serve gRPC", "req/s (median)") / cell(r, t, "vit-serve HTTP v2", "req/s (median)")
              for t in (0, 1)]  # fmt: skip
    return " / ".join(f"{x:.2f}x" for x in ratios) + " the req/s (beside LitServe / Ray Serve)"


def _soak(r: dict) -> str:
    done, failed, rss = (cell(r, 0, "", c) for c in ("rollouts done", "failed", "RSS MiB start / end / peak"))
    return f"{done} rollouts, {failed} failed requests, RSS start / end / peak {rss} MiB"


ROWS = (
    Row("the digits sample, held-out accuracy after 2.5 min of training", "sample_accuracy",
        lambda r: cell(r, 0, "val accuracy (top-1), best", "value").split(" of ")[0]),
    Row("Fashion-MNIST test accuracy after 25 min of CPU training", "fashion_mnist",
        lambda r: cell(r, 1, "last-epoch accuracy", "value")),
    Row("Fashion-MNIST's expected calibration error, as exported", "trust",
        lambda r: f"{pct(cell(r, 0, 'fmnist', 'ECE after'))}, from {pct(cell(r, 0, 'fmnist', 'ECE before'))}",
        "python -m benchmarks.trust --fmnist runs/fmnist"),
    Row("prediction sets at 0.90 / 0.95 coverage, Fashion-MNIST test set", "trust",
        lambda r: f"{pct(cell(r, 1, 'fmnist | lac | 0.9', 'coverage'))} / "
        f"{pct(cell(r, 1, 'fmnist | lac | 0.95', 'coverage'))} covered",
        "python -m benchmarks.trust --fmnist runs/fmnist"),
    Row("unknown inputs (digits, noise, photos) against Fashion-MNIST, AUROC", "trust",
        lambda r: " / ".join(f"{cell(r, 3, f'fmnist | {k}', 'AUROC Mahalanobis'):.3f}"
                             for k in ("digits", "noise", "photos")),
        "python -m benchmarks.trust --fmnist runs/fmnist"),
    Row("our ViT against timm's, same weights, ViT-S/16 inference at batch 32", "model_vs_timm",
        lambda r: f"{cell(r, 0, 'vit_small_patch16_224 | inference | 32', 'ours/timm').split()[0]}x as fast"),
    Row("the rollout map's maximum on the digit, cluttered canvases", "pointing_game",
        lambda r: f"{cell(r, 0, 'rollout (mean)', 'pointing game hit rate'):.0%} against "
        f"{cell(r, 0, 'random patch', 'pointing game hit rate'):.0%} at random"),
    Row("`vit-export --web` in Chromium against onnxruntime in Python, ViT-Ti/16", "web",
        lambda r: f"logits within {cell(r, 1, 'vit_tiny', 'largest logit difference'):.1e}, "
        f"{cell(r, 0, 'vit_tiny_patch16_224 |  | plain', 'browser / Python'):.1f}x the time per image"),
    Row("`vit-predict --out` against the model alone, ViT-Ti/16", "batch_bench",
        lambda r: f"{cell(r, 0, 'vit-predict', 'vs the model alone'):.2f}x the images/s"),
    Row("`vit-serve` against LitServe, the same file, multipart uploads at concurrency 16", "serve_peers", _peers),
    Row("`vit-serve` gRPC against HTTP v2, the same binary tensors, the servers on one core",
        "serve_peers_pinned", _grpc),
    Row("200 polled rollouts of a model repository under load at concurrency 16", "rollout_soak", _soak),
)  # fmt: skip


def render_into(text: str, results: dict[str, dict]) -> str:
    """`text` (the README) with the table between its markers rewritten from `results`."""
    if START not in text or END not in text:
        raise SystemExit(f"README has no results markers: put {START} and {END} around its results table")
    before, rest = text.split(START, 1)
    return before + START + "\n" + table(results) + "\n" + END + rest.split(END, 1)[1]


def table(results: dict[str, dict]) -> str:
    """The README's results table from `results` (name -> result); a row whose result is missing says so."""
    lines = ["| question | figure | command |", "|---|---|---|"]
    for row in ROWS:
        r = results.get(row.result)
        figure = f"{row.figure(r)} ({r['date'][:10]})" if r else "not measured yet"
        command = row.command or (r["command"] if r else f"python -m benchmarks.{row.result}")
        lines.append(f"| {row.question} | {figure} | `{command}` |")
    return "\n".join(lines)
