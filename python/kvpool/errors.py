"""kvpool's exception base (the bottom layer: imports nothing).

Every exception kvpool defines derives from :class:`KvpoolError`, and also from the
built-in exception that vLLM's own code raises in the same situation, so both
``except kvpool.KvpoolError`` and existing ``except ValueError`` / ``RuntimeError`` /
``IndexError`` / ``TypeError`` clauses catch it.
"""


class KvpoolError(Exception):
    """Base of every exception kvpool defines."""


__all__ = ["KvpoolError"]
