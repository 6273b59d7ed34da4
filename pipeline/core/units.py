"""Byte sizes: parse `4GiB`, print 4.0 GiB: the one formatter every report uses."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512MiB', '2GB', '1e9' or an int → bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 4GiB, 512MiB or 2GB")
    count = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(count):
        raise ValueError(f"{text!r} is not a finite size; write e.g. 4GiB, 512MiB or 2GB")
    return int(count)


def format_bytes(count: float) -> str:
    """6.84 GiB, 300 MiB, 12 KiB, 512 B: the one way lengthwise prints a size."""
    if abs(count) >= 2**30:
        return f"{count / 2**30:.2f} GiB"
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:,.0f} {unit}"
    return f"{count:.0f} B"
