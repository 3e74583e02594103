"""The benchmark pages from the results: the figures in the docs site's pages, BENCHMARKS.md and the README's
results table. `make report` (`python -m benchmarks.report`) writes them all; a test fails when any differs from
what this renders, so no figure is edited by hand.

- `docs/benchmarks/PAGE.md` is written by hand around its figures: each result goes between
  `<!-- result: NAME -->` and `<!-- /result -->`, where its tables, notes and provenance (date, machine,
  versions, the command that reproduces them) are rendered from `benchmarks/results/NAME.json`.
- `docs/benchmarks/index.md` gets its table of pages and their questions (the `## ` headings), in the order of
  the site's navigation, between `<!-- pages -->` and `<!-- /pages -->`.
- BENCHMARKS.md is the index's introduction, then every page's sections.
- README.md gets `ROWS` between its results markers: one row per figure a newcomer asks about first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.common import RESULTS, Table

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
RESULT = re.compile(r"<!-- result: (\w+) -->\n.*?<!-- /result -->", re.S)
PAGES_START, PAGES_END = "<!-- pages -->", "<!-- /pages -->"
README_START, README_END = "<!-- results: written by `make report` from benchmarks/results/ -->", "<!-- /results -->"


def provenance(result: dict) -> str:
    """`Measured DATE on MACHINE (load L); VERSIONS. Setting: ...` and the command that reproduces the figures."""
    load = f" (load {result['load_average']})" if result.get("load_average") is not None else ""
    libs = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
    setting = ", ".join(f"{k} {v}" for k, v in result.get("setting", {}).items())
    where = f"Measured {result['date'][:10]} on {result['machine']}{load}" + (f"; {libs}" if libs else "") + "."
    return where + (f" Setting: {setting}." if setting else "") + f" Reproduce: `{result['command']}`"


def block(result: dict) -> str:
    """One result's markdown: its tables, what its run noted, and its provenance."""
    tables = [Table.from_dict(t).markdown() for t in result.get("tables", [])]
    return "\n\n".join([*tables, *result.get("notes", []), provenance(result)])


def every_result(folder: Path = RESULTS) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def nav() -> dict[str, str]:
    """The benchmark pages in the site's navigation: file name -> title (the index first)."""
    entries = next(e for e in yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"] if "Benchmarks" in e)
    pages = [e if isinstance(e, dict) else {"Benchmarks": e} for e in entries["Benchmarks"]]
    return {Path(path).name: title for page in pages for title, path in page.items()}


def fill(text: str, results: dict[str, dict]) -> str:
    """A page with the block of each of its results rewritten between the result's markers."""

    def one(match: re.Match) -> str:
        name = match.group(1)
        found = results.get(name)
        body = block(found) if found else f"Not measured yet: no `benchmarks/results/{name}.json`."
        return f"<!-- result: {name} -->\n{body}\n<!-- /result -->"

    return RESULT.sub(one, text)


def between(text: str, start: str, end: str, inside: str) -> str:
    """`text` with what lies between its markers `start` and `end` replaced by `inside`."""
    if start not in text or end not in text:
        raise SystemExit(f"no {start} ... {end} markers to write between")
    before, rest = text.split(start, 1)
    return f"{before}{start}\n{inside}\n{end}{rest.split(end, 1)[1]}"


def render(results: dict[str, dict], docs: Path = DOCS) -> dict[Path, str]:
    """Every file this writes -> its text: the docs pages, their index, BENCHMARKS.md and README.md."""
    titles = nav()
    pages = {name: fill((docs / name).read_text(), results) for name in titles if name != "index.md"}
    questions = {name: "; ".join(re.findall(r"^## (.+)$", text, re.M)) for name, text in pages.items()}
    table = "| page | the questions |\n|---|---|\n" + "\n".join(
        f"| [{titles[name]}]({name}) | {q} |" for name, q in questions.items()
    )
    index = between((docs / "index.md").read_text(), PAGES_START, PAGES_END, table)
    # BENCHMARKS.md: the index's introduction, then each page without its title and the result markers
    bodies = [re.sub(r"^<!-- /?result.*-->\n", "", text.split("\n", 1)[1], flags=re.M) for text in pages.values()]
    whole = "\n\n".join([index.split(PAGES_START)[0].strip(), *(b.strip() for b in bodies)]) + "\n"
    readme = ROOT / "README.md"
    return {
        **{docs / name: text for name, text in pages.items()},
        docs / "index.md": index,
        ROOT / "BENCHMARKS.md": whole,
        readme: between(readme.read_text(), README_START, README_END, readme_table(results)),
    }


# --- the README's results table ----------------------------------------------------------------------------


def cell(result: dict, table: int, row: str, column: str):
    """The value in `column` of the row of table `table` whose first cells start with `row` (`a | b` for two)."""
    t = result["tables"][table]
    keys = row.split(" | ")
    found = next(r for r in t["rows"] if all(str(c).startswith(k) for c, k in zip(r, keys, strict=False)))
    return found[t["columns"].index(column)]


def one_view(fmnist: dict) -> str:
    """What the Fashion-MNIST model scores without its flip test-time augmentation, when it has it."""
    rows = [r for r in fmnist["tables"][1]["rows"] if str(r[0]).startswith("best.ckpt on each test image alone")]
    return f"; each image with its mirror (one view: {rows[0][1]})" if rows else ""


def worst_side(trust: dict) -> float:
    """The Fashion-MNIST model's lowest Mahalanobis AUROC over the crop sides of the other photos."""
    t = trust["tables"][3]
    col = t["columns"].index("AUROC Mahalanobis")
    return min(r[col] for r in t["rows"] if r[0] == "fmnist" and str(r[1]).startswith("other photos"))


def pct(value) -> str:
    return f"{float(value) * 100:.2f} %"


@dataclass(frozen=True)
class Row:
    """A question, the result that answers it, how to read its figure, and the command (default: the result's)."""

    question: str
    result: str
    figure: Callable[[dict], str]
    command: str = ""


def _grpc(r: dict) -> str:
    ratios = [cell(r, t, "vit-serve gRPC", "req/s (median)") / cell(r, t, "vit-serve HTTP v2", "req/s (median)")
              for t in (0, 1)]  # fmt: skip
    return " / ".join(f"{x:.2f}x" for x in ratios) + " the req/s (beside LitServe / Ray Serve)"


def _soak(r: dict) -> str:
    done, failed, rss = (cell(r, 0, "", c) for c in ("rollouts done", "failed", "RSS MiB start / end / peak"))
    return f"{done} rollouts, {failed} failed requests, RSS start / end / peak {rss} MiB"


def _long_tail(r: dict) -> str:
    t = r["tables"][0]
    epochs = max(e for m, e, *_ in t["rows"] if m == "none" and any(n != "none" and f == e for n, f, *_ in t["rows"]))
    best = max((row for row in t["rows"] if row[1] == epochs and row[0] != "none"), key=lambda row: row[2])
    none = cell(r, 0, f"none | {epochs}", "balanced accuracy")
    return f"{pct(best[2])} ({best[0]}) against {pct(none)}, {epochs} epochs each"


def _label_noise(r: dict) -> str:
    p, rec, pp, pr = (cell(r, 0, m, c) for m in ("label_issues.csv", "plain rule") for c in ("precision", "recall"))
    return f"{p:.2f} / {rec:.2f} (a plain 0.1 threshold: {pp:.2f} / {pr:.2f})"


def _copies(r: dict) -> str:
    found = " / ".join(f"{cell(r, 0, kind, 'found'):.1%}" for kind in ("byte copy", "JPEG at another size"))
    return f"{found}, {cell(r, 1, 'groups in two splits', 'value')} groups across splits"


TRUST = "python -m benchmarks.trust --fmnist runs/fmnist-bench"
ROWS = (
    Row("the digits sample: held-out accuracy, and the time of the whole `vit-train fit` command, progress bar off",
        "sample_accuracy",
        lambda r: f"{cell(r, 0, 'val accuracy (top-1), best', 'value').split(' of ')[0]} in "
        f"{cell(r, 0, 'command wall time', 'value')}"),
    Row("Fashion-MNIST's official test set, `configs/small_images.yaml` on CPU: accuracy and training time",
        "fashion_mnist", lambda r: f"{cell(r, 0, 'vitscope', 'Fashion-MNIST test accuracy').strip('*')} after "
        f"{cell(r, 1, 'fit time', 'value')}{one_view(r)}"),
    Row("Fashion-MNIST's expected calibration error, as exported", "trust",
        lambda r: f"{pct(cell(r, 0, 'fmnist', 'ECE after'))}, from {pct(cell(r, 0, 'fmnist', 'ECE before'))}", TRUST),
    Row("prediction sets at 0.90 / 0.95 coverage, Fashion-MNIST test set", "trust",
        lambda r: f"{pct(cell(r, 1, 'fmnist | lac', 'coverage at 0.90'))} / "
        f"{pct(cell(r, 1, 'fmnist | lac', 'coverage at 0.95'))} covered", TRUST),
    Row("unknown inputs (digits, noise, photos; other photos cropped at 28-224 px, the worst side) against "
        "Fashion-MNIST, AUROC", "trust",
        lambda r: " / ".join(f"{cell(r, 3, f'fmnist | {k}', 'AUROC Mahalanobis'):.3f}"
                             for k in ("digits", "noise", "photos")) + f" / {worst_side(r):.3f}", TRUST),
    Row("our ViT against timm's, same weights, ViT-S/16 inference at batch 32", "model_vs_timm",
        lambda r: f"{cell(r, 0, 'vit_small_patch16_224 | inference | 32', 'ours/timm').split()[0]}x as fast"),
    Row("the rollout map's maximum on the digit, cluttered canvases", "pointing_game",
        lambda r: f"{cell(r, 0, 'rollout (mean)', 'pointing game hit rate'):.0%} against "
        f"{cell(r, 0, 'centre patch', 'pointing game hit rate'):.0%} for the centre patch and "
        f"{cell(r, 0, 'random patch', 'pointing game hit rate'):.0%} at random"),
    Row("`vit-export --web` in Chromium against onnxruntime in Python, ViT-Ti/16", "web",
        lambda r: f"logits within {cell(r, 1, 'vit_tiny', 'largest logit difference'):.1e}, "
        f"{cell(r, 0, 'vit_tiny_patch16_224 |  | plain', 'browser / Python'):.1f}x the time per image"),
    Row("`vit-predict --out` against the model alone, ViT-Ti/16", "batch_bench",
        lambda r: f"{cell(r, 0, 'vit-predict', 'vs the model alone'):.2f}x the images/s"),
    Row("`vit-serve` against LitServe, the same file, multipart uploads at concurrency 16", "serve_peers",
        lambda r: f"{cell(r, 0, 'vit-serve HTTP multipart', 'vs LitServe'):.2f}x the req/s"),
    Row("`vit-serve` gRPC against HTTP v2, the same binary tensors, the servers on one core",
        "serve_peers_pinned", _grpc),
    Row("a long tail (Fashion-MNIST at imbalance ratio 100): balanced test accuracy, `--data.balance auto` "
        "against `none`", "long_tail", _long_tail, "python -m benchmarks.long_tail --epochs 8 --methods none,sampler"),
    Row("wrong labels (10 % of 20,000 Fashion-MNIST images): `label_issues.csv` precision / recall",
        "label_noise", _label_noise),
    Row("copies planted among 10,000 Fashion-MNIST images: byte copies / JPEG at another size found",
        "duplicates", _copies),
    Row("200 polled rollouts of a model repository under load at concurrency 16", "rollout_soak", _soak),
)  # fmt: skip


def readme_table(results: dict[str, dict]) -> str:
    """The README's results table from `results` (name -> result); a row whose result is missing says so."""
    lines = ["| question | figure | command |", "|---|---|---|"]
    for row in ROWS:
        r = results.get(row.result)
        figure = f"{row.figure(r)} ({r['date'][:10]})" if r else "not measured yet"
        command = row.command or (r["command"] if r else f"python -m benchmarks.{row.result}")
        lines.append(f"| {row.question} | {figure} | `{command}` |")
    return "\n".join(lines)


def main() -> None:
    for path, text in render(every_result()).items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"rewrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
