"""Where things are in the checkout, for tests in any folder."""

from __future__ import annotations

from pathlib import Path

#: The repository root (``tests/support/`` is two levels below it).
REPO = Path(__file__).resolve().parents[2]
