"""``conformance --vllm-version X`` / ``--all``: one environment per vLLM release.

Each release of :data:`kvpool.vllm_compat.VLLM_RELEASES` gets its own environment
beside ``.venv`` (``.venv-vllm-X``; the release ``.venv`` already holds is run there),
built or refreshed by ``scripts/bootstrap.sh`` with ``KVPOOL_VLLM_VERSION=X`` and that
release's pins (``requirements/vllm-X.txt``). The conformance run itself is the
ordinary one, started with that environment's interpreter; ``--all`` runs every
release in turn and prints one table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvpool import envs
from kvpool.vllm_compat import SUPPORTED_VLLM_VERSIONS, VLLM_RELEASES

#: Exit status when an environment cannot be built (as for a failed sdist fetch).
EXIT_SETUP_FAILED = 3


def source_root() -> Path | None:
    """The kvpool checkout this package runs from (editable install), or None."""
    root = Path(__file__).resolve().parents[4]
    return root if (root / "scripts" / "bootstrap.sh").is_file() else None


def _installed_vllm(python: Path) -> str | None:
    proc = subprocess.run(
        [str(python), "-c", "from importlib.metadata import version; print(version('vllm'))"],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def environment_for(version: str, root: Path) -> str:
    """The virtual environment of ``version``, relative to ``root``: ``.venv`` when it
    holds that release (the default environment), else ``.venv-vllm-X``."""
    default = root / ".venv" / "bin" / "python"
    if default.exists() and _installed_vllm(default) == version:
        return ".venv"
    return f".venv-vllm-{version}"


def ensure_environment(version: str, root: Path) -> Path:
    """Build or refresh the environment of ``version`` (``scripts/bootstrap.sh``: the
    first time about 2 minutes, then only kvpool's rebuild); return its interpreter.

    Raises:
        RuntimeError: ``scripts/bootstrap.sh`` failed (its output is printed).
    """
    venv = environment_for(version, root)
    env = dict(os.environ, **{envs.VLLM_VERSION: version, envs.VENV: venv})
    print(f"conformance: environment for vLLM {version}: {venv} (scripts/bootstrap.sh)", flush=True)
    proc = subprocess.run(["bash", str(root / "scripts" / "bootstrap.sh")], cwd=root, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/bootstrap.sh failed for vLLM {version} (exit {proc.returncode})")
    return root / venv / "bin" / "python"


def run_version(version: str, forwarded: list[str], json_path: Path | None) -> tuple[int, dict | None]:
    """Run the conformance command for ``version`` in its environment.

    Args:
        version: the vLLM release (``"0.34.0"``), run in ``.venv-vllm-<version>``.
        forwarded: the command's other arguments, passed on unchanged.
        json_path: where that run writes its report (also returned, parsed).

    Returns:
        ``(exit status, report or None)``.
    """
    root = source_root()
    if root is None:
        print("conformance: --vllm-version/--all need a kvpool source checkout (scripts/bootstrap.sh)", file=sys.stderr)
        return EXIT_SETUP_FAILED, None
    if _installed_vllm(Path(sys.executable)) == version:
        python = Path(sys.executable)  # this interpreter's own environment: as it is
    else:
        try:
            python = ensure_environment(version, root)
        except RuntimeError as e:
            print(f"conformance: {e}", file=sys.stderr)
            return EXIT_SETUP_FAILED, None
    argv = [str(python), "-m", "kvpool", "conformance", *forwarded]
    if json_path is not None:
        argv += ["--json", str(json_path)]
    rc = subprocess.run(argv, cwd=root).returncode
    report = None
    if json_path is not None and json_path.exists():
        report = json.loads(json_path.read_text())
    return rc, report


def table_row(version: str, rc: int, report: dict | None) -> dict:
    """One row of the ``--all`` table."""
    row = {"vllm": version, "exit_code": rc, "supported": version in SUPPORTED_VLLM_VERSIONS}
    if report is None:
        return row
    excluded = sum(e.get("matched") or 0 for e in report.get("excluded", []))
    row.update(
        vanilla_passed=(report.get("vanilla") or {}).get("passed"),
        kvpool_passed=(report.get("kvpool") or {}).get("passed"),
        regressions=len(report.get("regressions", [])),
        excluded=excluded,
        problems=len(report.get("problems", [])),
        total_wall_s=report.get("total_wall_s"),
        native_manager_path=report.get("native_manager_path"),
        mirrored_fingerprint=report.get("mirrored_fingerprint"),
    )
    return row


def format_table(rows: list[dict]) -> str:
    """The matrix as a Markdown table (the README's support matrix)."""

    def cell(row: dict, key: str) -> str:
        value = row.get(key)
        return "-" if value is None else str(value)

    lines = [
        "| vLLM | vanilla passed | kvpool passed | regressions | excluded | exit | supported | native manager path |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        native = {True: "on", False: "off"}.get(row.get("native_manager_path"), "-")
        if row.get("mirrored_fingerprint"):
            native += f" ({row['mirrored_fingerprint'][:12]})"
        lines.append(
            f"| {row['vllm']} | {cell(row, 'vanilla_passed')} | {cell(row, 'kvpool_passed')} | "
            f"{cell(row, 'regressions')} | {cell(row, 'excluded')} | {row['exit_code']} | "
            f"{'yes' if row['supported'] else 'no'} | {native} |"
        )
    return "\n".join(lines)


def run_matrix(forwarded: list[str], json_path: Path | None) -> int:
    """``--all``: every release of the table, one after the other; the worst exit
    status. ``json_path`` receives ``{"rows": [...], "reports": {version: report}}``."""
    rows, reports = [], {}
    with tempfile.TemporaryDirectory(prefix="kvpool-matrix-") as tmp:
        for version in VLLM_RELEASES:
            print(f"== conformance: vLLM {version}", flush=True)
            rc, report = run_version(version, forwarded, Path(tmp) / f"{version}.json")
            rows.append(table_row(version, rc, report))
            reports[version] = report
    print(format_table(rows))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"rows": rows, "reports": reports}, indent=2) + "\n")
        print(f"conformance: matrix report written to {json_path}")
    return max(row["exit_code"] for row in rows)
