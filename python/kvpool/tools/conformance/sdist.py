"""Find, download, cache, verify and extract the vLLM sdist whose ``tests/`` we run.

``pip download --no-binary :all: vllm==X`` does not work (pip builds the sdist's
metadata, which needs CUDA tooling), so the sdist is located through the package
index's simple API (PEP 691 JSON, with a PEP 503 HTML fallback for mirrors that only
speak HTML), downloaded once into ``$KVPOOL_CACHE_DIR/sdists/`` and checked against
the sha256 the index publishes. Later runs reuse the cached file without touching the
network (its expected digest is stored next to it).
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import re
import ssl
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvpool import envs
from kvpool.errors import SdistError  # (defined there, re-exported here)

JSON_ACCEPT = "application/vnd.pypi.simple.v1+json"
#: Accept header preferring PEP 691 JSON but taking PEP 503 HTML from older mirrors.
INDEX_ACCEPT = f"{JSON_ACCEPT}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
HTTP_TIMEOUT_S = 120

#: Top-level sdist members the suites need: the test tree (which imports ``tests.*``
#: only) and vLLM's pyproject.toml, whose ``[tool.pytest.ini_options]`` registers the
#: markers the tests use.
EXTRACT_MEMBERS = ("tests/", "pyproject.toml")


@dataclass(frozen=True)
class SdistFile:
    """One sdist as listed by the index: file name, absolute URL and sha256 (hex)."""

    filename: str
    url: str
    sha256: str


def cache_dir() -> Path:
    """``$KVPOOL_CACHE_DIR``, default ``~/.cache/kvpool`` (:mod:`kvpool.envs`)."""
    return Path(envs.get(envs.CACHE_DIR)).expanduser()


#: Run by the environment's interpreter: the indexes ``pip download`` would use, from
#: pip's own option parser (its default, its configuration files, ``PIP_*`` variables).
_PIP_INDEXES = (
    "import json; from pip._internal.commands import create_command; "
    "o, _ = create_command('download').parse_args([]); "
    "print(json.dumps([o.index_url, o.extra_index_urls]))"
)


def _pip_indexes() -> tuple[str, list[str]]:
    """``(index-url, extra-index-urls)`` as ``pip download`` of the running interpreter
    resolves them.

    Raises:
        SdistError: pip could not be asked (not installed, or its internals moved).
    """
    try:
        proc = subprocess.run([sys.executable, "-c", _PIP_INDEXES], capture_output=True, text=True,
                              timeout=60, check=False)
        primary, extras = json.loads(proc.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        raise SdistError(
            f"cannot ask pip which package index to use ({e}); pass --index-url or set "
            f"{envs.INDEX_URL}") from e
    return primary, list(extras)


def index_urls(explicit: str | None = None) -> list[str]:
    """Simple-index base URLs to search, in order.

    The primary index is ``explicit`` or ``$KVPOOL_INDEX_URL``, else the one ``pip
    download`` would use (``$PIP_INDEX_URL``, pip's configured ``index-url``, pip's
    default); pip's extra indexes (``$PIP_EXTRA_INDEX_URL``, ``extra-index-url``)
    follow it.

    Raises:
        SdistError: pip could not be asked (:func:`_pip_indexes`).
    """
    pip_primary, extras = _pip_indexes()
    primary = explicit or envs.get(envs.INDEX_URL) or pip_primary
    urls = []
    for url in [primary, *extras]:
        url = url if url.endswith("/") else url + "/"
        if url not in urls:
            urls.append(url)
    return urls


def _ssl_context() -> ssl.SSLContext:
    # pip's configured CA bundle (PIP_CERT / cert=) is what works for the index here.
    cafile = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    if cafile and os.path.isfile(cafile):
        return ssl.create_default_context(cafile=cafile)
    return ssl.create_default_context()


def _open(url: str, accept: str | None = None):
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    return urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S, context=_ssl_context())


class _AnchorParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.anchors: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.anchors.append((self._href, "".join(self._text).strip()))
            self._href = None


def parse_project_page(body: bytes, content_type: str, page_url: str) -> list[SdistFile]:
    """Files of a simple-index project page (PEP 691 JSON or PEP 503 HTML).

    Only files that carry a sha256 are returned; URLs are made absolute against
    ``page_url``.
    """
    files = []
    if "json" in content_type:
        for f in json.loads(body)["files"]:
            digest = (f.get("hashes") or {}).get("sha256")
            if digest and not f.get("yanked"):
                files.append(SdistFile(f["filename"], urllib.parse.urljoin(page_url, f["url"]), digest))
        return files
    parser = _AnchorParser()
    parser.feed(body.decode("utf-8", "replace"))
    for href, text in parser.anchors:
        url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
        match = re.fullmatch(r"sha256=([0-9a-fA-F]{64})", fragment)
        filename = text or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        if match:
            files.append(SdistFile(filename, url, match.group(1).lower()))
    return files


def _project_page(index_url: str, project: str) -> tuple[bytes, str, str]:
    page_url = urllib.parse.urljoin(index_url, f"{project}/")
    if page_url.startswith("file:"):
        # A directory index on disk (pip's file:// indexes): PEP 503 HTML files only.
        path = Path(urllib.request.url2pathname(urllib.parse.urlparse(page_url).path))
        page = path / "index.html"
        if not page.is_file():
            raise FileNotFoundError(page)
        return page.read_bytes(), "text/html", page.as_uri()
    with _open(page_url, INDEX_ACCEPT) as response:
        return response.read(), response.headers.get("Content-Type", ""), response.geturl()


def find_sdist(version: str, project: str = "vllm", index_url: str | None = None) -> SdistFile:
    """The index entry of ``{project}-{version}.tar.gz``.

    Raises:
        SdistError: no configured index lists that sdist with a sha256.
    """
    wanted = f"{project}-{version}.tar.gz"
    tried = []
    for base in index_urls(index_url):
        try:
            body, content_type, page_url = _project_page(base, project)
        except (OSError, ValueError) as e:
            tried.append(f"{base}: {e}")
            continue
        for f in parse_project_page(body, content_type, page_url):
            if f.filename == wanted:
                return f
        tried.append(f"{base}: no {wanted} with a sha256")
    raise SdistError(f"cannot find {wanted} on the package index:\n  " + "\n  ".join(tried))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(version: str, *, index_url: str | None = None, cache: Path | None = None) -> Path:
    """Path of the verified ``vllm-{version}.tar.gz`` in the cache, downloading it if needed.

    A cached file is reused without network access when its sha256 matches the digest
    recorded at download time (``<file>.sha256``); otherwise it is fetched again.

    Raises:
        SdistError: not on the index, download failed, or sha256 mismatch.
    """
    target_dir = (cache or cache_dir()) / "sdists"
    target = target_dir / f"vllm-{version}.tar.gz"
    digest_file = target.with_name(target.name + ".sha256")
    if target.is_file() and digest_file.is_file() and sha256_of(target) == digest_file.read_text().strip():
        return target
    entry = find_sdist(version, index_url=index_url)
    target_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target_dir)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, _open(entry.url) as response:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != entry.sha256:
            raise SdistError(f"sha256 mismatch for {entry.url}: index says {entry.sha256}, got {digest.hexdigest()}")
        os.replace(tmp_name, target)
    except OSError as e:
        raise SdistError(f"download of {entry.url} failed: {e}") from e
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    digest_file.write_text(entry.sha256 + "\n")
    return target


def extract_tests(sdist: Path, dest: Path, members: tuple[str, ...] = EXTRACT_MEMBERS) -> Path:
    """Extract ``members`` (paths relative to the sdist root) of ``sdist`` into ``dest``.

    The sdist's top-level ``vllm-X/`` directory is stripped, so ``dest/tests/`` is the
    test tree. Returns ``dest``.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as tar:
        chosen = []
        for info in tar:
            _, _, rel = info.name.partition("/")
            if not rel or not any(rel == m.rstrip("/") or rel.startswith(m) for m in members):
                continue
            if not (info.isfile() or info.isdir()):
                continue  # the test tree needs no links or devices
            if rel.startswith("/") or ".." in rel.split("/"):
                raise SdistError(f"{sdist}: refusing to extract {info.name!r} outside the work dir")
            info.name = rel
            chosen.append(info)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=chosen, filter="data")
        else:  # Python without PEP 706 filters; members are already plain files/dirs
            tar.extractall(dest, members=chosen)
    if not (dest / "tests").is_dir():
        raise SdistError(f"{sdist} has no tests/ directory")
    return dest
