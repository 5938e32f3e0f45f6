"""The extension's file map in docs/design.md matches the tree: every concept file is
included by _core.pyx and documented, and nothing documented or included is missing."""

from __future__ import annotations

import re

from tests.support.paths import REPO

SRC = REPO / "src" / "kvpool"


def test_every_pxi_is_included_once_and_in_the_design_file_map():
    on_disk = sorted(p.name for p in SRC.glob("*.pxi"))
    included = re.findall(r'^include "([^"]+)"', (SRC / "_core.pyx").read_text(), flags=re.M)
    design = (REPO / "docs" / "design.md").read_text()
    mapped = re.findall(r"^\| `([\w.]+\.pxi)` \|", design, flags=re.M)
    assert on_disk, "no .pxi files found"
    assert sorted(included) == on_disk and len(set(included)) == len(included)
    assert sorted(mapped) == on_disk
    for name in ("_core.pyx", "_core.pxd", "kvpool_cpp.pxd", "fastint.h"):
        assert (SRC / name).exists() and f"| `{name}` |" in design


def test_no_comprehension_in_the_extension():
    # Cython 3.3's list comprehensions steal the item reference and, when the list
    # cannot grow (MemoryError), release it twice: a block still in the pool's table
    # freed (docs/native-checks.md, "Cython's list comprehensions"). The extension
    # builds its lists by hand instead; this keeps it so.
    import re

    pattern = re.compile(r"[\[{][^\[\]{}#\n]*\bfor\b[^\[\]{}#\n]*\bin\b[^\[\]{}#\n]*[\]}]")
    found = []
    for path in sorted(SRC.glob("*.p[yx][xi]")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if '"""' in line or code.strip().startswith(("'", '"')):
                continue
            if pattern.search(code):
                found.append(f"{path.name}:{lineno}: {line.strip()}")
    assert not found, "comprehensions in the extension:\n" + "\n".join(found)


#: The size limits of the Python package (issue 15): a module a reader can hold, a
#: function that fits a screen. The native hot loops live in src/ and are not counted.
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_python_modules_and_functions_stay_small():
    import ast

    package = REPO / "python" / "kvpool"
    too_long = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(REPO)
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}(): {length} lines")
    assert not too_long, "over the limits:\n" + "\n".join(too_long)
