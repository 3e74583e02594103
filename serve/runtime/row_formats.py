"""The rows of `vit-predict --out` in each format, and how each keeps any file name.

Formats, chosen by the suffix of `--out`: `.parquet` (needs pyarrow: `pip install 'vitscope[batch]'`),
`.csv` and `.jsonl`. A row is the JSON object vit-predict prints (`path`, `predictions: [{label, score}]`
and whatever other fields the run adds); the table formats flatten it to one row per image with columns
`path, label_1, score_1, ..., label_k, score_k` and the other fields as they are (nested values as JSON
text in CSV). Ray's writer (`serve.cluster`) uses the same `table_row`, so both give the same columns.

File names on Linux are bytes, and Python holds one that is not UTF-8 as a str with surrogate escapes ('\\udcff'
for the byte 0xff). Each format keeps such a path and every other row: JSON Lines writes the escape (`"\\udcff"`,
which `json.loads` gives back as the same str, and `os.fsencode` as the same bytes); CSV writes the name's own
bytes, as `ls` does (read it back with `open(..., errors="surrogateescape")` and the `csv` module to get the same
str; pandas' parser refuses such a str, whatever its `encoding_errors`); Parquet, whose strings must be UTF-8,
writes each such byte as the four characters `\\xff` (Python's backslashreplace: readable, but a name that holds a
real backslash followed by `x` and two hex digits reads the same).
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

FORMATS = (".parquet", ".csv", ".jsonl")


def output_format(out: Path) -> str:
    """The format named by the suffix of `out` ('.parquet', '.csv' or '.jsonl').

    Raises:
        ValueError: any other suffix.
    """
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"--out {out}: name the file .parquet, .csv or .jsonl to choose its format")
    if suffix == ".parquet":
        require_pyarrow()
    return suffix


def require_pyarrow():
    """pyarrow, imported on first use, or an error that says how to install it."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError(
            "writing .parquet needs pyarrow: pip install 'vitscope[batch]' (or name the output .csv or .jsonl)"
        ) from None
    return pyarrow


def table_row(row: dict[str, Any]) -> dict[str, Any]:
    """A vit-predict row flattened for a table: `predictions` becomes label_1, score_1, label_2, ..."""
    flat: dict[str, Any] = {}
    for key, value in row.items():
        if key == "predictions":
            for rank, pred in enumerate(value, start=1):
                flat[f"label_{rank}"] = pred["label"]
                flat[f"score_{rank}"] = pred["score"]
        else:
            flat[key] = value
    return flat


def parquet_text(value: Any) -> Any:
    """A str as valid UTF-8 for Parquet: the bytes of a file name that is not UTF-8 as `\\xff` (backslashreplace)."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return value


def csv_line(fields: list) -> str:
    """One CSV record ending in "\\n", every field quoted when one holds a carriage return: with that terminator the
    `csv` module leaves a carriage return unquoted, which readers take for a line break (a file name, a class)."""
    text = io.StringIO()
    quoting = csv.QUOTE_ALL if any("\r" in str(f) for f in fields) else csv.QUOTE_MINIMAL
    csv.writer(text, lineterminator="\n", quoting=quoting).writerow(fields)
    return text.getvalue()


def encode_rows(rows: list[dict[str, Any]], fmt: str, header: bool = True) -> bytes:
    """Rows in the format's bytes (one part's data file); a path that is not UTF-8 as the module says."""
    if fmt == ".jsonl":
        return "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows).encode()
    flat = [table_row(r) for r in rows]
    if fmt == ".csv":
        fields = list(flat[0])
        known, lines = set(fields), [csv_line(fields)] if header else []
        for r in flat:  # lists as JSON text, and true / false as stdout writes them
            if extra := set(r) - known:  # a column the header lacks would be lost
                raise ValueError(f"a row has fields the first row does not: {sorted(extra)}")
            values = [r.get(k, "") for k in fields]
            lines.append(csv_line([json.dumps(v) if isinstance(v, (list, dict, bool)) else v for v in values]))
        return "".join(lines).encode("utf-8", "surrogateescape")  # a name's own bytes, as the file system has them
    pa = require_pyarrow()
    sink = pa.BufferOutputStream()
    pa.parquet.write_table(pa.Table.from_pylist([{k: parquet_text(v) for k, v in r.items()} for r in flat]), sink)
    return sink.getvalue().to_pybytes()


def rows_in(path: Path, fmt: str) -> int | None:
    """The rows of a part's data file, or None when it is missing or cut short (an error reading it is raised: the
    part may be whole, and a network disk's hiccup must not throw its work away)."""
    if not path.is_file():
        return None
    if fmt == ".parquet":
        try:
            return require_pyarrow().parquet.read_metadata(path).num_rows
        except ValueError:  # pyarrow's ArrowInvalid: no footer, cut short
            return None
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # cut off mid-row
        return None
    if fmt == ".csv":  # a row ends at a line break outside quotes (a file name may hold line breaks)
        data = re.sub(rb'"[^"]*"', b"", data)  # each quoted field, its doubled quotes too
        if b'"' in data:  # a quote left open: cut inside a quoted field
            return None
    return data.count(b"\n") - (fmt == ".csv")


def merge_parquet(parts: list[Path], dest, template: dict[str, Any] | None) -> None:
    """Parquet parts -> one file, part by part, under the schema they all fit (a part of nulls fits any); no
    parts: no rows, under the `template` row's columns."""
    pa = require_pyarrow()
    pq = pa.parquet
    if not parts:
        empty = pa.table({"path": pa.array([], pa.string())})
        pq.write_table(empty if template is None else pa.Table.from_pylist([table_row(template)]).slice(0, 0), dest)
        return
    schema = pa.unify_schemas([pq.read_schema(p) for p in parts], promote_options="permissive")
    with pq.ParquetWriter(dest, schema) as writer:
        for part in parts:
            writer.write_table(pq.read_table(part).cast(schema))
