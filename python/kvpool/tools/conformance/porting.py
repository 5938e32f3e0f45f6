"""``python -m kvpool porting --vllm-version X``: what kvpool meets in a vLLM release.

For any release on the package index the report says, summary first:

* which parts of kvpool bind in that release's environment: the block classes, each
  patch module of ``kvpool.patching.PATCH_MODULES`` (bound, or skipped and why, as a
  forced install with the self-check bypassed does it), and the native manager path
  (``manager_fast_path.matching_release()``);
* the self-check's result (:mod:`kvpool.selfcheck`: what ``install()`` refuses the
  release for);
* which definitions kvpool mirrors (``manager_fast_path.MIRRORED``) or replaces
  (``KVCacheBlock``, ``FreeKVCacheBlockQueue``, ``BlockPool``, ``BlockHashToBlockMap``)
  changed against the nearest release kvpool knows (:data:`kvpool.vllm_compat.VLLM_RELEASES`),

then the diffs. The diffs come from both releases' wheels (``pip download --no-deps``,
cached under ``$KVPOOL_CACHE_DIR/wheels``), read with ``ast``: nothing is imported. The
environment part runs ``python -m kvpool porting --probe`` in that release's
environment: this interpreter's when it has the release, else ``.venv-vllm-X``, built by
``scripts/bootstrap.sh`` when ``requirements/vllm-X.txt`` exists (docs/porting.md, step
1); without one the report says so and gives the diffs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvpool import vllm_compat
from kvpool.errors import PortingError
from kvpool.tools.conformance import porting_sources
from kvpool.tools.conformance.porting_sources import Compared, Sources
from kvpool.tools.conformance.sdist import cache_dir

#: Exit status when the report cannot be made (as ``conformance`` for a failed setup).
EXIT_SETUP_FAILED = 3
_PROBE_MARK = "KVPOOL-PORTING-PROBE "


def nearest_known(version: str) -> str:
    """The release of ``VLLM_RELEASES`` to diff ``version`` against: the newest one
    below it (the oldest when it is older than all); for a release of the table, the
    one before it (after it, for the oldest)."""
    key = vllm_compat.release_key
    known = sorted(vllm_compat.VLLM_RELEASES, key=key)
    others = [v for v in known if v != version]
    below = [v for v in others if key(v) < key(version)]
    return below[-1] if below else others[0]


# -- the probe, run in the release's environment -------------------------------------------
def probe() -> dict[str, Any]:
    """What binds in this interpreter's vLLM (run by ``--probe``; installs kvpool with
    the self-check bypassed and uninstalls it again).

    Returns:
        ``{"vllm", "selfcheck": {"differences", "seconds"} | None, "bind_error",
        "patch_modules": {module: None (bound) | why skipped}, "install_error",
        "matching_release"}``.
    """
    import kvpool
    from kvpool import introspect

    out: dict[str, Any] = {"vllm": vllm_compat.installed_vllm_version(), "selfcheck": None, "bind_error": None,
                           "patch_modules": {}, "install_error": None, "matching_release": None}
    try:
        introspect.vanilla_classes()
        introspect.kvpool_classes()
    except (ImportError, AttributeError) as e:
        out["bind_error"] = f"{type(e).__name__}: {e}"
        return out
    result = introspect.run_selfcheck()
    out["selfcheck"] = {"differences": list(result.differences), "seconds": result.seconds}
    out["matching_release"] = introspect.native_manager_release()
    try:
        introspect.install_beside_vllm_pools(force=True, skip_selfcheck=True)
    except Exception as e:
        out["install_error"] = f"{type(e).__name__}: {e}"
        return out
    try:
        skipped = introspect.skipped_patches()
        out["patch_modules"] = {m: skipped.get(m) for m in introspect.patch_modules()}
    finally:
        kvpool.uninstall()
    return out


def _probe_python(version: str, build: bool) -> tuple[Path | None, str]:
    """``(interpreter, where)`` of an environment with vLLM ``version``, or ``(None,
    why not)``."""
    from kvpool.tools.conformance import matrix

    if vllm_compat.installed_vllm_version() == version:
        return Path(sys.executable), "this interpreter's environment"
    root = matrix.source_root()
    if root is None:
        return None, "no kvpool source checkout to build an environment in"
    venv = matrix.environment_for(version, root)
    python = root / venv / "bin" / "python"
    if build and (root / "requirements" / f"vllm-{version}.txt").is_file():
        try:
            return matrix.ensure_environment(version, root), venv
        except RuntimeError as e:
            return None, str(e)
    if python.exists() and matrix._installed_vllm(python) == version:
        return python, venv
    return None, (f"no environment with vLLM {version} (write requirements/vllm-{version}.txt from the wheel's "
                  f"METADATA and build {venv}: docs/porting.md, step 1)")


def run_probe(version: str, build: bool = True) -> tuple[dict[str, Any] | None, str]:
    """``(probe() of vLLM version's environment or None, where / why not)``."""
    python, where = _probe_python(version, build)
    if python is None:
        return None, where
    proc = subprocess.run([str(python), "-m", "kvpool", "porting", "--probe"], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(_PROBE_MARK):
            return json.loads(line[len(_PROBE_MARK):]), where
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    return None, f"{where}: the probe failed ({tail[0]})"


# -- the report ----------------------------------------------------------------------------
def _environment_lines(found: dict[str, Any] | None, where: str) -> list[str]:
    if found is None:
        return [f"environment: not probed: {where}"]
    lines = [f"environment: {where} (vLLM {found['vllm']})"]
    if found["bind_error"]:
        return lines + [(f"block classes: do NOT bind ({found['bind_error']}); install() refuses before the "
                         "self-check"), "self-check: not run", "patch modules: not tried"]
    lines.append("block classes: bind (vLLM's and kvpool's classes import)")
    check = found["selfcheck"]
    if check["differences"]:
        lines.append(f"self-check: FAILS, {len(check['differences'])} difference(s) ({check['seconds'] * 1e3:.0f} ms); "
                     "install() refuses this release:")
        lines += [f"  - {d}" for d in check["differences"]]
    else:
        lines.append(f"self-check: passes ({check['seconds'] * 1e3:.0f} ms)")
    if found["install_error"]:
        lines.append(f"patch modules: install(force=True) without the self-check raised {found['install_error']}")
    else:
        lines.append("patch modules (install(force=True) without the self-check):")
        for module, why in found["patch_modules"].items():
            lines.append(f"  {module}: " + ("bound" if why is None else f"skipped ({why})"))
    release = found["matching_release"]
    lines.append("native manager path (manager_fast_path.matching_release()): "
                 + (f"bound, the mirrored sources are {release}'s" if release else
                    "off, the mirrored sources match no release of KNOWN_SOURCES"))
    return lines


def format_report(version: str, against: str, compared: list[Compared], found: dict[str, Any] | None,
                  where: str, diffs: bool = True) -> str:
    """The report: the summary (environment, self-check, patch modules, native path,
    definitions that changed), then every diff."""
    supported = "supported" if vllm_compat.is_supported(version) else "NOT supported"
    lines = [(f"kvpool porting report: vLLM {version} ({supported}), against vLLM {against}, the nearest "
              "release kvpool knows"), ""]
    lines += _environment_lines(found, where)
    counts = {s: sum(1 for c in compared if c.status == s) for s in ("same", "changed", "added", "removed", "absent")}
    lines += ["", f"definitions kvpool mirrors or replaces: {len(compared)} compared with {against}: "
              + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    for c in compared:
        if c.status not in ("same", "absent"):
            lines.append(f"  {c.status:8} {c.name} (+{c.added} -{c.removed})")
    if diffs:
        for c in compared:
            if c.diff:
                lines += ["", f"=== {c.name} ({c.status})", c.diff.rstrip("\n")]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvpool porting",
        description="What kvpool meets in a vLLM release: what binds in its environment, the self-check, "
                    "and the diffs of the definitions kvpool mirrors or replaces (docs/porting.md).")
    parser.add_argument("--vllm-version", help="the vLLM release to report on (any on the package index)")
    parser.add_argument("--against", help="the release to diff with (default: the nearest kvpool knows)")
    parser.add_argument("--no-build", action="store_true",
                        help="use an existing environment only (no scripts/bootstrap.sh)")
    parser.add_argument("--summary", action="store_true", help="the summary only, no diffs")
    parser.add_argument("--wheels", type=Path, help="wheel cache (default: $KVPOOL_CACHE_DIR/wheels)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # internal: run in the env
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.probe:
        print(_PROBE_MARK + json.dumps(probe()), flush=True)
        return 0
    if not args.vllm_version:
        print("porting: --vllm-version X is required", file=sys.stderr)
        return 2
    version = args.vllm_version
    against = args.against or nearest_known(version)
    wheels = args.wheels or cache_dir() / "wheels"
    try:
        new = Sources(porting_sources.download_wheel(version, wheels))
        old = Sources(porting_sources.download_wheel(against, wheels))
    except PortingError as e:
        print(f"porting: {e}", file=sys.stderr)
        return EXIT_SETUP_FAILED
    from kvpool.introspect import mirrored_definitions

    compared = porting_sources.compare_releases(old, new, against, version, mirrored_definitions())
    found, where = run_probe(version, build=not args.no_build)
    sys.stdout.write(format_report(version, against, compared, found, where, diffs=not args.summary))
    return 0
