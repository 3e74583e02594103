"""The review page: one list at a time, one image at a time, and three decisions (keep, relabel, leave out).

`build_review_app(run)` lays out a `gr.Blocks` in the serving UI's style (`serve/server/ui/blocks.py`): a table
of the chosen list (click a row to look at it), the image as the model sees it, its attention-rollout overlay and
calibrated probabilities, and the buttons. A decision is written to `RUN_DIR/corrections.csv` before the page
moves on to the next image; the table's "decision" column, read back from that file, shows every earlier one,
also after a reload or a restart.
"""

from __future__ import annotations

import html
import os
import re
import shlex
from pathlib import Path

import gradio as gr

from serve.runtime.images import FILE_NAME_ERRORS, ImageError
from train.review_data import LISTS, Item, ReviewRun
from train.review_store import CORRECTIONS_FILE, Decisions

HEADERS = ["#", "image", "given", "suggested", "score", "why", "decision"]
# The page takes no upload, yet Gradio's upload route accepts small ones (train.review.MAX_UPLOAD) into its shared
# temp folder: they, and the images the page shows, go after this many seconds (checked as often) and at exit.
CACHE_S = 600


def visible(text: str) -> str:
    """`text` as the page can send it: the bytes of a file name that are not UTF-8 written out (`caf\\xe9.png`).

    Paths are read with `FILE_NAME_ERRORS` (surrogateescape), so the server keeps, opens and writes an image's real
    name; what goes to the browser is JSON, which must be UTF-8, and a surrogate in it fails the whole answer.
    """
    try:
        raw = text.encode("utf-8", FILE_NAME_ERRORS)
    except UnicodeEncodeError:  # a surrogate that no file name decoding made
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def code(text: str) -> str:
    """`text` as a Markdown code span, whatever backticks it holds: a file name's markup is shown, never rendered."""
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    return f"{fence} {text} {fence}"


def plain(text: str) -> str:
    """`text` (a class name, a reason) as Markdown shows it: its HTML and emphasis marks as written."""
    return re.sub(r"([\\`*_\[\]])", r"\\\1", html.escape(text, quote=False))


def refused(message: str) -> gr.Error:
    """What the page says to a click or load it refuses; Gradio prints no traceback of it to the console."""
    return gr.Error(visible(message), print_exception=False)


class ReviewActions:
    """The page's callbacks: each takes the widgets' values and returns theirs."""

    def __init__(self, run: ReviewRun):
        self.run = run
        # read by fit's rules: a file fit would refuse is refused now, not written back
        self.decisions = Decisions(run.run_dir / CORRECTIONS_FILE, run.data_root, run.labels, run.trained_with)
        roots = {str(Path(p).parent.parent) for p in run.given}  # <root>/<class>/<image>: paths shown from the root
        self.root = os.path.commonpath(list(roots)) if roots else ""

    def shown_path(self, path: str) -> str:
        """`path` as the page shows it: from the data root, its undecodable bytes written out (`visible`)."""
        return visible(os.path.relpath(path, self.root) if self.root and path.startswith(self.root + os.sep) else path)

    def decision_text(self, item: Item) -> str:
        decided, label = self.decisions.get(item.path)
        if not decided:
            return ""
        if label is None:
            return "left out"
        return "kept" if label == item.given else f"relabelled {label}"

    def items(self, which: str) -> list[Item]:
        """The images of list `which`; a name that is no list's (sent to the page's API by hand) is refused."""
        if not (isinstance(which, str) and which in self.run.lists):
            raise refused(f"pick one of the lists: {', '.join(self.run.lists)}")
        return self.run.lists[which]

    def rows(self, which: str) -> list[list]:
        return [
            [i + 1, self.shown_path(it.path), visible(it.given), visible(it.suggested or ""), round(it.score, 4),
             visible(it.why), visible(self.decision_text(it))]
            for i, it in enumerate(self.items(which))
        ]  # fmt: skip

    def show(self, which: str, index: int):
        """The widgets of image `index` of list `which`: image, overlay, probabilities, about, relabel choice, what is
        shown ((list, index): the image a decision is for; index -1: none, past the list's end) and its path as the
        page holds it (a click sends it back: `decide` checks that it is still the image shown)."""
        items = self.items(which)
        if not items or int(index) >= len(items):
            said = self.run.missing.get(which, "nothing to look at in this run") if not items else (
                "the end of the list: every image of it has been seen. Pick one in the table to change its decision"
            )  # fmt: skip
            return None, None, None, f"**{which}**: {said}.", gr.update(value=None), (which, -1), ""
        index = max(int(index), 0)
        item = items[index]
        suggested = plain(item.suggested) if item.suggested else "(none)"
        about = [
            f"**{which}**, {index + 1} of {len(items)}: {code(self.shown_path(item.path))}",
            f"Given label **{plain(item.given)}**; suggested **{suggested}**; {plain(item.why)}.",
        ]
        try:
            pixels, probs, overlay = self.run.explain(item.path)
        except (ImageError, OSError) as e:  # moved or deleted since the run: it can still be decided (left out)
            pixels = probs = overlay = None
            why = plain(str(e))
            about.append(f"**Cannot read it** ({why}): moved or deleted since the run? Leave it out, or put it back.")
        earlier = self.decision_text(item)
        about.append(f"Decision: **{plain(earlier)}**" if earlier else "Not decided yet.")
        choice = item.suggested if item.suggested in self.run.labels else item.given
        text, at = visible("\n\n".join(about)), (which, index)
        return pixels, overlay, probs, text, gr.update(value=choice), at, self.shown_path(item.path)

    def load(self, which: str):
        """A page (re)load: the table from the decisions file, read again (another review of the run may have
        written it since), and the list's first image."""
        try:
            self.decisions.reload()
        except (ValueError, OSError) as e:
            raise refused(f"cannot read the decisions: {e}") from None
        return self.rows(which), *self.show(which, 0)

    def pick(self, which: str, evt: gr.SelectData):
        """The image of the table row clicked. An index that is no row's (5, None, ["x", 0], [NaN, 0]: a select event
        sent to the page's API by hand) is refused as a click on no image: it ended in a traceback on the console."""
        index = getattr(evt, "index", None)
        row = index[0] if isinstance(index, list | tuple) and index else None
        whole = isinstance(row, float) and row.is_integer() or isinstance(row, int) and not isinstance(row, bool)
        if not whole or row < 0:
            raise refused("pick an image in the table")
        return self.show(which, int(row))

    def decide(self, which: str, index: int, action: str, label: str | None, seen: str | None = None):
        """Record one decision for image `index` of list `which`, then move on to the next image; returns the table,
        the next image and a status. `seen`: the path the page showed when the click was made (None: not checked)."""
        items = self.items(which)
        if not items or index is None or not 0 <= int(index) < len(items):
            raise refused("pick an image in the table first")
        item = items[int(index)]
        if seen is not None and seen != self.shown_path(item.path):  # another list or image came while clicking
            raise refused("the page was changing to another image as you clicked: nothing was recorded; decide again")
        if action == "relabel" and label not in self.run.labels:
            raise refused(f"choose a class to relabel as (one of {', '.join(self.run.labels)})")
        if action == "keep" and item.given not in self.run.labels:
            raise refused("this image's class is not known to the run: relabel it or leave it out")
        chosen = {"keep": item.given, "relabel": label, "leave": None}[action]
        try:
            self.decisions.decide(item.path, chosen)
        except OSError as e:
            raise refused(f"could not write {self.decisions.file}: {e}; nothing was recorded") from None
        except ValueError as e:  # the file was broken since (by hand): fit would refuse it too
            raise refused(f"{e}; nothing was recorded") from None
        said = "left out" if chosen is None else "kept" if chosen == item.given else f"relabelled {plain(chosen)}"
        status = visible(f"{code(self.shown_path(item.path))}: {said} (saved in {code(str(self.decisions.file))})")
        return self.rows(which), *self.show(which, int(index) + 1), status


def heading(run: ReviewRun, decisions: Decisions) -> str:
    """The page's Markdown heading: the run, its checkpoint, and where decisions go, every path shown as written
    (a folder's `**` or `<img>` is text) and the command to train on them ready to paste."""
    calibrated = f"temperature {run.temperature:.3f} fitted on the calibration split" if run.calibrated else (
        "uncalibrated (the run has no calibration split)"
    )  # fmt: skip
    file = str(decisions.file)
    lines = [
        f"# vitscope review: {plain(str(run.run_dir))}",
        f"Checkpoint {code(run.checkpoint.name)}, {len(run.labels)} classes; probabilities {calibrated}.",
    ]
    if run.unreadable:
        lines.append(f"**{plain(run.unreadable)}**.")
    if decisions.cannot_save:
        lines.append(f"**{plain(decisions.cannot_save)}**.")
    else:
        lines.append(
            f"Each decision is saved at once in {code(file)}; train on it with "
            f"{code(f'vit-train fit ... --data.corrections {shlex.quote(file)}')}."
        )
    return "\n\n".join(lines)


def build_review_app(run: ReviewRun) -> gr.Blocks:
    """The review page of `run` (see the module docstring)."""
    on = ReviewActions(run)
    first = next((name for name in LISTS if run.lists[name]), LISTS[0])
    title = visible(f"vitscope review: {run.run_dir.name}")
    with gr.Blocks(title=title, analytics_enabled=False, delete_cache=(CACHE_S, CACHE_S)) as demo:
        gr.Markdown(visible(heading(run, on.decisions)))
        which = gr.Radio([(f"{name} ({len(run.lists[name])})", name) for name in LISTS], value=first, label="List")
        table = gr.Dataframe(headers=HEADERS, type="array", interactive=False, elem_id="items", max_height=320)
        with gr.Row(equal_height=True):
            image = gr.Image(type="numpy", label="What the model sees", interactive=False, height=280)
            overlay = gr.Image(type="numpy", label="Attention rollout", interactive=False, height=280)
            top = min(5, len(run.labels))
            probs = gr.Label(num_top_classes=top, label="Calibrated probabilities", elem_id="probs")
        about = gr.Markdown(elem_id="about")
        with gr.Row():
            keep = gr.Button("Keep the label", elem_id="keep")
            new_label = gr.Dropdown(run.labels, value=None, label="Relabel as", elem_id="new-label")
            relabel = gr.Button("Relabel", variant="primary", elem_id="relabel")
            leave = gr.Button("Leave out", variant="stop", elem_id="leave-out")
        status = gr.Markdown(elem_id="status")
        # per page: the image shown, (list, index). A decision is for it, whichever list the radio shows by then
        index = gr.State((first, -1))
        seen = gr.Textbox(visible=False)  # the shown image's path, as the browser holds it when a button is clicked
        shown = [image, overlay, probs, about, new_label, index, seen]
        # one queue for every event (`train.review` limits it to one at a time): each runs the network, and a click
        # waits for the list being loaded, rather than each kind of event having a queue of its own
        one = {"api_name": False, "concurrency_id": "review"}
        demo.load(on.load, [which], [table, *shown], **one)
        which.change(on.load, [which], [table, *shown], **one)
        table.select(on.pick, [which], shown, **one)
        for button, action in ((keep, "keep"), (relabel, "relabel"), (leave, "leave")):
            decide = lambda at, label, path, a=action: on.decide(*at, a, label, path)
            button.click(decide, [index, new_label, seen], [table, *shown, status], **one)
    return demo
