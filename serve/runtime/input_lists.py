"""The inputs a `vit-predict --from-list` file names: paths or URIs, one a line, as `serve.runtime.jobs` takes them.

    items = listed_inputs(Path("inputs.txt"), sys.stderr)

Blank lines and `#` comments are skipped. The file is read as the file system's bytes (`os.fsdecode`), so that it
may name a file whose name is not UTF-8; a list saved by Notepad (a UTF-8 byte order mark) or by PowerShell 5's `>`
(UTF-16) reads as it was meant.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

from serve.runtime.terminal import one_line

MAX_LIST_BYTES = 1 << 30  # a list of 1 GiB names ten million files or more


def listed_inputs(path: Path, errors: TextIO) -> list[str]:
    """The paths and URIs `path` lists, in order; a comment line that names a file is said on `errors`, with how to
    score that file.

    Raises:
        ValueError: `path` is a folder, or over `MAX_LIST_BYTES`.
    """
    items = []
    for n, line in enumerate(_list_lines(Path(path)), 1):
        item = line.strip()
        if item.startswith("#") and os.path.isfile(item):  # a comment that names a file (a long one: False)
            print(
                one_line(f"{path}:{n}: {item} is read as a comment; write it as ./{item} to score that file"),
                file=errors,
            )
        elif item and not item.startswith("#"):
            items.append(item)
    return items


def _list_lines(path: Path) -> list[str]:
    """The lines of a `--from-list` file: the file system's bytes (`os.fsdecode`), after the UTF-8 byte order mark
    Notepad writes; UTF-16 by its byte order mark (PowerShell 5's `>`).

    Raises:
        ValueError: it is a folder (open() would say only "Is a directory"); it is over `MAX_LIST_BYTES` (`/dev/zero`,
            or a pipe that never ends, was read until memory ran out).
    """
    if path.is_dir():
        raise ValueError(
            f"--from-list {path} is a folder: it takes a text file of paths or URIs, one a line; give the folder as an "
            "input argument instead (vit-predict MODEL FOLDER --out FILE), and its images are found in it"
        )
    with path.open("rb") as f:
        data = f.read(MAX_LIST_BYTES + 1)
    if len(data) > MAX_LIST_BYTES:
        raise ValueError(
            f"--from-list {path} is over {MAX_LIST_BYTES:,} bytes (ten million paths or more, or a stream that does "
            "not end): split the list over several runs, each with its own --out"
        )
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return data.decode("utf-16").splitlines()
    return [os.fsdecode(line) for line in data.removeprefix(b"\xef\xbb\xbf").splitlines()]
