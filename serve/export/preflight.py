"""What `vit-export` refuses before the slow export starts, so that a mistake costs a second, not a minute.

- the output: the checkpoint itself (writing would replace the trained weights), or a folder.

Each refusal is a ValueError whose message says what is wrong and what to do: `vit-export` prints it in one
line and answers 2 (1 means the parity gate failed).
"""

from __future__ import annotations

import os
from pathlib import Path


def check_output(checkpoint: Path, output: Path) -> None:
    """Refuse an output that is the checkpoint itself (by any spelling or link) or a folder."""
    same = output.resolve() == checkpoint.resolve()
    if not same and output.exists() and checkpoint.exists():
        same = os.path.samefile(output, checkpoint)  # a hard link, or another mount of the same file
    if same:
        raise ValueError(
            f"-o {output} is the checkpoint itself: writing the model there would replace the trained weights; "
            f"name another file, e.g. -o {checkpoint.with_suffix('.onnx')}"
        )
    if output.is_dir():
        raise ValueError(f"-o {output} is a folder; name the file to write in it, e.g. -o {output / 'model.onnx'}")
