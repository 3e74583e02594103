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
    "serving": "Serving",
    "peers": "Peers and gRPC",
    "model-server": "Model server",
    "batch": "Batch scoring",
    "web": "In the browser",
    "trust": "Calibration, prediction sets, unknown inputs",
    "tests": "The test suite",
}

INTRO = """\
Each section holds the current figure for one question, with the machine, the date and the command that measured
it. The reference machine is a shared 2-core x86-64 VM with no GPU; speeds are ratios taken side by side in
interleaved rounds, because such a machine drifts, and a rerun moves a ratio by several percent.

Every figure comes from `.venv/bin/python -m benchmarks.NAME` (the command under each table), which writes
`benchmarks/results/NAME.json`; `make report` renders those files into this page, the docs site's benchmark pages
and the README's results table. Earlier figures live in git's history of the results."""
