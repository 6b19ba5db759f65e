"""llama.cpp's last warning and error lines, kept for our error messages. The log callback that
fills it is installed by pymoecache.llama (it must see every line, even with verbose=False)."""

from __future__ import annotations

import collections

LINES: "collections.deque[str]" = collections.deque(maxlen=12)


def take_log_lines(n: int = 3) -> str:
    """llama.cpp's last warning/error lines since the last call (cleared), or ''."""
    lines = list(LINES)[-n:]
    LINES.clear()
    return " | ".join(lines)
