"""Training's progress lines on stderr, each stamped with the time of day."""

from __future__ import annotations

import sys
import time


def stamp(msg: str) -> str:
    return f"[{time.strftime('%H:%M:%S')}] {msg}"


def log(msg: str) -> None:
    print(stamp(msg), file=sys.stderr, flush=True)
