"""The pages' outline: a section per question, the results it shows, and the docs page it is on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """One result in a section, under a heading of its own when `title` is given."""

    result: str
    title: str = ""
    text: str = ""


@dataclass(frozen=True)
class Section:
    """One question: a heading (README and the docs link to its anchor), its docs page, text, and its results."""

    title: str
    page: str
    text: str = ""
    parts: tuple[Part, ...] = ()


# The docs pages (docs/benchmarks/PAGE.md): name -> title, in the order of the site's navigation.
PAGES = {
    "model": "Model and training",
    "export": "Export and install",
    "serving": "Serving",
    "peers": "Peers, gRPC and payload logs",
    "model-server": "Model server",
    "batch": "Batch scoring",
    "web": "In the browser",
    "trust": "Calibration, prediction sets, unknown inputs",
    "tests": "The test suite",
}

INTRO = """\
Each section holds the current figure for one question, with the machine, the date and the command that measured
it. The reference machine is a shared 2-core x86-64 VM with no GPU (each figure names the CPU it ran on). Speeds
are ratios taken side by side in one run, in interleaved rounds, because such a machine is noisy: absolute numbers
will differ on yours, and a rerun here moves a ratio by several percent.

Every figure comes from a script under `benchmarks/`, run from the repository root as
`.venv/bin/python -m benchmarks.NAME` (the command under each table; `make bench` runs the main ones one after
another). Each writes `benchmarks/results/NAME.json`, and `make report` renders those files, with the text in
`benchmarks/pages/`, into BENCHMARKS.md and the docs site's benchmark pages. Neither page is edited by hand
(a test compares them with what the results render), and earlier figures live in git's history of the results."""
