"""Small synthetic vLLM sdists for the conformance runner's tests."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def write_sdist(path: Path, version: str, files: dict[str, str | bytes]) -> Path:
    """Write ``path`` (a ``.tar.gz``) holding ``files`` (name relative to the sdist's
    top folder -> text or bytes) under ``vllm-{version}/``, as vLLM's sdists lay out."""
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
