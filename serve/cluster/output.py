"""The --out folder of `vit-predict --ray`, whole or absent: Ray Data writes its parts beside it, into
`preds.parquet.incomplete/`, which is renamed to `preds.parquet` once every part is on disk.

    folder = OutputFolder(Path("preds.parquet"))   # refuses an --out that exists
    folder.take(sys.stderr)                        # held until release; what a stopped run left is cleared
    ds.write_parquet(str(folder.tmp))
    folder.publish(template)                       # the parts flushed, then the rename, flushed too
    folder.release()                               # a run that did not publish deletes its parts

A run stopped at any instant (Ctrl-C, a failed write, SIGKILL, a lost machine) leaves no --out, so that nothing
reads as a complete table with rows missing. A SIGKILL leaves the `.incomplete` folder, and the next run to the
same --out deletes its parts, saying so: a --ray job is not resumable (every input is scored again). Only Parquet
parts are deleted: a folder of that name holding anything else is someone else's, and is refused, never emptied.
While a run goes it holds a lock on its folder, which the kernel lets go however the process ends, so that a second
run on the same --out is refused instead of deleting the first one's parts (as the local job holds its parts folder,
`serve.runtime.outputs.PartStore.lock`).

Each part is flushed to disk, then the folder, then the rename and the folder it was made in, as
`serve.runtime.outputs` does for its renames: after a power cut the --out folder is there with every part, or
not there at all. A job no image reached writes one part of no rows under the local run's columns (the job's
`template` row, `serve.runtime.predict.template_row`), as the local output does.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, TextIO

from serve.runtime.outputs import lock_folder, sync_folder
from serve.runtime.row_formats import require_pyarrow, table_row

INCOMPLETE_SUFFIX = ".incomplete"
EMPTY_PART = "columns.parquet"  # the part of a job no image reached: its columns and no rows


class OutputFolder:
    """The --out folder of a --ray run, written as `tmp` beside it and renamed into place when complete.

    Args:
        out: the folder to write (`preds.parquet`).

    Raises:
        ValueError: `out` exists, or is not named .parquet.
    """

    def __init__(self, out: Path):
        if out.suffix.lower() != ".parquet":
            raise ValueError(f"--ray writes a directory of Parquet parts: name it .parquet, not {out.name}")
        self.out = Path(out)
        self.tmp = self.out.with_name(self.out.name + INCOMPLETE_SUFFIX)
        self._held: int | None = None  # the temporary folder, while `take` holds it
        self._published = False
        self._refuse_existing()

    def _refuse_existing(self) -> None:
        if self.out.exists() or self.out.is_symlink():
            raise ValueError(f"{self.out} exists: remove it to score again (--resume is for runs on one machine)")

    def take(self, errors: TextIO) -> None:
        """Make the temporary folder and hold it until `release`; one a stopped run left is emptied, saying so.

        Raises:
            ValueError: another run holds it, or it is a link or a file.
        """
        try:
            self.tmp.mkdir(parents=True)
            left = False
        except FileExistsError:
            left = True
        try:
            held = os.open(self.tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ValueError(
                    f"{self.tmp} is not a folder of vit-predict's: remove it, or give another --out"
                ) from None
            raise
        busy = f"another vit-predict is writing {self.out} (into {self.tmp}): wait for it to end, or give another --out"
        self._held = lock_folder(held, busy)
        if left and (stranger := _not_ours(self.tmp)):
            os.close(self._held)  # and nothing of it deleted: `release` has nothing to let go of
            self._held = None
            raise ValueError(
                f"{self.tmp} is not a folder of vit-predict's (it holds {stranger}): remove it, or give another --out"
            )
        if left and any(self.tmp.glob("*.parquet")):
            print(
                f"{self.tmp}: deleting the parts of a stopped --ray run (it did not finish, and a --ray job is not "
                "resumable: this run scores every input)",
                file=errors,
            )
            _empty(self.tmp)

    def publish(self, template: dict[str, Any]) -> None:
        """Flush the parts Ray wrote (or, when it wrote none, a part of `template`'s columns and no rows), then
        rename the folder to --out and flush the rename.

        Raises:
            ValueError: --out appeared while the job ran.
        """
        if not any(self.tmp.glob("*.parquet")):
            pa = require_pyarrow()
            pa.parquet.write_table(pa.Table.from_pylist([table_row(template)]).slice(0, 0), self.tmp / EMPTY_PART)
        for part in filter(Path.is_file, self.tmp.iterdir()):
            with open(part, "rb") as f:
                os.fsync(f.fileno())
        sync_folder(self.tmp)
        self._refuse_existing()
        os.rename(self.tmp, self.out)
        self._published = True
        sync_folder(self.out.parent)

    def release(self) -> None:
        """Let go of the folder `take` holds; a run that did not publish (failed, stopped) deletes its parts."""
        if self._held is None:
            return
        if not self._published:
            shutil.rmtree(self.tmp, ignore_errors=True)
        os.close(self._held)
        self._held = None


def _not_ours(folder: Path) -> str | None:
    """The name of something in `folder` that is not a Parquet part a run of vit-predict writes (None: nothing)."""
    return next((e.name for e in sorted(folder.iterdir()) if not _is_part(e)), None)


def _is_part(entry: Path) -> bool:
    return entry.suffix == ".parquet" and entry.is_file() and not entry.is_symlink()


def _empty(folder: Path) -> None:
    """Delete the parts a stopped run left (`_not_ours` found nothing else there)."""
    for entry in folder.iterdir():
        if _is_part(entry):
            entry.unlink()
