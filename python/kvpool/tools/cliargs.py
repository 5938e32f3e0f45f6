"""argparse ``type=`` checks shared by the commands, so a bad flag or an unwritable
output path is an argparse error before any work starts, never a traceback after it.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

#: File types the plots can be written as (matplotlib picks the format from the suffix).
PLOT_SUFFIXES: tuple[str, ...] = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def positive_int(text: str) -> int:
    """An int >= 1 (``--jobs``, ``--rounds``, ...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0 (``--warmup``, ``--max-prompts``: 0 means none / all)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (``--scale``, ``--timeout``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def check_writable(path: Path) -> Path:
    """``path`` can be written: not a directory, and its nearest existing parent folder
    is a writable directory (missing folders below it are created when writing).

    Raises:
        argparse.ArgumentTypeError: it cannot be written, saying why.
    """
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{str(path)!r} is a directory, not a file path")
    parent = path.parent
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {str(path)!r}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {str(path)!r}: {str(parent)!r} is not writable")
    return path


def existing_file(text: str) -> Path:
    """An input file that exists (``--sdist``, ``--trace``)."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return path


def output_file(text: str) -> Path:
    """An output file whose folder exists and is writable (``--json PATH``)."""
    path = Path(text).expanduser()
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {str(path.parent)!r} does not exist")
    return check_writable(path)


def plot_file(text: str) -> Path:
    """:func:`output_file` with a suffix matplotlib writes (:data:`PLOT_SUFFIXES`)."""
    path = output_file(text)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"cannot write a plot as {text!r}: the suffix must be one of {', '.join(PLOT_SUFFIXES)}")
    return path


def have_matplotlib() -> bool:
    """True when matplotlib can be imported (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None
