"""Compare two runs of vLLM's tests test by test and build the conformance report.

Pure functions over the JSON the outcomes plugin writes; no pytest, no vLLM. A test
*regresses* when it passed on vLLM's own block pool and did anything else with kvpool
installed: failed, errored, was skipped, or was not collected at all (a module that
no longer imports loses all its tests).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.tools.conformance.suites import Exclusion

#: Outcome recorded by the plugin -> key of the report's count objects.
COUNT_KEYS = {"passed": "passed", "failed": "failed", "skipped": "skipped", "error": "errors"}

EXIT_OK = 0
EXIT_REGRESSIONS = 1
#: The vanilla run collected nothing, or a run did not produce outcomes or ran on the
#: wrong block pool: the comparison would mean nothing.
EXIT_INVALID_RUN = 2

#: Lines of a failure's text kept in the report for each regression.
MESSAGE_LINES = 30


@dataclass
class RunResult:
    """Outcomes of one pytest run (one mode).

    Attributes:
        mode: ``"vanilla"`` or ``"kvpool"``.
        outcomes: nodeid -> ``passed`` | ``failed`` | ``skipped`` | ``error``.
        messages: nodeid -> failure or skip text, for tests that did not pass.
        collected: tests pytest collected after exclusions (0 if the run crashed).
        exitstatus: pytest's exit status (None if the process produced no outcomes).
        kvpool_installed: whether kvpool was bound in vLLM when the session ended.
        excluded: collected nodeid -> the exclusion nodeid that removed it.
        wall_s: seconds the subprocess ran.
        problem: why the run produced no usable outcomes, if it did not.
    """

    mode: str
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    collected: int = 0
    exitstatus: int | None = None
    kvpool_installed: bool = False
    excluded: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    problem: str | None = None

    @classmethod
    def from_plugin_json(cls, mode: str, data: dict, wall_s: float = 0.0) -> RunResult:
        """Build from the outcomes plugin's JSON object."""
        outcomes = data.get("outcomes", {})
        return cls(
            mode=mode,
            outcomes={nodeid: o["outcome"] for nodeid, o in outcomes.items()},
            messages={nodeid: o["message"] for nodeid, o in outcomes.items() if o.get("message")},
            collected=int(data.get("collected", 0)),
            exitstatus=data.get("exitstatus"),
            kvpool_installed=bool(data.get("kvpool_installed", False)),
            excluded=dict(data.get("excluded", {})),
            wall_s=wall_s,
        )

    @classmethod
    def load(cls, mode: str, path: Path, wall_s: float = 0.0, log_tail: str = "") -> RunResult:
        """Read the plugin's file; a missing or unreadable file gives a run with a ``problem``."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            problem = f"{mode} run wrote no outcomes ({e.__class__.__name__}: {e})"
            if log_tail:
                problem += "; end of its output:\n" + log_tail
            return cls(mode=mode, wall_s=wall_s, problem=problem)
        return cls.from_plugin_json(mode, data, wall_s)


def counts(result: RunResult) -> dict[str, int]:
    """``{"passed", "failed", "skipped", "errors"}`` counts of ``result``'s outcomes."""
    totals = dict.fromkeys(COUNT_KEYS.values(), 0)
    for outcome in result.outcomes.values():
        totals[COUNT_KEYS[outcome]] += 1
    return totals


def find_regressions(vanilla: RunResult, kvpool: RunResult) -> list[str]:
    """Node ids that passed vanilla and did not pass with kvpool (missing counts), sorted."""
    return sorted(
        nodeid
        for nodeid, outcome in vanilla.outcomes.items()
        if outcome == "passed" and kvpool.outcomes.get(nodeid) != "passed"
    )


def find_fixed(vanilla: RunResult, kvpool: RunResult) -> list[str]:
    """Node ids that did not pass vanilla but passed with kvpool, sorted."""
    return sorted(
        nodeid
        for nodeid, outcome in kvpool.outcomes.items()
        if outcome == "passed" and vanilla.outcomes.get(nodeid) != "passed"
    )


def key_lines(message: str, limit: int = MESSAGE_LINES) -> str:
    """The lines of a pytest failure text worth reading: ``E`` lines and the raising
    location, else the last ``limit`` lines."""
    lines = message.splitlines()
    keep = [ln for ln in lines if ln.startswith("E ") or ln.startswith(">") or ".py:" in ln]
    return "\n".join((keep or lines)[-limit:])


def _signature(message: str) -> str:
    # The exception lines of a failure ("E   AssertionError: ..."), without addresses
    # and temp paths that differ between two runs of the same failure.
    lines = [ln[1:].strip() for ln in message.splitlines() if ln.startswith("E ")]
    if not lines:
        lines = message.strip().splitlines()[-1:]
    return re.sub(r"0x[0-9a-f]+|/tmp/\S+|pytest-of-\S+", "*", "\n".join(lines))


def failed_tests(run: RunResult, other: RunResult | None) -> list[dict]:
    """Every test that failed or errored in ``run``, named, with the other mode's
    outcome and whether it failed the same way there.

    Returns:
        ``[{"nodeid", "outcome", "message", "other_outcome", "same_in_other_mode"}]``
        sorted by nodeid; ``other_outcome`` is None when the other mode was not run
        (or did not run the test), ``same_in_other_mode`` is True when the other mode
        had the same outcome and the same exception lines.
    """
    out = []
    for nodeid, outcome in sorted(run.outcomes.items()):
        if outcome not in ("failed", "error"):
            continue
        message = run.messages.get(nodeid, "")
        other_outcome = other.outcomes.get(nodeid) if other is not None else None
        same = bool(other is not None and other_outcome == outcome
                    and _signature(other.messages.get(nodeid, "")) == _signature(message))
        out.append({"nodeid": nodeid, "outcome": outcome, "message": key_lines(message),
                    "other_outcome": other_outcome, "same_in_other_mode": same})
    return out


def validity_problems(vanilla: RunResult | None, kvpool: RunResult | None) -> list[str]:
    """Reasons the runs cannot be compared; empty when they can."""
    problems = []
    for run in (vanilla, kvpool):
        if run is not None and run.problem:
            problems.append(run.problem)
    if vanilla is not None and not vanilla.problem:
        if vanilla.collected == 0 or not vanilla.outcomes:
            problems.append("the vanilla run collected no tests")
        if vanilla.kvpool_installed:
            problems.append("the vanilla run had kvpool installed (is KVPOOL_DISABLE ignored?)")
    if kvpool is not None and not kvpool.problem and not kvpool.kvpool_installed:
        problems.append("the kvpool run ended without kvpool installed")
    return problems


def excluded_entries(exclusions: list[Exclusion], *runs: RunResult | None) -> list[dict]:
    """Report entries for ``exclusions``: nodeid, reason, and how many collected tests
    each removed (``None`` for files left out with ``--ignore``, never collected)."""
    matched: dict[str, set[str]] = {}
    for run in runs:
        if run is not None:
            for nodeid, exclusion in run.excluded.items():
                matched.setdefault(exclusion, set()).add(nodeid)
    return [
        {
            "nodeid": e.nodeid,
            "reason": e.reason,
            "matched": None if e.is_file else len(matched.get(e.nodeid, ())),
        }
        for e in exclusions
    ]


def build_report(
    *,
    vllm_version: str,
    suites: list[str],
    vanilla: RunResult | None,
    kvpool: RunResult | None,
    exclusions: list[Exclusion],
    extra: dict | None = None,
) -> dict:
    """The conformance report (JSON-serialisable).

    Keys: ``vllm``, ``suites``, ``vanilla``/``kvpool`` (counts, or None if that mode was
    not run), ``regressions`` (nodeids), ``regression_details`` (nodeid -> kvpool
    outcome and the failure's key lines), ``fixed``, ``failed`` (per mode, every test
    that failed or errored: :func:`failed_tests`), ``excluded``
    (``[{"nodeid", "reason", "matched"}]``), ``wall_s``, ``problems``, ``exit_code``.
    """
    regressions: list[str] = []
    details: dict[str, dict] = {}
    fixed: list[str] = []
    if vanilla is not None and kvpool is not None and not vanilla.problem:
        regressions = find_regressions(vanilla, kvpool)
        fixed = find_fixed(vanilla, kvpool)
        for nodeid in regressions:
            outcome = kvpool.outcomes.get(nodeid, "not run")
            details[nodeid] = {
                "kvpool": outcome,
                "message": key_lines(kvpool.messages.get(nodeid, "")),
            }
    problems = validity_problems(vanilla, kvpool)
    report = {
        "vllm": vllm_version,
        "suites": list(suites),
        "vanilla": counts(vanilla) if vanilla is not None else None,
        "kvpool": counts(kvpool) if kvpool is not None else None,
        "regressions": regressions,
        "regression_details": details,
        "fixed": fixed,
        "failed": {
            "vanilla": failed_tests(vanilla, kvpool) if vanilla is not None else None,
            "kvpool": failed_tests(kvpool, vanilla) if kvpool is not None else None,
        },
        "excluded": excluded_entries(exclusions, vanilla, kvpool),
        "wall_s": {r.mode: round(r.wall_s, 1) for r in (vanilla, kvpool) if r is not None},
        "problems": problems,
    }
    if extra:
        report.update(extra)
    report["exit_code"] = exit_code(report)
    return report


def exit_code(report: dict) -> int:
    """0 when conformant; 1 on any regression; 2 when the runs are not comparable."""
    if report["problems"]:
        return EXIT_INVALID_RUN
    if report["regressions"]:
        return EXIT_REGRESSIONS
    return EXIT_OK


def _fmt_counts(c: dict[str, int] | None) -> str:
    if c is None:
        return "not run"
    return ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "skipped", "errors"))


def _format_failed(failed: dict, limit: int = 50) -> list[str]:
    # Every failed test of each mode by name, and whether the other mode failed it too.
    lines = []
    for mode, other in (("vanilla", "kvpool"), ("kvpool", "vanilla")):
        entries = failed.get(mode) or []
        if not entries:
            continue
        lines.append(f"  failed in the {mode} run ({len(entries)}):")
        for e in entries[:limit]:
            if e["other_outcome"] is None:
                how = f"{other} run: not run"
            elif e["same_in_other_mode"]:
                how = f"the same way in the {other} run" + (" (not kvpool's doing)" if mode == "kvpool" else "")
            else:
                how = f"{other} run: {e['other_outcome']}" + (
                    "" if e["other_outcome"] not in ("failed", "error") else ", with a different error")
            lines.append(f"    {e['nodeid']}  [{e['outcome']}; {how}]")
            last = [ln.strip() for ln in e["message"].splitlines() if ln.strip()][-1:]
            lines += [f"        {ln[:160]}" for ln in last]
        if len(entries) > limit:
            lines.append(f"    ... and {len(entries) - limit} more (see the JSON report)")
    return lines


def _format_native_path(report: dict) -> list[str]:
    """The line of ``native_manager_path`` / ``mirrored_fingerprint`` (conformance.probe),
    if the report has them."""
    if "native_manager_path" not in report and "mirrored_fingerprint" not in report:
        return []
    bound = report.get("native_manager_path")
    state = "unknown" if bound is None else ("on" if bound else "off")
    line = (f"  native KV cache manager path: {state}; mirrored vLLM sources' fingerprint "
            f"{report.get('mirrored_fingerprint') or 'unknown'}")
    error = report.get("native_manager_probe_error")
    return [line + (f" (probe: {error})" if error else "")]


def format_summary(report: dict, max_regressions: int = 50) -> str:
    """A short plain-text summary of ``report`` for the terminal."""
    wall = report.get("wall_s", {})
    lines = [
        f"vLLM {report['vllm']} conformance: {len(report['suites'])} suite(s)",
        f"  vanilla: {_fmt_counts(report['vanilla'])}" + (f"  [{wall['vanilla']:.0f} s]" if "vanilla" in wall else ""),
        f"  kvpool:  {_fmt_counts(report['kvpool'])}" + (f"  [{wall['kvpool']:.0f} s]" if "kvpool" in wall else ""),
        (f"  excluded: {len(report['excluded'])} entr{'y' if len(report['excluded']) == 1 else 'ies'}"
         f" ({sum(e['matched'] or 0 for e in report['excluded'])} collected tests deselected)"),
    ]
    lines += _format_native_path(report)
    if report["fixed"]:
        lines.append(f"  pass with kvpool but not vanilla: {len(report['fixed'])}")
    lines += _format_failed(report.get("failed") or {})
    for problem in report["problems"]:
        lines.append(f"PROBLEM: {problem}")
    regressions = report["regressions"]
    if regressions:
        lines.append(f"REGRESSIONS ({len(regressions)}): pass vanilla, not with kvpool")
        for nodeid in regressions[:max_regressions]:
            detail = report["regression_details"].get(nodeid, {})
            lines.append(f"  {nodeid}  [{detail.get('kvpool', '?')}]")
            message = detail.get("message", "")
            for ln in message.splitlines()[-3:]:
                lines.append(f"      {ln.strip()[:160]}")
        if len(regressions) > max_regressions:
            lines.append(f"  ... and {len(regressions) - max_regressions} more (see the JSON report)")
    elif report["kvpool"] is not None and not report["problems"]:
        lines.append("OK: no regressions")
    return "\n".join(lines)
