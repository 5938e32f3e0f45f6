"""``python -m kvpool conformance``: vLLM's own tests, vanilla and with kvpool installed.

Steps: fetch the sdist of the installed vLLM (cached, sha256-checked), extract its
``tests/`` into a scratch directory with the CPU-machine fixture override and an
offline Hugging Face cache, run the suites in two fresh pytest subprocesses (vanilla;
kvpool installed by the ``-p kvpool.tools.conformance.pytest_install`` plugin), compare test
by test, print a summary and write the JSON report.

Exit status: 0 conformant, 1 regressions, 2 runs not comparable (vanilla collected
nothing, a run crashed, or a run used the wrong block pool), 3 setup failed (sdist).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

from kvpool.tools import cliargs
from kvpool.tools.conformance import probe, report as rpt, sdist as sd, suites as st, workdir as wd

MODES = ("vanilla", "kvpool")
EXIT_SETUP_FAILED = 3
DEFAULT_RUN_TIMEOUT_S = 1800
LOG_TAIL_CHARS = 3000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvpool conformance",
        description="Run vLLM's own tests (from the sdist of the installed vLLM) on vLLM's "
        "block pool and on kvpool's, and report tests that pass only on vLLM's.",
    )
    p.add_argument(
        "--suite",
        action="append",
        metavar="PATH",
        help="test folder or file relative to the sdist root (repeatable; default: "
        + ", ".join(st.DEFAULT_SUITES[:2])
        + ", ... see kvpool/tools/conformance/suites.py)",
    )
    p.add_argument("--json", metavar="PATH", type=cliargs.output_file, help="write the JSON report here")
    p.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k expression for both runs")
    p.add_argument(
        "--jobs",
        type=cliargs.positive_int,
        default=min(2, os.cpu_count() or 1),
        help="pytest processes at once; 2 runs vanilla and kvpool side by side (default: %(default)s)",
    )
    p.add_argument(
        "--mode",
        choices=("both", *MODES),
        default="both",
        help="run both modes and compare (default), or one mode only",
    )
    p.add_argument("--keep-workdir", action="store_true", help="keep the scratch directory")
    p.add_argument("--workdir", type=Path, help="scratch directory to use (kept); default: a new temp dir")
    p.add_argument("--sdist", type=cliargs.existing_file, help="use this vllm-X.tar.gz instead of fetching one")
    p.add_argument("--index-url", help="simple index to fetch the sdist from (default: pip's)")
    p.add_argument(
        "--timeout",
        type=cliargs.positive_float,
        default=DEFAULT_RUN_TIMEOUT_S,
        help="seconds each pytest run may take (default: %(default)s)",
    )
    p.add_argument(
        "--vllm-version",
        metavar="X",
        help="run against vLLM X (a release of kvpool.vllm_compat.VLLM_RELEASES) in its own "
        "environment beside .venv, built or refreshed by scripts/bootstrap.sh",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="run every release of the matrix (each in its environment) and print one table",
    )
    p.add_argument(
        "--pytest-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for both pytest runs (repeatable)",
    )
    return p


def pytest_command(
    mode: str,
    suites: list[str],
    src_root: Path,
    outcomes_path: Path,
    exclusions_path: Path,
    exclusions: list[st.Exclusion],
    keyword: str | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """The argv of one pytest run. The kvpool run loads the install plugin first, so
    kvpool is installed before pytest imports vLLM's conftest or any test module."""
    cmd = [sys.executable, "-m", "pytest"]
    if mode == "kvpool":
        cmd += ["-p", "kvpool.tools.conformance.pytest_install"]
    cmd += [
        "-p",
        "kvpool.tools.conformance.outcomes_plugin",
        f"--kvpool-outcomes={outcomes_path}",
        f"--kvpool-exclusions={exclusions_path}",
        f"--rootdir={src_root}",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        "-q",
        "-rfE",
    ]
    # Excluded files are not even imported (some fail to import on a CPU machine).
    cmd += [f"--ignore={e.nodeid}" for e in exclusions if e.is_file]
    if keyword:
        cmd += ["-k", keyword]
    cmd += list(extra or [])
    cmd += list(suites)
    return cmd


class _Run:
    def __init__(self, mode: str, cmd: list[str], env: dict[str, str], cwd: Path, workdir: Path):
        self.mode = mode
        self.cmd = cmd
        self.env = env
        self.cwd = cwd
        self.log_path = workdir / f"{mode}.log"
        self.outcomes_path = workdir / f"{mode}.json"
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.wall_s = 0.0
        self.timed_out = False

    def start(self) -> None:
        self.started = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def poll(self, deadline: float) -> bool:
        """True once the process has ended (killing it past ``deadline``)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            self.wall_s = time.monotonic() - self.started
            return True
        if time.monotonic() > deadline:
            self.timed_out = True
            self.kill()
            self.wall_s = time.monotonic() - self.started
            return True
        return False

    def kill(self) -> None:
        """Kill pytest and whatever it started (its own session, see ``start``)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def result(self) -> rpt.RunResult:
        tail = self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if self.log_path.exists() else ""
        result = rpt.RunResult.load(self.mode, self.outcomes_path, self.wall_s, log_tail=tail)
        if self.timed_out:
            result.problem = f"{self.mode} run killed after {self.wall_s:.0f} s (--timeout)"
        return result


def run_modes(runs: list[_Run], jobs: int, timeout_s: float) -> None:
    """Run ``runs`` with at most ``jobs`` at a time, each limited to ``timeout_s``."""
    pending = list(runs)
    active: list[tuple[_Run, float]] = []
    try:
        while pending or active:
            while pending and len(active) < max(1, jobs):
                run = pending.pop(0)
                run.start()
                print(f"conformance: {run.mode} run started (log: {run.log_path})", flush=True)
                active.append((run, time.monotonic() + timeout_s))
            for run, deadline in list(active):
                if run.poll(deadline):
                    active.remove((run, deadline))
                    rc = run.proc.returncode if run.proc else None
                    print(f"conformance: {run.mode} run finished in {run.wall_s:.0f} s (pytest exit {rc})", flush=True)
            time.sleep(0.2)
    finally:
        # Ctrl-C or an error here: the runs live in their own sessions and would outlive us.
        for run, _ in active:
            run.kill()


def _vllm_version() -> str:
    return metadata.version("vllm")


def _without_matrix_args(argv: list[str]) -> list[str]:
    """``argv`` less ``--vllm-version X``, ``--all`` and ``--json PATH`` (the matrix
    runner sets those per release)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--vllm-version", "--json"):
            skip = True
        elif arg != "--all" and not arg.startswith(("--vllm-version=", "--json=")):
            out.append(arg)
    return out


class _SetupFailed(Exception):
    """The run cannot start; the message goes to stderr and the exit status is
    :data:`EXIT_SETUP_FAILED`."""


def _other_vllm(args: argparse.Namespace, argv: list[str]) -> int | None:
    """``--all`` / ``--vllm-version`` for a vLLM other than this interpreter's: run it in
    the matrix's own venvs and return its exit status; ``None``: run here."""
    if not (args.all or args.vllm_version):
        return None
    from kvpool.tools.conformance import matrix
    from kvpool.vllm_compat import VLLM_RELEASES

    forwarded = _without_matrix_args(argv)
    if args.all:
        return matrix.run_matrix(forwarded, args.json)
    if args.vllm_version not in VLLM_RELEASES:
        print(
            f"conformance: vLLM {args.vllm_version} is not in kvpool's matrix ({', '.join(VLLM_RELEASES)})",
            file=sys.stderr,
        )
        return EXIT_SETUP_FAILED
    installed = None
    with contextlib.suppress(metadata.PackageNotFoundError):
        installed = _vllm_version()
    if installed != args.vllm_version:
        return matrix.run_version(args.vllm_version, forwarded, args.json)[0]
    return None


def _extract_suites(args: argparse.Namespace, vllm_version: str, suites: list[str],
                    src_root: Path) -> tuple[str | Path, list[str]]:
    """vLLM's tests from the sdist into ``src_root``: ``(sdist path, suites it has)``.

    Raises:
        _SetupFailed: no sdist, or an explicitly asked suite is not in it.
    """
    if src_root.exists():
        shutil.rmtree(src_root)
    try:
        tarball = args.sdist or sd.fetch_sdist(vllm_version, index_url=args.index_url)
        sd.extract_tests(Path(tarball), src_root, (*sd.EXTRACT_MEMBERS, *st.data_files(vllm_version)))
    except (sd.SdistError, tarfile.TarError, OSError) as e:
        raise _SetupFailed(f"conformance: {e}") from e
    absent = [f for f in st.data_files(vllm_version) if not (src_root / f).is_file()]
    if absent:  # the tests that read them fail, in both runs
        print(f"conformance: data files not in the vLLM {vllm_version} sdist: {', '.join(absent)}", flush=True)
    missing = [s for s in suites if not (src_root / s.split("::", 1)[0]).exists()]
    if missing and not args.suite:
        # A default suite an older release does not have yet: run the others.
        print(f"conformance: not in the vLLM {vllm_version} sdist, left out: {', '.join(missing)}", flush=True)
        return tarball, [s for s in suites if s not in missing]
    if missing:
        raise _SetupFailed(f"conformance: not in the vLLM {vllm_version} sdist: {', '.join(missing)}")
    return tarball, suites


def _run(args: argparse.Namespace, vllm_version: str, suites: list[str], modes: list[str],
         workdir: Path, keep: bool, t0: float) -> int:
    """Set up ``workdir``, run the suites in each mode, write and print the report."""
    src_root = workdir / "src"
    tarball, suites = _extract_suites(args, vllm_version, suites, src_root)
    wd.write_overrides(src_root, suites)
    hf_home = wd.prepare_hf_home(workdir)
    exclusions = st.exclusions_for(suites)
    exclusions_path = workdir / "exclusions.json"
    exclusions_path.write_text(json.dumps([{"nodeid": e.nodeid, "reason": e.reason} for e in exclusions]))
    print(
        f"conformance: vLLM {vllm_version} tests in {src_root} ({time.monotonic() - t0:.1f} s setup); "
        f"{len(suites)} suite(s), {len(exclusions)} exclusion(s), modes: {', '.join(modes)}",
        flush=True,
    )
    native = probe.native_manager_probe(wd.run_environment(dict(os.environ), hf_home, "kvpool"))
    runs = []
    for mode in modes:
        outcomes_path = workdir / f"{mode}.json"
        if outcomes_path.exists():
            outcomes_path.unlink()
        cmd = pytest_command(
            mode, suites, src_root, outcomes_path, exclusions_path, exclusions, args.keyword, args.pytest_arg
        )
        env = wd.run_environment(dict(os.environ), hf_home, mode)
        runs.append(_Run(mode, cmd, env, src_root, workdir))
    run_modes(runs, args.jobs, args.timeout)
    results = {run.mode: run.result() for run in runs}
    report = rpt.build_report(
        vllm_version=vllm_version,
        suites=suites,
        vanilla=results.get("vanilla"),
        kvpool=results.get("kvpool"),
        exclusions=exclusions,
        extra={
            "sdist": str(tarball),
            "jobs": args.jobs,
            "keyword": args.keyword,
            "total_wall_s": round(time.monotonic() - t0, 1),
            "workdir": str(workdir) if keep else None,
            # kvpool.install() in this environment (conformance.probe): the native
            # manager path bound or not, and the mirrored vLLM sources' sha256.
            "native_manager_path": native["native_manager_path"],
            "mirrored_fingerprint": native["mirrored_fingerprint"],
            "native_manager_probe_error": native["error"],
            "pytest": {
                run.mode: {
                    "argv": run.cmd[1:],
                    "exit_status": results[run.mode].exitstatus,
                    "collected": results[run.mode].collected,
                }
                for run in runs
            },
        },
    )
    if args.json:  # the results first, before anything else can fail
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(rpt.format_summary(report))
    print(f"conformance: total {report['total_wall_s']:.0f} s", flush=True)
    if args.json:
        print(f"conformance: report written to {args.json}")
    return report["exit_code"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    status = _other_vllm(args, argv)
    if status is not None:
        return status
    modes = list(MODES) if args.mode == "both" else [args.mode]
    try:
        vllm_version = _vllm_version()
    except metadata.PackageNotFoundError:
        print("conformance: vLLM is not installed in this interpreter", file=sys.stderr)
        return EXIT_SETUP_FAILED
    suites = [s.rstrip("/") for s in (args.suite or st.default_suites(vllm_version))]

    t0 = time.monotonic()
    if args.workdir is not None:
        workdir = args.workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        keep = True
    else:
        workdir = Path(tempfile.mkdtemp(prefix="kvpool-conformance-"))
        keep = args.keep_workdir
    try:
        return _run(args, vllm_version, suites, modes, workdir, keep, t0)
    except _SetupFailed as e:
        print(e, file=sys.stderr)
        return EXIT_SETUP_FAILED
    finally:
        if keep:
            print(f"conformance: scratch directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
