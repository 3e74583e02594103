"""What the UI's Model tab shows of a model file's metadata (`page_metadata`)."""

from __future__ import annotations

from typing import Any


def page_metadata(metadata) -> dict:
    """What the Model tab shows of the file's metadata: not the library versions (they tell attackers what to try),
    and of its calibration the figures, not the path it was fitted from nor its arrays (370 kB for the sample, which
    Gradio copies into each session's state), as plain JSON."""
    meta = {k: v for k, v in dict(metadata).items() if k != "versions"}
    cal = meta.get("calibration")
    if isinstance(cal, dict):
        meta["calibration"] = {k: cal[k] for k in ("temperature", "images", "metrics") if k in cal} | {
            k: cal[k].get(key) for k, key in (("conformal", "method"), ("ood", "score")) if isinstance(cal.get(k), dict)
        }
    return _jsonable(meta)


def _jsonable(meta: Any) -> Any:
    if isinstance(meta, dict):
        return {str(k): _jsonable(v) for k, v in meta.items()}
    if isinstance(meta, (list, tuple)):
        return [_jsonable(v) for v in meta]
    if isinstance(meta, (str, int, float, bool)) or meta is None:
        return meta
    return str(meta)
