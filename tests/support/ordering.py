"""The order scripts/test.sh's pytest-xdist workers take the test modules in."""

from __future__ import annotations

#: The longest modules (minutes each on the 2-core machine: the 10^5-step scheduler
#: differential alone takes about 4), run first. ``scripts/test.sh`` hands whole modules
#: to its workers (``--dist loadfile``) in collection order, and ``tests/conftest.py``
#: moves these to the front on a worker: one of them started last would leave the other
#: worker idle for minutes. Paths from the repository root; ``tests/repo/test_layout.py``
#: checks that each exists.
LONGEST_FIRST = (
    "tests/integration/test_scheduler_differential.py",
    "tests/cli/test_replay_models.py",
    "tests/cli/test_replay.py",
    "tests/native/test_fault_injection.py",
    "tests/cli/test_transfer.py",
    "tests/integration/test_conformance_runner.py",
)
