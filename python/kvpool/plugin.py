"""vLLM plugin entry point (``vllm.general_plugins``).

vLLM loads general plugins in every process it starts (the engine core included)
before any work begins, so ``pip install kvpool`` next to vLLM is enough to run
every block pool on kvpool. ``KVPOOL_DISABLE=1`` turns it off; ``VLLM_PLUGINS``
(vLLM's own filter) can also leave it out.
"""

from __future__ import annotations

import os

DISABLE_ENV = "KVPOOL_DISABLE"


def register() -> None:
    """Install kvpool into this process's vLLM, unless ``KVPOOL_DISABLE=1``.

    Never raises: a vLLM version kvpool does not support is logged and left vanilla,
    so a production server still starts.
    """
    # vLLM's logger, so the line lands wherever vLLM's own log lines go.
    from vllm.logger import init_logger

    logger = init_logger("vllm.kvpool")
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        logger.info("kvpool: disabled by %s=1; vLLM's own block pool is used", DISABLE_ENV)
        return
    from kvpool import __version__, patching
    from kvpool.vllm_compat import UnsupportedVLLMVersionError

    try:
        patching.install()
    except UnsupportedVLLMVersionError as e:
        logger.warning("kvpool: not activated: %s", e)
        return
    except ValueError as e:  # an unknown KVPOOL_ALLOCATION
        logger.warning("kvpool: not activated: %s", e)
        return
    from kvpool import allocation

    logger.info(
        "kvpool %s active: native block pool patched into vLLM %s (pid %d), allocation policy %s",
        __version__,
        patching.installed_vllm_version(),
        os.getpid(),
        allocation.current(),
    )
