"""Text from outside (a file name, a link's target) on a terminal line: its control characters written as `\\xNN`.

A file name may hold any byte but `/` and NUL: a newline would end its line on stderr and start one of its own
choosing (a forged `vit-predict: classified 99 images` summary), a carriage return or an escape sequence would
rewrite what the terminal shows; the backslash is written as `\\x5c`, so that a name holding `\\x0a` cannot pass
for an escaped newline. Printable text, accents and all, is written as it is. The server's access log
escapes the same characters (`serve.server.access_log`), and its field's quote too.
"""

from __future__ import annotations

CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}  # C0, DEL and C1 (NEL among them)
CONTROL_ESCAPES |= {c: f"\\u{c:04x}" for c in (0x2028, 0x2029)}  # the line and paragraph separators editors break on
ESCAPES = CONTROL_ESCAPES | {ord("\\"): "\\x5c"}  # and the escape character: `a\\x0ab` is not `a<LF>b` escaped


def one_line(text: str) -> str:
    """`text` with its control characters written out (`\\x0a`), so that it stays one line of a terminal."""
    return text if text.isprintable() and "\\" not in text else text.translate(ESCAPES)
