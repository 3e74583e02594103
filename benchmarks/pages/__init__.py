"""What the benchmark pages say around the figures: one section per question, the results it shows, and the
text a rerun does not change (the target, what is measured, how to set up). `benchmarks.report` renders these
with `benchmarks/results/*.json` into BENCHMARKS.md and the docs site's pages. Figures do not belong here: they
are in the results, with the notes each run wrote about them.
"""

from benchmarks.pages import readme, serving, training
from benchmarks.pages.outline import INTRO, PAGES, Part, Section

SECTIONS = training.SECTIONS + serving.SECTIONS  # BENCHMARKS.md orders them by page (PAGES)

__all__ = ["INTRO", "PAGES", "SECTIONS", "Part", "Section", "readme"]
