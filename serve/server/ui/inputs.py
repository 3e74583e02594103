"""What the UI's callbacks accept from a page or a raw API call: each refusal a `Refused` that names the widget.

Gradio hands a callback whatever a raw call sends (NaN, 0.5 for a slider of whole numbers, null or a list for a
dropdown); these checks turn each into a message the caller can act on.
"""

from __future__ import annotations

import math
from typing import Any

import gradio as gr


class Refused(gr.Error):
    """A `gr.Error` for input the caller can fix: the message goes to them, and no traceback to the server's log
    (Gradio prints one for every `gr.Error` unless told not to)."""

    def __init__(self, message: str):
        super().__init__(message, print_exception=False)


def whole(value: Any, name: str) -> int:
    """A slider's block or head index: a whole number, or `Refused` naming it (Gradio passes NaN and 0.5 on)."""
    number = float(value) if isinstance(value, (int, float)) else math.nan  # a JSON number, as sliders send
    if not (math.isfinite(number) and number == int(number)):
        raise Refused(f"the {name} must be a whole number, got {value}")
    return int(number)


def share(value: Any, name: str = "opacity", most: float = 1.0) -> float:
    """A value in [0, `most`], or `Refused` naming it (NaN drew an all-black overlay)."""
    number = float(value) if isinstance(value, (int, float)) else math.nan  # a JSON number, as sliders send
    if not 0.0 <= number <= most:
        raise Refused(f"the {name} must be in [0, {most}], got {value}")
    return number


def choice(value: Any, options: tuple[str, ...], name: str) -> str:
    """One of a dropdown's `options`, or `Refused` naming it (null or a list reached matplotlib and the rollout)."""
    if not (isinstance(value, str) and value in options):
        raise Refused(f"the {name} must be one of {', '.join(options)}, got {value!r}")
    return value
