"""What the UI's callbacks accept from a page or a raw API call: each refusal a `gr.Error` that names the widget.

Gradio hands a callback whatever a raw call sends (NaN, 0.5 for a slider of whole numbers, null or a list for a
dropdown); these checks turn each into a message the caller can act on.
"""

from __future__ import annotations

import math
from typing import Any

import gradio as gr


def whole(value: Any, name: str) -> int:
    """A slider's block or head index: a whole number, or a `gr.Error` naming it (Gradio passes NaN and 0.5 on)."""
    number = float(value) if isinstance(value, (int, float)) else math.nan  # a JSON number, as sliders send
    if not (math.isfinite(number) and number == int(number)):
        raise gr.Error(f"the {name} must be a whole number, got {value}")
    return int(number)


def share(value: Any, name: str = "opacity") -> float:
    """A value in [0, 1], or a `gr.Error` naming it (NaN drew an all-black overlay)."""
    number = float(value) if isinstance(value, (int, float)) else math.nan  # a JSON number, as sliders send
    if not 0.0 <= number <= 1.0:
        raise gr.Error(f"the {name} must be in [0, 1], got {value}")
    return number
