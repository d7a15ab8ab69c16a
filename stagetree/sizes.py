"""Sizes in bytes on the command line (``--checkpoint-budget 500MB``)."""

from __future__ import annotations

import argparse
import math

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: str) -> int:
    """A size in bytes: ``123``, ``500MB``, ``1.5 GB``, ``64MiB`` (KB/MB/GB/TB are powers of 1000,
    KiB/MiB/GiB/TiB of 1024; case does not matter). An argparse type: ArgumentTypeError naming
    the value when it is not a positive size."""
    text = value.strip().lower().replace(" ", "").replace("_", "")
    number = text.rstrip("bikmgt")
    unit = text[len(number):]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _SIZE_UNITS or not 0 < amount < math.inf:  # (nan compares false)
        raise argparse.ArgumentTypeError(f"must be a size in bytes such as 500MB, 2GiB or 1000000, got {value!r}")
    size = int(amount * _SIZE_UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {value!r}")
    return size
