"""Every ``KVPOOL_*`` environment variable kvpool reads, and the one rule that parses it.

The bottom layer of the package: it imports nothing from kvpool but the exception base
(:mod:`kvpool.errors`, which imports nothing), and ``vllm_compat``, ``patching``, the
plugin and the CLIs read their settings through it, so any layer can use it.

One parsing rule for every variable of a kind:

* **switches** (``KVPOOL_DISABLE``, ``KVPOOL_REORDER_ON_RESET``, ``KVPOOL_CPU_PLATFORM``, ...): on is ``1``,
  ``true``, ``yes``, ``on``; off is ``0``, ``false``, ``no``, ``off`` or unset/empty;
  case-insensitive, surrounding blanks ignored. Anything else (``2``, ``foo``) is an
  :class:`InvalidSettingError`, never read as off.
* **choices** (``KVPOOL_ALLOCATION``): one of the listed names, case-insensitive;
  unset/empty means the default.
* **seconds** (``KVPOOL_METRICS_INTERVAL_S``): a finite float >= 0.
* **blocks** (``KVPOOL_LRU_WINDOW``): an integer >= 0; unset/empty means the default.
* **paths and URLs** (``KVPOOL_CACHE_DIR``, ``KVPOOL_INDEX_URL``): any non-empty
  string; unset/empty means the default.

Variables read only by the shell scripts (``scripts/bootstrap.sh``:
``KVPOOL_VLLM_VERSION``, ``KVPOOL_VENV``, ``KVPOOL_TORCH_VERSION``, ``KVPOOL_WHEEL``;
``scripts/build-wheel.sh``: ``KVPOOL_WHEEL_ARCHS``, ``KVPOOL_BUILD_SUFFIX``;
``scripts/test-python.sh``: ``KVPOOL_CHROOT_DIR``, ...) and by
kvpool's own tests (``KVPOOL_DIFF_OPS``, ...) are listed in :data:`SCRIPT_VARIABLES`
so this module names every ``KVPOOL_*`` variable of the project.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.errors import InvalidSettingError  # (defined there, re-exported here)

#: Values that turn a switch on / off (compared after ``strip().lower()``).
TRUE_VALUES: tuple[str, ...] = ("1", "true", "yes", "on")
FALSE_VALUES: tuple[str, ...] = ("0", "false", "no", "off", "")

DISABLE = "KVPOOL_DISABLE"
ALLOCATION = "KVPOOL_ALLOCATION"
LRU_WINDOW = "KVPOOL_LRU_WINDOW"
REORDER_ON_RESET = "KVPOOL_REORDER_ON_RESET"
REORDER_ON_IDLE = "KVPOOL_REORDER_ON_IDLE"
ALLOW_UNTESTED_VLLM = "KVPOOL_ALLOW_UNTESTED_VLLM"
METRICS_INTERVAL_S = "KVPOOL_METRICS_INTERVAL_S"
PYTHON_MANAGER = "KVPOOL_PYTHON_MANAGER"
CACHE_DIR = "KVPOOL_CACHE_DIR"
INDEX_URL = "KVPOOL_INDEX_URL"
CPU_PLATFORM = "KVPOOL_CPU_PLATFORM"
# Read by scripts/bootstrap.sh; conformance's matrix sets them for it.
VLLM_VERSION = "KVPOOL_VLLM_VERSION"
VENV = "KVPOOL_VENV"

#: The allocation policies ``KVPOOL_ALLOCATION`` (and ``install(allocation=...)``) accept.
ALLOCATION_POLICIES: tuple[str, ...] = ("vllm", "contiguous")


@dataclass(frozen=True)
class Variable:
    """One ``KVPOOL_*`` variable the package reads.

    Attributes:
        name: ``"KVPOOL_ALLOCATION"``.
        kind: ``"switch"``, ``"choice"``, ``"seconds"``, ``"blocks"`` or ``"text"`` (the
            parsing rule).
        default: the value when unset or empty (already parsed).
        help: what it does, one line.
        choices: for ``"choice"``: the accepted names.
        argument: the ``kvpool.install()`` argument that overrides it, if any.
    """

    name: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    argument: str | None = None

    def accepted(self, argument: bool = False) -> str:
        """The accepted values, as an error message names them (``argument``: for the
        ``install()`` argument, where empty is not a value)."""
        if self.kind == "switch":
            return f"on: {', '.join(TRUE_VALUES)}; off: {', '.join(v for v in FALSE_VALUES if v)} or empty"
        if self.kind == "choice":
            return ", ".join(self.choices) + ("" if argument else " (or empty for the default)")
        if self.kind == "seconds":
            return "a number of seconds >= 0"
        if self.kind == "blocks":
            return "a whole number of blocks >= 0"
        return "any non-empty text (empty: the default)"

    def parse(self, value: Any) -> Any:
        """Parse ``value`` (a string from the environment, or ``None`` when unset).

        Returns:
            ``bool`` (switch), ``str`` (choice, lower-cased; text), ``float`` (seconds),
            ``int`` (blocks), or :attr:`default` for unset/empty.

        Raises:
            InvalidSettingError: not one of the accepted values, or not a string.
        """
        if value is None:
            return self.default
        if not isinstance(value, str):
            raise InvalidSettingError(self.name, value, self.accepted())
        text = value.strip()
        if self.kind == "switch":
            low = text.lower()
            if low in TRUE_VALUES:
                return True
            if low in FALSE_VALUES:
                return False
        elif not text:
            return self.default
        elif self.kind == "choice":
            if text.lower() in self.choices:
                return text.lower()
        elif self.kind == "seconds":
            try:
                seconds = float(text)
            except ValueError:
                seconds = math.nan
            if math.isfinite(seconds) and seconds >= 0:
                return seconds
        elif self.kind == "blocks":
            if text.isdigit() and text.isascii() and int(text) < 2**31:
                return int(text)
        else:
            return text
        raise InvalidSettingError(self.name, value, self.accepted())


#: Every variable the package reads, by name.
VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(DISABLE, "switch", False,
                 "the vLLM plugin does not install kvpool (an explicit kvpool.install() still does)"),
        Variable(ALLOCATION, "choice", "vllm",
                 "allocation policy of kvpool's pools: vllm (vLLM's exact order) or contiguous",
                 choices=ALLOCATION_POLICIES, argument="allocation"),
        Variable(LRU_WINDOW, "blocks", 0,
                 "contiguous policy: an allocation taking m LRU blocks may take any m of the m + W "
                 "oldest when that makes fewer runs of consecutive ids (0: vLLM's exact LRU)",
                 argument="lru_window"),
        Variable(REORDER_ON_RESET, "switch", False,
                 "every successful reset_prefix_cache() also restores the canonical free-queue order"),
        Variable(REORDER_ON_IDLE, "switch", False,
                 "restore the uncached free blocks' order whenever the pool empties (vllm policy)"),
        Variable(ALLOW_UNTESTED_VLLM, "switch", False,
                 "install into a vLLM release outside the supported list", argument="force"),
        Variable(PYTHON_MANAGER, "switch", False,
                 "KVCacheManager.allocate_slots and KVCacheBlocks.get_block_ids stay vLLM's Python "
                 "(off: a running request's allocate_slots runs natively where it can)"),
        Variable(METRICS_INTERVAL_S, "seconds", 1.0,
                 "seconds between two reads of the pool's fragmentation stats in the engine core"),
        Variable(CPU_PLATFORM, "switch", False,
                 "vLLM's platform is kvpool.cpu_platform (vLLM's CPU platform whose config check does "
                 "not require triton-cpu; VLLM_TARGET_DEVICE must not be cpu); only for CPU machines"),
        Variable(CACHE_DIR, "text", "~/.cache/kvpool",
                 "conformance: where vLLM sdists are downloaded"),
        Variable(INDEX_URL, "text", None,
                 "conformance: package index for vLLM's sdist (default: the one pip download uses)"),
    )
}

#: ``KVPOOL_*`` variables of the scripts and tests (never read by the package).
SCRIPT_VARIABLES: dict[str, str] = {
    VLLM_VERSION: "scripts/bootstrap.sh: the vLLM release of the environment (default 0.34.0)",
    VENV: "scripts/bootstrap.sh: the environment's folder (default .venv)",
    "KVPOOL_TORCH_VERSION": "scripts/bootstrap.sh: the torch version (default 2.13.0)",
    "KVPOOL_WHEEL": "scripts/bootstrap.sh: install this wheel instead of the editable build",
    "KVPOOL_WHEEL_ARCHS": "scripts/build-wheel.sh: the architectures to build (default: x86_64 aarch64)",
    "KVPOOL_WHEEL_CXXFLAGS": "scripts/build-wheel.sh: extra compiler flags (default: -Xclang -O3 -fomit-frame-pointer)",
    "KVPOOL_BUILD_SUFFIX": "scripts/build-wheel.sh: suffix of the build folders (chroots)",
    "KVPOOL_CHROOT_DIR": ("scripts/test-python.sh, scripts/test-arch.sh: where the Debian chroots live "
                          "(default /var/tmp/kvpool-chroots)"),
    "KVPOOL_PY_ROUTE": "scripts/test-python.sh: chroot or pyenv forces that route to the interpreter",
    "KVPOOL_PY_CONFORMANCE": "scripts/test-python.sh: 0 skips vLLM's own tests after kvpool's suite",
    "KVPOOL_ARCH_WHEEL": "scripts/test-arch.sh: the wheel to install in the arm64 chroot (internal)",
    "KVPOOL_IN_CHROOT": "scripts/test-python.sh, scripts/test-arch.sh: set inside the chroot (internal)",
    "KVPOOL_PY_VENV": "scripts/test-python.sh: the environment's folder",
    "KVPOOL_DIFF_OPS": "tests: operations of the long differential (default 10000)",
    "KVPOOL_DIFF_SEED": "tests: seed of the differentials",
    "KVPOOL_MANAGER_DIFF_OPS": "tests: operations of the KV cache manager differential (default 20000)",
    "KVPOOL_HYBRID_DIFF_OPS": ("tests: operations of the hybrid step's differential "
                               "(default: KVPOOL_MANAGER_DIFF_OPS)"),
    "KVPOOL_SCHED_DIFF_STEPS": "tests: engine steps of the scheduler-level differential (default 10000)",
    "KVPOOL_POLICY_DIFF_OPS": "tests: operations of the policy differential (default 20000)",
    "KVPOOL_LEAK_OPS": "tests: operations of the leak check (default 100000)",
    "KVPOOL_LEAK_SEED": "tests: seed of the leak check",
    "KVPOOL_FAILMALLOC": "tests: path of the failing-allocation shim the fault sweep loads",
    "KVPOOL_FAULT_MAX_K": "tests: the fault sweep's largest allocation index to fail (default 5000)",
    "KVPOOL_FAULT_KEEP_GOING": "tests: manager_fault.py reports each failed check and goes on (any value)",
}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of variable ``name`` (default: from ``os.environ``).

    Raises:
        KeyError: ``name`` is not one of :data:`VARIABLES`.
        InvalidSettingError: its value is not accepted.
    """
    env = os.environ if environ is None else environ
    return VARIABLES[name].parse(env.get(name))


def check_argument(name: str, value: Any) -> Any:
    """Parse an ``install()`` argument with its variable's rule (``None``: not given).

    Args:
        name: the variable the argument overrides (``ALLOCATION``).
        value: the argument (``allocation="contiguous"``).

    Raises:
        InvalidSettingError: not accepted (named by the argument, e.g. ``allocation=1``).
    """
    var = VARIABLES[name]
    if value is None:
        return None
    if var.kind == "switch" and isinstance(value, bool):
        return value
    if var.kind == "blocks" and not isinstance(value, (bool, str)) and hasattr(type(value), "__index__"):
        try:
            blocks = operator.index(value)  # an int, numpy's integers
        except Exception:  # noqa: BLE001 - a broken __index__ is a bad value
            blocks = -1
        if 0 <= blocks < 2**31:
            return blocks
        raise InvalidSettingError(var.argument or name, value, var.accepted(argument=True))
    try:
        parsed = var.parse(value)
    except InvalidSettingError:
        raise InvalidSettingError(var.argument or name, value, var.accepted(argument=True)) from None
    if isinstance(value, str) and not value.strip():
        raise InvalidSettingError(var.argument or name, value, var.accepted(argument=True))
    return parsed


def validate(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Parse every variable of :data:`VARIABLES` at once.

    Returns:
        ``{name: parsed value}``.

    Raises:
        InvalidSettingError: the first variable (in :data:`VARIABLES` order) whose
            value is not accepted.
    """
    return {name: get(name, environ) for name in VARIABLES}


@dataclass(frozen=True)
class Setting:
    """One row of :func:`effective`: a setting's value and where it came from."""

    name: str
    value: Any
    source: str  # "environment", "default", "install argument", or "invalid"
    raw: str | None
    error: str | None = None


def effective(arguments: Mapping[str, Any] | None = None,
              environ: Mapping[str, str] | None = None) -> list[Setting]:
    """Every variable's effective value and its source, for ``python -m kvpool info``.

    Args:
        arguments: ``install()`` arguments in force, by variable name (those not None
            win over the environment, as in ``install()``).
        environ: the environment (default ``os.environ``).

    Returns:
        One :class:`Setting` per :data:`VARIABLES` entry; an invalid value is reported
        (``source="invalid"``, ``error`` set) instead of raised.
    """
    env = os.environ if environ is None else environ
    arguments = arguments or {}
    out = []
    for name, var in VARIABLES.items():
        raw = env.get(name)
        if arguments.get(name) is not None:
            out.append(Setting(name, arguments[name], "install argument", raw))
            continue
        try:
            value = var.parse(raw)
        except InvalidSettingError as e:
            out.append(Setting(name, None, "invalid", raw, str(e)))
            continue
        source = "environment" if raw is not None and raw.strip() else "default"
        out.append(Setting(name, value, source, raw))
    # The one combination rule: an LRU window needs the contiguous policy (as install()).
    rows = {r.name: i for i, r in enumerate(out)}
    window, policy = out[rows[LRU_WINDOW]], out[rows[ALLOCATION]]
    if window.value and policy.value != "contiguous" and policy.source != "invalid":
        out[rows[LRU_WINDOW]] = Setting(
            LRU_WINDOW, None, "invalid", window.raw,
            f"{LRU_WINDOW}={window.value!r} needs {ALLOCATION}=contiguous (allocation is {policy.value!r})")
    return out


__all__ = [
    "ALLOCATION_POLICIES",
    "FALSE_VALUES",
    "SCRIPT_VARIABLES",
    "TRUE_VALUES",
    "VARIABLES",
    "InvalidSettingError",
    "Setting",
    "Variable",
    "check_argument",
    "effective",
    "get",
    "validate",
]
