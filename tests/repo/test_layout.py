"""The extension's file map in docs/design.md matches the tree: every concept file is
included by _core.pyx and documented, and nothing documented or included is missing."""

from __future__ import annotations

import ast
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


def test_no_function_object_made_in_the_fault_swept_python():
    # CPython 3.12's MAKE_FUNCTION decrefs the code object twice when the function
    # object cannot be allocated (python/cpython#122752): a generator expression, a
    # lambda or a nested def in code the fault sweeps reach turns a MemoryError into
    # an interpreter crash there (docs/native-checks.md, "On other interpreters").
    # The sweeps run on 3.11 in CI, where this does not show; this keeps the code so.
    import ast

    swept = {
        "block_pool.py": None,  # every function: BlockPool's methods and constructor
        "patches/deferred_free.py": {"_trim_null_head", "_same_blocks", "_defer_then_pop",
                                     "_keep_popped_groups", "_free_request_blocks"},
    }
    found = []
    for rel, names in swept.items():
        path = REPO / "python" / "kvpool" / rel
        functions = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)]
        seen = {f.name for f in functions}
        assert names is None or names <= seen, f"{rel}: no {sorted(names - seen)}"
        for fn in functions:
            if names is not None and fn.name not in names:
                continue
            for node in ast.walk(fn):
                if node is not fn and isinstance(node, (ast.GeneratorExp, ast.Lambda, ast.FunctionDef,
                                                        ast.AsyncFunctionDef)):
                    found.append(f"{rel}:{node.lineno} in {fn.name}(): {type(node).__name__}")
    assert not found, "function objects made in fault-swept code:\n" + "\n".join(found)


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


def test_public_exceptions_are_defined_in_errors_py():
    """One home for errors: every public exception class of ``python/kvpool`` is defined in
    ``kvpool/errors.py`` (the extension's in ``src/kvpool/errors.pxi``); a private one
    (``_Name``) may live beside the code that raises it."""
    found = []
    for path in sorted((REPO / "python" / "kvpool").rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "kvpool":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
            if any(b.endswith(("Error", "Exception", "Unavailable")) or b == "KvpoolError" for b in bases):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: class {node.name}")
    assert not found, "define these in python/kvpool/errors.py:\n" + "\n".join(found)


#: The size limit of a function of the extension (src/kvpool/*.pxi): its phases are
#: named functions (the native manager path's eligibility check, a loop's common case,
#: its undo) rather than one body a reader scrolls through.
MAX_PXI_FUNCTION_LINES = 100

# A def/cdef/cpdef function's first line (not a cdef class, extern block, struct, enum
# or a variable declaration, which have no parameter list before their colon).
_PXI_DEF = re.compile(r"^(\s*)(?:cpdef|cdef|def)\s+(?!class\b|extern\b|struct\b|enum\b|union\b|packed\b)")


def pxi_functions(text: str) -> list[tuple[str, int, int]]:
    """``(name, first line, lines)`` of every def/cdef/cpdef function of a .pxi source: from
    its ``def`` line to the last non-blank line of its body (docstring and comments
    included; the body ends at the first non-blank line indented no deeper than the
    ``def``)."""
    lines = text.splitlines()
    found = []
    for start, line in enumerate(lines):
        match = _PXI_DEF.match(line)
        if not match:
            continue
        signature, end, depth = "", start, 0
        while end < len(lines):
            code = lines[end].split("#", 1)[0]
            signature += code
            depth += code.count("(") - code.count(")")
            if depth <= 0 and code.rstrip().endswith(":"):
                break
            if depth <= 0 and not code.rstrip().endswith((",", "(", "\\")):
                end = len(lines)  # a declaration, not a function
            end += 1
        name = re.match(r"[^(=]*?(\w+)\s*\(", signature)
        if end >= len(lines) or name is None:
            continue
        indent, last = len(match.group(1)), end
        for k in range(end + 1, len(lines)):
            if lines[k].strip():
                if len(lines[k]) - len(lines[k].lstrip()) <= indent:
                    break
                last = k
        found.append((name.group(1), start + 1, last - start + 1))
    return found


def test_pxi_function_length_is_measured():
    source = (
        "cdef object _x = object()\n"
        "cdef inline bint f(object a,\n"
        "                   long b) except -1:\n"
        "    # one\n"
        "\n"
        "    return True\n"
        "\n"
        "cdef class C:\n"
        "    cdef int n\n"
        "    def g(self):\n"
        "        pass\n"
        "h = 1\n"
    )
    assert pxi_functions(source) == [("f", 2, 5), ("g", 10, 2)]


def test_pxi_functions_stay_small():
    too_long = []
    measured = 0
    for path in sorted(SRC.glob("*.pxi")):
        for name, line, length in pxi_functions(path.read_text()):
            measured += 1
            if length > MAX_PXI_FUNCTION_LINES:
                too_long.append(f"src/kvpool/{path.name}:{line} {name}(): {length} lines")
    assert measured > 100, "no .pxi functions found"
    assert not too_long, "over the limit:\n" + "\n".join(too_long)


def test_the_modules_run_first_exist():
    from tests.support.ordering import LONGEST_FIRST

    missing = [path for path in LONGEST_FIRST if not (REPO / path).is_file()]
    assert not missing, f"tests/support/ordering.py names modules that are gone: {missing}"
