"""pytest plugin recording one outcome per test as JSON (``-p kvpool.tools.conformance.outcomes_plugin``).

Written to ``--kvpool-outcomes=PATH`` at session end::

    {"outcomes": {nodeid: {"outcome": "passed"|"failed"|"skipped"|"error",
                           "message": str, "duration_s": float}},
     "exitstatus": int, "collected": int, "kvpool_installed": bool,
     "excluded": {nodeid: exclusion nodeid}}

Phases are folded the way pytest's terminal summary counts them: a failing setup or
teardown is an ``error``, a failing call a ``failure``; an expected failure (xfail)
counts as ``skipped`` and an unexpected pass (non-strict xpass) as ``passed``. A module
that fails to import is recorded under its own nodeid as an ``error``.
``kvpool_installed`` says whether kvpool's classes were bound in vLLM when the session
ended, so the runner can check that each mode ran on the block pool it claims.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from kvpool.tools.conformance.suites import Exclusion

MESSAGE_CHARS = 4000

_outcomes: dict[str, dict] = {}
_excluded: dict[str, str] = {}  # collected nodeid -> the exclusion nodeid that matched it


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kvpool-outcomes", default=None, help="write per-test outcomes (JSON) here")
    parser.addoption(
        "--kvpool-exclusions",
        default=None,
        help="JSON list of {nodeid, reason}: deselect these tests (and the cases under them)",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = config.getoption("--kvpool-exclusions")
    if not path:
        return
    with open(path) as f:
        exclusions = [Exclusion(e["nodeid"], e["reason"]) for e in json.load(f)]
    kept, deselected = [], []
    for item in items:
        hit = next((e for e in exclusions if e.matches(item.nodeid)), None)
        if hit is None:
            kept.append(item)
        else:
            deselected.append(item)
            _excluded[item.nodeid] = hit.nodeid
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def _message(report) -> str:
    longrepr = getattr(report, "longrepr", None)
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # skip: (path, lineno, reason)
        return str(longrepr[2])
    text = getattr(report, "longreprtext", None) or str(longrepr)
    # The tail holds the exception and the lines that raised it.
    return text[-MESSAGE_CHARS:]


def _record(nodeid: str, outcome: str, report, duration: float = 0.0) -> None:
    entry = _outcomes.setdefault(nodeid, {"outcome": "passed", "message": "", "duration_s": 0.0})
    entry["duration_s"] = round(entry["duration_s"] + duration, 4)
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    if rank[outcome] >= rank[entry["outcome"]]:
        entry["outcome"] = outcome
        if outcome != "passed":
            entry["message"] = _message(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    duration = getattr(report, "duration", 0.0)
    if report.when == "call":
        if report.passed:
            outcome = "passed"
        elif report.skipped:
            outcome = "skipped"  # includes xfail
        else:
            outcome = "failed"
    elif report.failed:
        outcome = "error"  # setup or teardown raised
    elif report.skipped:
        outcome = "skipped"  # skipped in setup (skip marks, pytest.skip in fixtures)
    else:
        if report.nodeid not in _outcomes:
            _record(report.nodeid, "passed", report, duration)
        else:
            entry = _outcomes[report.nodeid]
            entry["duration_s"] = round(entry["duration_s"] + duration, 4)
        return
    _record(report.nodeid, outcome, report, duration)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _record(report.nodeid or "<collection>", "error", report)
    elif report.skipped:  # a module skipped as a whole (pytest.skip(allow_module_level=True))
        _record(report.nodeid, "skipped", report)


def _kvpool_installed() -> bool:
    kvpool = sys.modules.get("kvpool")
    if kvpool is None or not hasattr(kvpool, "is_installed"):
        return False
    return bool(kvpool.is_installed())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--kvpool-outcomes")
    if not path:
        return
    data = {
        "outcomes": _outcomes,
        "exitstatus": int(exitstatus),
        "collected": session.testscollected,
        "excluded": _excluded,
        "kvpool_installed": _kvpool_installed(),
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
