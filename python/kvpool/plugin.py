"""vLLM plugin entry point (``vllm.general_plugins``).

vLLM loads general plugins in every process it starts (the engine core included)
before any work begins, so ``pip install kvpool`` next to vLLM is enough to run
every block pool on kvpool. ``KVPOOL_DISABLE=1`` turns it off; ``VLLM_PLUGINS``
(vLLM's own filter) can also leave it out.
"""

from __future__ import annotations

import os

from kvpool import envs

DISABLE_ENV = envs.DISABLE


def register() -> None:
    """Install kvpool into this process's vLLM, unless ``KVPOOL_DISABLE`` is on.

    vLLM calls this from ``vllm.plugins.load_general_plugins()`` without catching, so
    what it raises stops the process before the engine is built.

    Raises:
        kvpool.envs.InvalidSettingError: a ``KVPOOL_*`` variable has a value kvpool
            does not accept (``KVPOOL_ALLOCATION=foo``, ``KVPOOL_REORDER_ON_RESET=2``):
            a typo must not run vLLM silently without kvpool. ``KVPOOL_DISABLE=1`` is
            the way to run without it.

    A vLLM version kvpool does not support is logged and left vanilla (no exception),
    so a production server still starts after a vLLM upgrade; so is an untested version
    let through with ``KVPOOL_ALLOW_UNTESTED_VLLM=1`` whose self-check fails
    (``SelfCheckError``, logged with every difference it names); so are block pools that
    vLLM built before its plugins were loaded (``PoolsBuiltBeforeInstallError``: vLLM
    loads plugins before it builds an engine, so only a process that built one by hand
    first meets it).
    """
    # vLLM's logger, so the line lands wherever vLLM's own log lines go.
    from vllm.logger import init_logger

    logger = init_logger("vllm.kvpool")
    # Every variable first: a bad value stops the engine even when kvpool is disabled
    # or would not install (the operator meant something by it).
    envs.validate()
    if envs.get(DISABLE_ENV):
        logger.info("kvpool: disabled by %s=%s; vLLM's own block pool is used", DISABLE_ENV,
                    os.environ.get(DISABLE_ENV))
        return
    from kvpool import patching
    from kvpool._version import __version__
    from kvpool.errors import PoolsBuiltBeforeInstallError
    from kvpool.vllm_compat import UnsupportedVLLMVersionError

    try:
        patching.install()
    except (UnsupportedVLLMVersionError, PoolsBuiltBeforeInstallError) as e:
        # (SelfCheckError is an UnsupportedVLLMVersionError: nothing was patched.)
        logger.warning("kvpool: not activated: %s", e)
        return
    from kvpool import allocation

    window = allocation.current_lru_window()
    logger.info(
        "kvpool %s active: native block pool patched into vLLM %s (pid %d), allocation policy %s%s",
        __version__,
        patching.installed_vllm_version(),
        os.getpid(),
        allocation.current(),
        f" (lru_window {window} blocks)" if window else "",
    )
