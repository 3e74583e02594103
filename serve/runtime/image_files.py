"""Finding the image files of a folder: training (`train.folder_scan`), `vit-export`'s parity and calibration
images and `vit-predict` (`serve.runtime.jobs`) all list folders here, alike."""

from __future__ import annotations

import argparse
import errno
import os
from collections.abc import Callable
from pathlib import Path

from serve.runtime.image_formats import UNREAD_SUFFIXES
from serve.runtime.images import IMAGE_SUFFIXES

LINK_NOT_FOLLOWED = "a link into a folder walked on its own: not followed"


def link_loop(path: str | Path) -> str | None:
    """Why `path` cannot be used when it, or a folder on its way, is a symbolic link that loops; else None. Python
    3.11's `Path.resolve` answers such a path with a RuntimeError traceback."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"{path} is a symbolic link that loops (it leads back to itself): fix or remove the link"
    return None


def path_argument(value: str) -> Path:
    """An argparse `type` for a local path: one line, not a traceback, for a link that loops (`link_loop`)."""
    if why := link_loop(value):
        raise argparse.ArgumentTypeError(why)
    return Path(value)


def is_image_file(path: str | Path) -> bool:
    """True for a visible file whose suffix (any case) is an image type we read, or a photo's we report
    (`UNREAD_SUFFIXES`: its reading fails, and says why)."""
    p = Path(path)
    return p.suffix.lower() in IMAGE_SUFFIXES + UNREAD_SUFFIXES and not p.name.startswith(".")


def walk_image_files(folder: str | Path, leave: Callable[[str], bool] | None = None) -> tuple[list[str], list[OSError]]:
    """The image files under `folder` (`is_image_file`: hidden files and folders left out), sorted, and the errors
    of the folders that could not be listed (they would hide their images: the caller reports them). Linked folders
    are followed, as torchvision's `ImageFolder` does, each real folder once. Paths start with `folder` as given.
    Training (`train.folder_scan`) and `vit-predict` (`serve.runtime.jobs`) both find their images here.

    Args:
        leave: given a folder's real path, whether a link must not lead into it; such a link is an error
            (`LINK_NOT_FOLLOWED`).
    """
    found, errors, seen, folders = [], [], set(), [os.fspath(folder)]  # not os.walk: 3.11's recurses (1,000 deep)
    while folders:
        top = folders.pop()
        try:
            st = os.stat(top)
            if leave is not None and top != os.fspath(folder) and leave(os.path.realpath(top)):
                errors.append(OSError(errno.ELOOP, LINK_NOT_FOLLOWED, top))
                continue
            if (st.st_dev, st.st_ino) in seen:  # walked already, through a link
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(top) as listing:  # in name order: of two names for one folder, the first is kept
                entries = sorted((e.name, e.path, _is_folder(e)) for e in listing)
        except OSError as e:
            errors.append(e)
            continue
        folders += [path for name, path, is_dir in reversed(entries) if is_dir and not name.startswith(".")]
        found += [path for name, path, is_dir in entries if not is_dir and is_image_file(name)]  # a dead link too
    return sorted(found), errors


def _is_folder(entry: os.DirEntry) -> bool:  # a folder or a link to one; one that cannot be checked: a file
    try:
        return entry.is_dir()
    except OSError:
        return False
