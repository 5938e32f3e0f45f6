"""Every public exception kvpool defines, in one place (the bottom layer: imports
nothing); the extension's own, ``BlockStateError`` and ``BlockIdOutOfRangeError``, are in
``src/kvpool/errors.pxi``. The modules that raise them re-export them under their old
names (``kvpool.envs.InvalidSettingError``, ...).

Every exception kvpool defines derives from :class:`KvpoolError`, and also from the
built-in exception that vLLM's own code raises in the same situation, so both
``except kvpool.KvpoolError`` and existing ``except ValueError`` / ``RuntimeError`` /
``IndexError`` / ``TypeError`` clauses catch it.
"""


class KvpoolError(Exception):
    """Base of every exception kvpool defines."""


class NotAKvpoolPoolError(KvpoolError, TypeError):
    """A kvpool addition called on a pool that kvpool did not build: a ``BlockPool``
    subclass that skipped ``BlockPool.__init__`` or replaced its ``free_block_queue``
    with another kind of queue (vLLM's own methods still work on it)."""


class PoolsBuiltBeforeInstallError(KvpoolError, RuntimeError):
    """``kvpool.install()`` found vLLM block pools that vLLM built before it (their blocks
    and prefix-cache map are vLLM's classes, which vLLM's code stops accepting once
    kvpool's classes are bound). Nothing was changed: install kvpool before building the
    engine, or let vLLM load kvpool's plugin, which does so in every vLLM process."""


class UnsupportedVLLMVersionError(KvpoolError, RuntimeError):
    """The installed vLLM is not one kvpool has been validated against."""


class MissingPatchTargetError(UnsupportedVLLMVersionError):
    """The installed vLLM lacks a class or method that kvpool's patch table extends
    (a release outside the supported list). ``install()`` skips that patch module on a
    forced untested release and raises this on a supported one."""


class SelfCheckError(UnsupportedVLLMVersionError):
    """``install()`` on a vLLM release outside the supported list (forced) ran the
    self-check (:mod:`kvpool.selfcheck`) and found that release's classes differ from
    what kvpool's assume; nothing was patched. The message names each difference.

    Attributes:
        vllm_version: the installed vLLM's version.
        differences: one line per difference (``"BlockHashToBlockMap.__init__: vLLM
            takes (self, blocks), kvpool's takes (self)"``).
    """

    def __init__(self, vllm_version: str, differences: tuple[str, ...] | list[str], kvpool_version: str = ""):
        self.vllm_version = vllm_version
        self.differences = tuple(differences)
        lines = "".join(f"\n  - {d}" for d in self.differences)
        super().__init__(
            f"kvpool {kvpool_version} does not install into vLLM {vllm_version}: its self-check found "
            f"{len(self.differences)} difference(s) between vLLM's block pool classes and what kvpool's "
            f"assume; nothing was patched (`python -m kvpool porting --vllm-version {vllm_version}` "
            f"reports them with the source diffs):{lines}")


class InvalidSettingError(KvpoolError, ValueError):
    """A ``KVPOOL_*`` variable (or the ``install()`` argument it stands for) has a value
    kvpool does not accept. The message names the variable, the value and the accepted
    values.

    Attributes:
        name: the variable (``"KVPOOL_ALLOCATION"``) or argument (``"allocation"``).
        value: the value as given.
        accepted: human-readable accepted values.
    """

    def __init__(self, name: str, value: object, accepted: str):
        self.name, self.value, self.accepted = name, value, accepted
        super().__init__(f"{name}={value!r} is not a valid setting; accepted: {accepted}")


class LazyOffloadOrderError(KvpoolError, ValueError):
    """vLLM's lazy CPU offloader was bound to a kvpool pool whose allocation policy
    does not keep vLLM's free-queue order (it would get other stores and fewer CPU
    hits than on vLLM's pool)."""


class LayoutError(KvpoolError, ValueError):
    """A layout cannot provide the blocks a batch needs (pool too small, unknown name)."""


class ModeUnavailable(KvpoolError, RuntimeError):
    """A requested mode cannot run here (kvpool or its built extension not importable,
    no reorder API)."""


class SdistError(KvpoolError, RuntimeError):
    """The sdist could not be found, downloaded or verified."""


class PortingError(KvpoolError, RuntimeError):
    """``python -m kvpool porting`` could not get what its report needs (a vLLM
    version that is not on the package index, a wheel without the sources)."""


class KvpoolInstallError(KvpoolError, RuntimeError):
    """kvpool could not be installed into vLLM for the conformance run."""


class NixlUnavailable(KvpoolError, RuntimeError):
    """``replay --nixl``: NIXL cannot be imported here (the message names the install
    command)."""


class NixlTransferError(KvpoolError, RuntimeError):
    """``replay --nixl``: a transfer failed, timed out, or moved bytes other than the
    prefill side's."""


__all__ = [
    "InvalidSettingError",
    "KvpoolError",
    "KvpoolInstallError",
    "LayoutError",
    "LazyOffloadOrderError",
    "MissingPatchTargetError",
    "ModeUnavailable",
    "NixlTransferError",
    "NixlUnavailable",
    "NotAKvpoolPoolError",
    "PoolsBuiltBeforeInstallError",
    "PortingError",
    "SdistError",
    "SelfCheckError",
    "UnsupportedVLLMVersionError",
]
