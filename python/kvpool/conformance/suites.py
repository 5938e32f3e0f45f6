"""The vLLM test folders the conformance runner runs, and the tests it leaves out.

Data only; the one place to edit when vLLM's test tree changes. Paths are relative to
the sdist root, as pytest prints node ids from there.

Every exclusion names a test file, a test function (all its parametrizations) or one
parametrized case, and says why it cannot run on a CPU machine without network
access. Tests that fail for kvpool-specific reasons are never excluded: those are
regressions to fix.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Test folders and files run by default: all of vLLM's v1 core tests, plus the KV
#: connector unit tests that drive the block pool through the scheduler (offloading
#: connector scheduler, remote prefill/decode lifecycles, invalid blocks, KV load
#: failure recovery, decode-bench connector) and the connectors that subclass or walk
#: the block pool (hisparse's ``SharedEventQueueBlockPool``, Mooncake store's
#: ``ExternalCachedBlockPool``, the simple CPU offload manager's free-queue walk).
DEFAULT_SUITES: tuple[str, ...] = (
    "tests/v1/core",
    "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_decode_bench_connector.py",
    "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py",
    "tests/v1/kv_connector/unit/test_error_propagation.py",
    "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py",
    "tests/v1/kv_connector/unit/test_scheduler_kv_connector_override.py",
    "tests/v1/kv_connector/unit/test_simple_cpu_offload_connector.py",
    "tests/v1/kv_connector/unit/test_nixl_simple_cpu_offload.py",
    "tests/v1/kv_connector/unit/test_hisparse_connector.py",
    "tests/v1/kv_connector/unit/test_mooncake_store_coordinator.py",
    "tests/v1/kv_connector/unit/test_mooncake_store_worker.py",
    "tests/v1/simple_kv_offload",
)

GPU = "needs a GPU"
WEIGHTS = "needs model weights (downloads and loads a model)"


@dataclass(frozen=True)
class Exclusion:
    """A test left out of both runs.

    Attributes:
        nodeid: a file (``tests/x/test_y.py``), a test (``...::test_z``, all its
            parametrizations) or one case (``...::test_z[param]``).
        reason: why it cannot run here, e.g. ``needs a GPU: CUDA graphs``.
    """

    nodeid: str
    reason: str

    def matches(self, nodeid: str) -> bool:
        """True if ``nodeid`` (a collected test) is this exclusion or lies under it."""
        return nodeid == self.nodeid or nodeid.startswith((self.nodeid + "::", self.nodeid + "["))

    @property
    def is_file(self) -> bool:
        return "::" not in self.nodeid


EXCLUSIONS: tuple[Exclusion, ...] = ()


def exclusions_for(suites: list[str] | tuple[str, ...]) -> list[Exclusion]:
    """The exclusions that lie inside any of ``suites`` (paths relative to the sdist root)."""
    chosen = []
    for exclusion in EXCLUSIONS:
        path = exclusion.nodeid.split("::", 1)[0]
        if any(path == s.rstrip("/") or path.startswith(s.rstrip("/") + "/") for s in suites):
            chosen.append(exclusion)
    return chosen
