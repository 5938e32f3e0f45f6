"""Offline Hugging Face cache built from the model config files kvpool ships.

vLLM's ``ModelConfig`` resolves a model name through ``huggingface_hub``. kvpool's
replay job and conformance runner must not download anything at run time, so they lay
the small public config files under ``kvpool/tools/hf_configs/ORG--NAME/`` into a throwaway
cache with the layout ``huggingface_hub`` expects and run with ``HF_HUB_OFFLINE=1``::

    $HF_HOME/hub/models--ORG--NAME/refs/main            -> "<revision>"
    $HF_HOME/hub/models--ORG--NAME/snapshots/<revision>/config.json, ...

Only configuration (and, where a test needs them, tokenizer/processor) files are
shipped; no weights.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

CONFIG_ROOT = Path(__file__).with_name("hf_configs")

#: Environment that makes ``huggingface_hub``/``transformers`` stay offline.
OFFLINE_FLAGS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def shipped_models() -> list[str]:
    """Model names (``ORG/NAME``) whose config files kvpool ships, sorted."""
    return sorted(p.name.replace("--", "/", 1) for p in CONFIG_ROOT.iterdir() if p.is_dir())


def _revision(model_dir: Path) -> str:
    digest = hashlib.sha1()
    for f in sorted(model_dir.rglob("*")):
        if f.is_file():
            digest.update(f.relative_to(model_dir).as_posix().encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()


def materialize_hf_cache(hf_home: str | os.PathLike, models: Iterable[str] | None = None) -> Path:
    """Lay the shipped configs of ``models`` (default: all) into ``hf_home``.

    Args:
        hf_home: directory to use as ``HF_HOME``; created if missing.
        models: ``ORG/NAME`` strings; each must be in :func:`shipped_models`.

    Returns:
        ``Path(hf_home)``.

    Raises:
        KeyError: a requested model has no shipped config.
    """
    hf_home = Path(hf_home)
    hub = hf_home / "hub"
    names = shipped_models() if models is None else list(models)
    for name in names:
        src = CONFIG_ROOT / name.replace("/", "--", 1)
        if not src.is_dir():
            raise KeyError(f"kvpool ships no config for {name!r}; shipped: {shipped_models()}")
        repo = hub / f"models--{name.replace('/', '--')}"
        rev = _revision(src)
        snap = repo / "snapshots" / rev
        if not snap.is_dir():
            shutil.copytree(src, snap, dirs_exist_ok=True)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    return hf_home


def offline_env(hf_home: str | os.PathLike) -> dict[str, str]:
    """Environment variables that point Hugging Face libraries at ``hf_home``, offline."""
    return {"HF_HOME": str(hf_home), **OFFLINE_FLAGS}


@contextmanager
def offline_hf_cache(models: Iterable[str] | None = None) -> Iterator[Path]:
    """Set ``HF_HOME`` to a throwaway cache holding ``models`` for this process.

    Must be entered before ``huggingface_hub`` is imported: it reads
    ``HF_HUB_OFFLINE`` once, at import time. The previous environment is restored on
    exit.
    """
    saved = {k: os.environ.get(k) for k in ("HF_HOME", *OFFLINE_FLAGS)}
    with tempfile.TemporaryDirectory(prefix="kvpool-hf-") as tmp:
        home = materialize_hf_cache(tmp, models)
        os.environ.update(offline_env(home))
        try:
            yield home
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
