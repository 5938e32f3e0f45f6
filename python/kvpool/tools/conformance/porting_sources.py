"""The source side of ``python -m kvpool porting``: vLLM wheels downloaded with ``pip
download --no-deps``, the definitions kvpool mirrors or replaces found in them with
``ast`` (nothing is imported), and their diffs between two releases.
"""

from __future__ import annotations

import ast
import difflib
import subprocess
import sys
import textwrap
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvpool.errors import PortingError

#: Where vLLM's code binds each class kvpool's tables name (kvpool's names for vLLM's
#: classes: ``manager_fast_path.MIRRORED``, ``patching.vanilla_classes()``), and the
#: modules those tables name by their last component.
CLASS_MODULES: dict[str, str] = {
    "KVCacheManager": "vllm.v1.core.kv_cache_manager",
    "UnitaryKVCacheCoordinator": "vllm.v1.core.kv_cache_coordinator",
    "FullAttentionManager": "vllm.v1.core.single_type_kv_cache_manager",
    "SingleTypeKVCacheManager": "vllm.v1.core.single_type_kv_cache_manager",
    "BlockPool": "vllm.v1.core.block_pool",
    "BlockHashToBlockMap": "vllm.v1.core.block_pool",
    "KVCacheBlock": "vllm.v1.core.kv_cache_utils",
    "FreeKVCacheBlockQueue": "vllm.v1.core.kv_cache_utils",
}
MODULES: dict[str, str] = {
    "block_pool": "vllm.v1.core.block_pool",
    "kv_cache_coordinator": "vllm.v1.core.kv_cache_coordinator",
    "single_type_kv_cache_manager": "vllm.v1.core.single_type_kv_cache_manager",
}

#: The classes kvpool replaces or subclasses, compared whole.
REPLACED_CLASSES: tuple[str, ...] = ("KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool", "BlockHashToBlockMap")


class Sources:
    """The ``.py`` files of one vLLM release: a wheel (``.whl``) or a directory that
    holds the ``vllm`` package; files are read and parsed once, on first use."""

    def __init__(self, root: Path | dict[str, str]):
        self._root = root
        self._trees: dict[str, ast.Module | None] = {}
        self._texts: dict[str, str] = {}

    def text(self, module: str) -> str | None:
        """The source of ``module`` (``"vllm.v1.core.block_pool"``), or None."""
        if module not in self._texts:
            path = module.replace(".", "/") + ".py"
            root = self._root
            text = None
            if isinstance(root, dict):
                text = root.get(path)
            elif root.suffix == ".whl":
                with zipfile.ZipFile(root) as wheel:
                    if path in wheel.namelist():
                        text = wheel.read(path).decode()
            elif (root / path).is_file():
                text = (root / path).read_text()
            if text is None:
                return None
            self._texts[module] = text
        return self._texts[module]

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self.text(module)
            self._trees[module] = None if text is None else ast.parse(text)
        return self._trees[module]


@dataclass(frozen=True)
class Definition:
    """One definition as a release has it: where, and its source (dedented)."""

    where: str  # "vllm/v1/core/kv_cache_coordinator.py:KVCacheCoordinator.cache_blocks"
    source: str


def _top_level(sources: Sources, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
    """``(module, node)`` of the top-level ``def``/``class`` ``name`` of ``module``,
    following ``from X import name`` (within the release's sources)."""
    tree = sources.tree(module)
    if tree is None or depth > 5:
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return module, node
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _top_level(sources, node.module, alias.name, depth + 1)
    return None


def _segment(sources: Sources, module: str, node: ast.AST) -> str:
    """``node``'s whole lines, decorators included (what ``inspect.getsource`` gives),
    dedented."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
    lines = sources.text(module).splitlines(keepends=True)[start - 1:node.end_lineno]
    return textwrap.dedent("".join(lines))


def _where(module: str, qualname: str) -> str:
    return f"{module.replace('.', '/')}.py:{qualname}"


def find_method(sources: Sources, module: str, cls_name: str, name: str, depth: int = 0) -> Definition | None:
    """``cls_name.name`` as the release resolves it: the class's own ``def``, else its
    bases' (by name, through the imports of the class's module), or None."""
    found = _top_level(sources, module, cls_name)
    if found is None or not isinstance(found[1], ast.ClassDef) or depth > 8:
        return None
    cls_module, cls = found
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return Definition(_where(cls_module, f"{cls.name}.{name}"), _segment(sources, cls_module, node))
    for base in cls.bases:
        if isinstance(base, ast.Name):
            hit = find_method(sources, cls_module, base.id, name, depth + 1)
            if hit is not None:
                return hit
    return None


def find_definition(sources: Sources, owner: str, name: str | None) -> Definition | None:
    """A definition named by kvpool's tables: ``(class, method)`` of
    :data:`CLASS_MODULES`, ``(module, function)`` of :data:`MODULES`, or ``(class,
    None)`` for a whole class.

    Raises:
        KeyError: ``owner`` is in neither table.
    """
    if owner in MODULES:
        found = _top_level(sources, MODULES[owner], name)
        return None if found is None else Definition(_where(found[0], name), _segment(sources, *found))
    module = CLASS_MODULES[owner]
    if name is None:
        found = _top_level(sources, module, owner)
        return None if found is None else Definition(_where(found[0], owner), _segment(sources, *found))
    return find_method(sources, module, owner, name)


@dataclass(frozen=True)
class Compared:
    """One definition in two releases: ``status`` is ``"same"``, ``"changed"``,
    ``"added"`` (only in the new one), ``"removed"`` or ``"absent"`` (in neither)."""

    name: str
    status: str
    diff: str
    added: int = 0
    removed: int = 0


def compare(name: str, old: Definition | None, new: Definition | None, old_label: str, new_label: str) -> Compared:
    """The unified diff of ``old`` and ``new`` (labelled with their releases)."""
    if old is None and new is None:
        return Compared(name, "absent", "")
    old_lines = [] if old is None else old.source.splitlines(keepends=True)
    new_lines = [] if new is None else new.source.splitlines(keepends=True)
    diff = list(difflib.unified_diff(
        old_lines, new_lines,
        f"{old_label} {old.where if old else '(absent)'}", f"{new_label} {new.where if new else '(absent)'}"))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    status = "added" if old is None else "removed" if new is None else "changed" if diff else "same"
    text = "".join(line if line.endswith("\n") else line + "\n" for line in diff)
    return Compared(name, status, text, added, removed)


def definitions_to_compare(mirrored: tuple[tuple[str, str], ...]) -> list[tuple[str, str, str | None]]:
    """``(label, owner, name)`` for every mirrored definition and every replaced class."""
    out = [(f"{owner}.{name}", owner, name) for owner, name in mirrored]
    out += [(f"class {cls}", cls, None) for cls in REPLACED_CLASSES]
    return out


def compare_releases(old: Sources, new: Sources, old_label: str, new_label: str,
                     mirrored: tuple[tuple[str, str], ...]) -> list[Compared]:
    """:func:`compare` of every definition of :func:`definitions_to_compare`."""
    return [compare(label, find_definition(old, owner, name), find_definition(new, owner, name), old_label, new_label)
            for label, owner, name in definitions_to_compare(mirrored)]


def download_wheel(version: str, dest: Path) -> Path:
    """vLLM ``version``'s wheel in ``dest`` (``pip download --no-deps``, reused when
    already there).

    Raises:
        PortingError: pip found no such wheel (not on the package index) or failed; the
            message has pip's last line.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cached = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if cached:
        return cached[0]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
         "--only-binary", ":all:", f"vllm=={version}", "-d", str(dest)],
        capture_output=True, text=True)
    cached = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if proc.returncode != 0 or not cached:
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        lines = [line for line in lines if line.startswith("ERROR:")] or lines
        last = lines[-1] if lines else f"exit {proc.returncode}"
        raise PortingError(f"vLLM {version} could not be downloaded from the package index "
                           f"(pip download --no-deps vllm=={version}: {last})")
    return cached[0]
