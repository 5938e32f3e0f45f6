"""kvpool's exception base (the bottom layer: imports nothing).

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


__all__ = ["KvpoolError", "NotAKvpoolPoolError", "PoolsBuiltBeforeInstallError"]
