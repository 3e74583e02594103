"""`vit-export`'s console script: check that the `[export]` extra is installed, then run `serve.export.cli`.

`serve.export.cli` imports onnx and (through the checkpoint loader) torch on its first lines, so on a host with
another extra only (a serving host has `[serve]`: onnxruntime, no onnx and no torch) the command would end in a
`ModuleNotFoundError` traceback. This module checks first and says in one line what to install.
"""

from __future__ import annotations

from train.launch import TRAIN_MODULES, require

# What `[export]` adds to `[train]`: the ONNX graph library and the exporter torch.onnx.export(dynamo=True) runs
EXPORT_MODULES = (*TRAIN_MODULES, "onnx", "onnxscript")


def main(argv: list[str] | None = None) -> int:
    """`vit-export`: `serve.export.cli.main(argv)` once its dependencies are there."""
    require("vit-export", EXPORT_MODULES, "export")
    from serve.export.cli import main as cli_main

    return cli_main(argv)
