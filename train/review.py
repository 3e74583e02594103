"""`vit-train review RUN_DIR`: look at the images a run flags, and keep, relabel or leave each out.

    vit-train review runs/mine                 # http://127.0.0.1:7860
    vit-train fit --config runs/mine/config.yaml --data.corrections runs/mine/corrections.csv \
        --trainer.default_root_dir runs/mine-corrected

The page (`train.review_app`) lists the run's likely wrong labels, copies, unknown-looking images and worst
validation errors (`train.review_data`), each with its image, calibrated probabilities and attention rollout.
Every click is in `RUN_DIR/corrections.csv` before the page shows it (`train.review_store`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from jsonargparse import ActionYesNo, ArgumentParser

from serve.runtime.interrupts import exit_code, sigterm_as_interrupt
from serve.runtime.ports import check_port, free_port
from serve.runtime.temp_dirs import OwnedTempDir
from train.errors import SetupError

log = logging.getLogger(__name__)

REVIEW_HELP = "Review a run's flagged images in the browser; each decision goes to RUN_DIR/corrections.csv."


def review_parser() -> ArgumentParser:
    """The options of `vit-train review`; `vit-train --help` lists it with the Trainer's subcommands."""
    parser = ArgumentParser(
        prog="vit-train review",
        description=f"{REVIEW_HELP} Opens a page listing the likely wrong labels (reports/label_issues.csv), the "
        "copies (reports/duplicates.csv), the unknown-looking images and the worst validation errors, each with "
        "its calibrated probabilities and attention rollout; Keep, Relabel and Leave out write RUN_DIR/"
        "corrections.csv at once. Then: vit-train fit ... --data.corrections RUN_DIR/corrections.csv.",
    )
    parser.add_argument("run_dir", type=str, help="the run directory of a vit-train fit (--trainer.default_root_dir)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7860, help="port to listen on (0: a free one, said when it is up)")
    parser.add_argument(
        "--share", action=ActionYesNo, default=False, help="also open a public gradio.live link (it shows your images)"
    )
    parser.add_argument("--limit", type=int, default=200, help="at most this many images per list")
    parser.add_argument("--batch_size", type=int, default=64, help="images per forward pass when scoring the run")
    return parser


MAX_UPLOAD = 1024  # bytes: the page takes no upload; what Gradio's upload route takes goes (review_app.CACHE_S)


def main(argv: list[str]) -> None:
    """`vit-train review`: see `review_parser` for its options."""
    args = review_parser().parse_args(argv)
    if args.limit < 1 or args.batch_size < 1:
        print("vit-train review: --limit and --batch_size must be at least 1", file=sys.stderr)
        raise SystemExit(2)
    # the page's uploads and images go to a folder of this review's own, deleted when it ends (and by the next
    # review, if this one is killed), not to the shared /tmp/gradio; Gradio reads the variable as it is imported
    temp_dir, before = None, os.environ.get("GRADIO_TEMP_DIR")
    try:
        temp_dir = OwnedTempDir("vitscope-review-")  # an unwritable TMPDIR: one line, below
        os.environ["GRADIO_TEMP_DIR"] = str(temp_dir.path)
        with sigterm_as_interrupt():  # stopped as by Ctrl-C: Gradio closes, and deletes what was uploaded
            launch_review(args.run_dir, args.host, args.port, args.share, args.limit, args.batch_size)
    except ImportError as e:
        print(f"vit-train review needs the UI's packages ({e}): pip install 'vitscope[serve]'", file=sys.stderr)
        raise SystemExit(2) from None
    except (SetupError, ValueError, OSError) as e:
        print(f"vit-train review: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM while the run is scored: once the page is up, it just closes
        print(f"vit-train review: {str(e) or 'interrupted'}", file=sys.stderr)
        raise SystemExit(exit_code(e)) from None
    finally:
        if temp_dir is not None:
            temp_dir.remove()
        if before is None:
            os.environ.pop("GRADIO_TEMP_DIR", None)
        else:
            os.environ["GRADIO_TEMP_DIR"] = before


def launch_review(
    run_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 7860,
    share: bool = False,
    limit: int = 200,
    batch_size: int = 64,
    block: bool = True,
):
    """Score the run, then serve its review page (the arguments are `review_parser`'s options).

    Args:
        block: serve until interrupted; False returns the running `gr.Blocks` at once (its `close()` stops it).
    """
    from train.review_data import ReviewRun

    check_port(host, port)  # before the run is scored (minutes for a large one): Gradio finds it taken only after
    run = ReviewRun(Path(run_dir), limit=limit, batch_size=batch_size)  # a run it cannot review is refused first
    from train.review_app import build_review_app  # gradio: only for this subcommand, and only then

    app = build_review_app(run)
    counts = ", ".join(f"{len(items)} {name.lower()}" for name, items in run.lists.items())
    log.info("review: %s; decisions go to %s", counts, run.run_dir / "corrections.csv")
    app.queue(default_concurrency_limit=1)  # one network, one decisions file: one event at a time (one queue)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's requests to its own page, a line each
    port = port or free_port(host)  # picked now, once the run is scored: Gradio, given 0, asks port 0 if it is up
    try:
        app.launch(
            server_name=host, server_port=port, share=share, show_error=True, prevent_thread_lock=True, quiet=True,
            max_file_size=MAX_UPLOAD,
        )  # fmt: skip
        # our own line: Gradio's says to "set share=True in launch()", where this command's option is --share
        public = f" and {app.share_url}" if app.share_url else " (--share for a public link)"
        log.info("review: the page is at %s%s", app.local_url, public)
        if block:
            app.block_thread()  # until Ctrl-C or SIGTERM, then Gradio closes
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before Gradio's wait took over (the page may be up): close it
        app.close()
    return app
