"""What kvpool's native KV cache manager path does in the environment of a conformance run.

The report of each release carries ``native_manager_path`` (whether ``kvpool.install()``
binds ``kvpool._core.kv_cache_manager_allocate_slots`` as vLLM's
``KVCacheManager.allocate_slots`` there: the path is on in that release's kvpool run) and
``mirrored_fingerprint`` (:func:`kvpool.introspect.mirrored_fingerprint`:
the sha256 of the vLLM functions the native path mirrors, as installed), so that a
release whose mirrored sources changed shows it even when every test passes. Both are
read by a child process with the kvpool run's environment, never by this process (it
must not install kvpool into the vLLM it compares against).
"""

from __future__ import annotations

import json
import subprocess
import sys

#: The child's program: prints one JSON line with both fields (``null`` for one it could
#: not read) and ``error`` (the first failure, or ``null``).
PROBE = """
import json
out = {"native_manager_path": None, "mirrored_fingerprint": None, "error": None}
try:
    from kvpool import introspect
    out["mirrored_fingerprint"] = introspect.mirrored_fingerprint()
    import kvpool
    kvpool.install(force=True)
    try:
        out["native_manager_path"] = introspect.native_manager_path_bound()
    finally:
        kvpool.uninstall()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("kvpool-probe: " + json.dumps(out))
"""

_MARK = "kvpool-probe: "
PROBE_TIMEOUT_S = 300


def native_manager_probe(env: dict[str, str], python: str | None = None,
                         timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """Run :data:`PROBE` with ``python`` (default: this interpreter) in ``env``.

    Returns:
        ``{"native_manager_path": bool | None, "mirrored_fingerprint": str | None,
        "error": str | None}``; a child that crashes, times out or prints no result
        gives ``None`` for both fields and the reason in ``error`` (never raises for it).
    """
    result = {"native_manager_path": None, "mirrored_fingerprint": None, "error": None}
    try:
        proc = subprocess.run([python or sys.executable, "-c", PROBE], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        result["error"] = f"probe did not run: {e}"
        return result
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            result.update(json.loads(line[len(_MARK):]))
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    result["error"] = f"probe exited {proc.returncode}: {tail[0][:300]}"
    return result

