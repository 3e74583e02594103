"""`vit-train`'s console script: check that the `[train]` extra is installed, then run `train.cli`.

`train.cli` imports torch and Lightning on its first lines, so on a host with another extra only (a serving
host has `[serve]`, no torch) the command would end in a `ModuleNotFoundError` traceback. This module
imports nothing but the standard library until the check has passed, and says in one line what to install.
"""

from __future__ import annotations

import importlib.util
import sys

# The top-level modules `vit-train` imports from the `[train]` extra
TRAIN_MODULES = ("torch", "torchvision", "timm", "lightning", "torchmetrics", "jsonargparse")


def require(prog: str, modules: tuple[str, ...], extra: str) -> None:
    """Exit with status 2 and a one-line message naming the extra to install when any of `modules` is missing.

    Args:
        prog: the command, first in the message.
        modules: top-level module names, looked up without importing them.
        extra: the optional dependency group of vitscope that installs them.
    """
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"{prog} needs {', '.join(missing)}, which the {extra} extra installs: pip install 'vitscope[{extra}]'",
            file=sys.stderr,
        )
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int | None:
    """`vit-train`: `train.cli.main(argv)` once its dependencies are there; its exit status (`vit-train prepare`
    and `vit-train review` return one)."""
    require("vit-train", TRAIN_MODULES, "train")
    from train.cli import main as cli_main

    return cli_main(argv)
