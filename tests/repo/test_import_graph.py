"""Imports in ``python/kvpool`` run one way: down the layers below, never back up.

Every import is read with ``ast`` (module level and inside functions alike), plus the
extension's Python-level imports (``src/kvpool/*.pyx``/``.pxi``) and the patch modules
``patching`` imports by name (``PATCH_MODULES``). An import may reach a lower layer, or
stay inside its own unit (a module, or a subpackage such as ``replay/``); one into the
same layer's other units or into a higher layer fails the test, as does a module that
no layer names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.paths import REPO

PKG = REPO / "python" / "kvpool"

#: Units (top-level modules and subpackages of ``kvpool``; ``""`` is the package's
#: ``__init__``), lowest layer first.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "_version", "vllm_calls"),  # import nothing
    ("envs",),  # every KVPOOL_* setting
    ("vllm_compat",),  # what differs between vLLM releases
    ("_core",),  # the extension
    ("allocation",),  # the allocation policy block_pool follows
    ("block_hash_map",),  # the prefix-cache map in the installed release's layout
    ("block_pool",),
    ("patches", "selfcheck"),  # the patch modules: apply(patcher); the self-check install() runs first
    ("patching",),  # install() / uninstall(), runs the patch modules
    ("", "plugin", "cpu_platform", "introspect"),  # the public names; the vLLM entry points
    ("info",),  # python -m kvpool info (the runtime's own command)
    ("tools",),  # kvpool.tools' own __init__ (a docstring)
    ("tools.cliargs", "tools.hf_offline"),  # helpers of the tools' commands
    ("tools.conformance", "tools.replay"),  # python -m kvpool conformance / porting / replay
    ("tools.locality",),  # python -m kvpool locality (reads replay's tables)
    ("__main__",),
)
LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


#: The runtime's public API: the only runtime units a tool (``kvpool.tools.*``) may import.
RUNTIME_API = frozenset({"", "errors", "envs", "vllm_compat", "cpu_platform", "introspect"})


def _unit(module: str) -> str:
    """``kvpool.patches.metrics`` -> ``patches``; ``kvpool.tools.replay.cli`` ->
    ``tools.replay``; ``kvpool`` -> ``""``."""
    parts = module.split(".")
    assert parts[0] == "kvpool", module
    if len(parts) > 2 and parts[1] == "tools":
        return f"tools.{parts[2]}"
    return parts[1] if len(parts) > 1 else ""


def _is_tool(unit: str) -> bool:
    return unit == "tools" or unit.startswith("tools.")


def _is_submodule(module: str) -> bool:
    path = PKG.joinpath(*module.split(".")[1:])
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists() or module == "kvpool._core"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, kvpool module imported) for every import in ``path``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for a in node.names:
                # ``from kvpool import patching`` imports the submodule; ``from kvpool
                # import install`` the package's own name.
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if _is_submodule(sub) else base))
    if module == "kvpool.patching":
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "PATCH_MODULES":
                found += [(node.lineno, name) for name in ast.literal_eval(node.value)]
    return [(line, m) for line, m in found if m == "kvpool" or m.startswith("kvpool.")]


def _extension_imports() -> list[tuple[str, int, str]]:
    pattern = re.compile(r"^\s*(?:from\s+(kvpool[\w.]*)\s+import\b|import\s+(kvpool[\w.]*))")
    found = []
    for path in sorted((REPO / "src" / "kvpool").glob("*.p[yx][xi]")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            m = pattern.match(line)
            if m:
                found.append((f"src/kvpool/{path.name}", lineno, m.group(1) or m.group(2)))
    return found


def _edges() -> list[tuple[str, int, str, str]]:
    """(file, line, importing unit, imported unit) for every import between units."""
    edges = []
    for path in sorted(PKG.rglob("*.py")):
        unit = _unit(_module_name(path))
        for line, target in _imports(path):
            edges.append((str(path.relative_to(REPO)), line, unit, _unit(target)))
    edges += [(f, line, "_core", _unit(target)) for f, line, target in _extension_imports()]
    return [e for e in edges if e[2] != e[3]]


def test_every_module_of_the_package_is_in_a_layer():
    units = {_unit(_module_name(p)) for p in PKG.rglob("*.py")} | {"_core"}
    assert sorted(units - set(LAYER_OF)) == [], "add these to LAYERS"
    assert sorted(set(LAYER_OF) - units) == [], "LAYERS names units that do not exist"


def test_imports_run_only_down_the_layers():
    upward = [
        f"{file}:{line}: {unit or 'kvpool'} (layer {LAYER_OF[unit]}) imports "
        f"{target or 'kvpool'} (layer {LAYER_OF[target]})"
        for file, line, unit, target in _edges()
        if LAYER_OF[target] >= LAYER_OF[unit]
    ]
    assert not upward, "imports that do not run down the layers:\n" + "\n".join(upward)


def test_the_graph_sees_function_level_and_extension_imports():
    edges = {(unit, target) for _, _, unit, target in _edges()}
    assert ("info", "vllm_compat") in edges  # module level
    assert ("tools.replay", "introspect") in edges  # inside a function
    assert ("plugin", "patching") in edges  # inside register()
    assert ("patching", "patches") in edges  # PATCH_MODULES
    assert ("_core", "errors") in edges  # src/kvpool/errors.pxi


def test_the_tools_use_only_the_runtimes_public_api():
    """A tool imports the runtime only through :data:`RUNTIME_API`, so that the runtime can
    change inside and be audited alone."""
    private = [
        f"{file}:{line}: {unit} imports {target or 'kvpool'}"
        for file, line, unit, target in _edges()
        if _is_tool(unit) and not _is_tool(target) and target not in RUNTIME_API
    ]
    assert not private, "tools reaching past the runtime's public API:\n" + "\n".join(private)


def test_the_runtime_never_imports_the_tools():
    runtime_to_tools = [
        f"{file}:{line}: {unit or 'kvpool'} imports {target}"
        for file, line, unit, target in _edges()
        if not _is_tool(unit) and unit != "__main__" and _is_tool(target)
    ]
    assert not runtime_to_tools, "\n".join(runtime_to_tools)


def test_the_runtime_files_are_listed_in_the_design_doc():
    """docs/design.md's "Runtime and tools" lists every runtime file, for an auditor."""
    design = (REPO / "docs" / "design.md").read_text()
    section = design.split("## Runtime and tools", 1)[1].split("\n## ", 1)[0]
    runtime = sorted(
        str(p.relative_to(PKG.parent))
        for p in PKG.rglob("*.py")
        if not _is_tool(_unit(_module_name(p))) and p.name != "__main__.py"
    )
    missing = [f for f in runtime if f"`{f}`" not in section]
    assert not missing, f"add to docs/design.md, Runtime and tools: {missing}"
