"""README and docs describe what is true now: no commit hashes, no references to an issue
tracker that is not in the repository, no line over 300 characters. Dated measurement
history lives in one file, docs/measurements.md, which these rules skip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HISTORY = ROOT / "docs" / "measurements.md"
MAX_LINE = 300

#: 7-40 hex digits with at least one letter and one digit, not part of a path, a word,
#: an anchor or a ``0x`` literal: what ``git log --oneline`` prints.
COMMIT_HASH = re.compile(r"(?<![\w/#.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
#: "issue 17", "issues 12": the project's tracker. vLLM's are cited with '#' ("vLLM issue #55434").
TRACKER_REF = re.compile(r"(?<![\w#])issues? \d+", re.IGNORECASE)


def _documents() -> list[Path]:
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md"] + [d for d in docs if d != HISTORY]


def _problems(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if len(line) > MAX_LINE:
            found.append(f"line {number}: {len(line)} characters")
        found += [f"line {number}: commit hash {m.group()}" for m in COMMIT_HASH.finditer(line)]
        found += [f"line {number}: tracker reference {m.group()!r}" for m in TRACKER_REF.finditer(line)]
    return found


@pytest.mark.parametrize("sample, expected", [
    ("fixed in 3e2f46f, see there", ["commit hash 3e2f46f"]),
    ("(the build of ac6319e)", ["commit hash ac6319e"]),
    ("as issue 17 asks", ["tracker reference 'issue 17'"]),
    ("vLLM issue #55434 and PR #55841", []),
    ("10^6 operations, seed 20261130, 1000000 blocks", []),
    ("`docs/replay.md#transfer-figures`, 0xdeadbeef1, deadbeef", []),
    ("x" * (MAX_LINE + 1), [f"{MAX_LINE + 1} characters"]),
])
def test_the_detectors(sample: str, expected: list[str]) -> None:
    assert [p.split(": ", 1)[1] for p in _problems(sample)] == expected


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_document_describes_the_present(path: Path) -> None:
    problems = _problems(path.read_text(encoding="utf-8"))
    assert not problems, f"{path.relative_to(ROOT)} (history goes to docs/measurements.md):\n" + "\n".join(problems)


def test_history_has_one_home() -> None:
    assert HISTORY.is_file()
    assert "measurements.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_a_product_page() -> None:
    """About 120 lines, the quick start (install(), the plugin) on its first screen."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 140, len(lines)
    first_screen = "\n".join(lines[:40])
    assert "kvpool.install()" in first_screen
    assert "## Quick start" in first_screen


def test_project_files_exist() -> None:
    for name in ("LICENSE", "CHANGELOG.md", "CONTRIBUTING.md"):
        assert (ROOT / name).is_file(), name
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", _documents() + [HISTORY, ROOT / "CHANGELOG.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    """Every relative link names a file of the repository, and its #anchor a heading there."""
    broken = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists() or anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: {broken}"


def test_every_setting_is_documented():
    """docs/usage.md names every ``KVPOOL_*`` setting ``kvpool/envs.py`` declares (the ones
    ``python -m kvpool info`` prints)."""
    envs = (ROOT / "python" / "kvpool" / "envs.py").read_text(encoding="utf-8")
    declared = re.findall(r'^[A-Z_]+ = "(KVPOOL_\w+)"$', envs, flags=re.MULTILINE)
    assert len(declared) >= 10, declared
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    missing = [name for name in declared if f"`{name}`" not in usage]
    assert not missing, f"docs/usage.md does not describe {missing}"
