"""Every C declaration that src/ writes by hand is checked by the build.

Cython trusts a hand-written ``cdef extern`` declaration: a wrong result type converts
silently (a ``PyLong_AsLongLongAndOverflow`` declared as returning ``int`` once kept the
low 32 bits of every integer the native manager path read). ``src/kvpool/capi_checks.h``,
included last by ``_core.pyx``, restates each declaration in C for the compiler to
compare with CPython's headers; these tests keep it complete and in step with the Cython
declarations, and show that a wrong line fails the compile.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig

import pytest

from tests.support.paths import REPO

SRC = REPO / "src" / "kvpool"
CHECKS = SRC / "capi_checks.h"
#: Headers whose declarations are CPython's or fastint.h's (kvpool_cpp.pxd's C++ core
#: headers are kvpool's own C++, compiled with the declarations' callers).
CHECKED_HEADERS = ("Python.h", "structmember.h", "fastint.h", "*")

_DECL = re.compile(r'^\s+(?P<head>[^()#"]*?)\s*(?:"(?P<cname>\w+)")?\s*\((?P<params>[^()]*)\)')
_CONST = re.compile(r"^\s+int\s+(?P<name>[A-Z_][A-Z0-9_]*)\s*$")
_TYPES = {"bint": "int", "object": "PyObject*", "_TypeObject*": "PyTypeObject*",
          "_GCTypeObject*": "PyTypeObject*"}


def _c_type(cython_type: str) -> str:
    t = re.sub(r"\s+", " ", cython_type.strip()).replace(" *", "*")
    return _TYPES.get(t, t)


def _param_type(param: str) -> str:
    param = param.strip()
    # "PyObject* o" / "int* overflow" / "void* op" / "long v": drop the parameter name.
    m = re.match(r"^(?P<type>.*?[\w*])\s*\b(?P<name>[a-z_]\w*)$", param)
    return _c_type(m.group("type") if m and m.group("type") not in ("const",) else param)


def hand_written_declarations() -> dict[str, str]:
    """``{C name: "ret(param, ...)"}`` of every function declared in a checked
    ``cdef extern`` block of src/, and ``{NAME: "int"}`` of its constants."""
    found: dict[str, str] = {}
    for path in sorted(SRC.glob("*.p[yx][xid]")):
        block = None
        in_verbatim = False
        for line in path.read_text().splitlines():
            m = re.match(r'^cdef extern from (?:"([^"]+)"|(\*))', line)
            if m:
                block = m.group(1) or m.group(2)
                continue
            if block is None:
                continue
            if line and not line[0].isspace():
                block = None
                continue
            if line.strip().startswith('"""'):
                in_verbatim = not in_verbatim if line.strip().count('"""') == 1 else in_verbatim
                continue
            if in_verbatim or block not in CHECKED_HEADERS or line.strip().startswith(("#", "ctypedef")):
                continue
            d = _DECL.match(line)
            if d:
                ret, _, pyname = d.group("head").rpartition(" ")
                ret = ret.strip()
                if pyname.startswith("*"):   # "PyObject **name"
                    ret, pyname = ret + "*" * (len(pyname) - len(pyname.lstrip("*"))), pyname.lstrip("*")
                params = [p for p in d.group("params").split(",") if p.strip()]
                name = d.group("cname") or pyname
                found[name] = f"{_c_type(ret)}({', '.join(_param_type(p) for p in params)})"
                continue
            c = _CONST.match(line)
            if c:
                found[c.group("name")] = "int"
    return found


def checked_declarations() -> dict[str, str]:
    """The same mapping, as capi_checks.h states it."""
    text = CHECKS.read_text()
    found: dict[str, str] = {}
    for m in re.finditer(r"^CAPI_CHECK_FUNCTION\((\w+), ([^,]+), \(([^)]*)\)\);", text, re.M):
        found[m.group(1)] = f"{m.group(2).strip()}({m.group(3).strip()})"
    for m in re.finditer(r"^CAPI_CHECK_CALL\((\w+), ([^,]+), ([^)]+)\);", text, re.M):
        found[m.group(1)] = f"{m.group(2).strip()}({m.group(3).strip()})"
    for m in re.finditer(r"^CAPI_CHECK_CALL0\((\w+), ([^)]+)\);", text, re.M):
        found[m.group(1)] = f"{m.group(2).strip()}()"
    for m in re.finditer(r"^CAPI_CHECK_TYPE\(([A-Z_][A-Z0-9_]*), (\w+)\);", text, re.M):
        found[m.group(1)] = m.group(2)
    return found


def test_every_hand_written_c_declaration_has_its_build_check():
    declared = hand_written_declarations()
    checked = checked_declarations()
    # The parser sees the declarations it must (a smoke check of the parser itself).
    assert declared["PyLong_FromLong"] == "PyObject*(long)"
    assert declared["PyList_Append"] == "int(PyObject*, PyObject*)"
    assert declared["kvpool_type_tag"] == "unsigned int(PyObject*)"
    assert declared["T_OBJECT_EX"] == "int"
    missing = sorted(set(declared) - set(checked))
    assert not missing, f"hand-written declarations without a line in capi_checks.h: {missing}"
    differ = {n: (declared[n], checked[n]) for n in declared if checked[n] != declared[n]}
    assert not differ, f"capi_checks.h states other types than src/ declares: {differ}"


def test_the_checks_are_included_last_by_the_extension():
    core = (SRC / "_core.pyx").read_text()
    externs = re.findall(r'^cdef extern from "([^"]+)"', core, re.M)
    assert externs[-1] == "capi_checks.h"
    assert core.rindex('cdef extern from "capi_checks.h"') > core.rindex('include "')


def test_pylong_as_long_long_is_cpythons_own_declaration():
    # The declaration whose `int` result truncated every integer: cimported, not written.
    text = "\n".join(p.read_text() for p in sorted(SRC.glob("*.p[yx][xid]")))
    assert "from cpython.long cimport PyLong_AsLongLongAndOverflow" in text
    assert "PyLong_AsLongLongAndOverflow" not in hand_written_declarations()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the C++ compiler the build uses")
@pytest.mark.parametrize("line, fails", [
    ("", False),
    # The old hand-written declaration: a 32-bit result.
    ("CAPI_CHECK_FUNCTION(PyLong_AsLongLongAndOverflow, int, (PyObject*, int*));", True),
    ("CAPI_CHECK_FUNCTION(PyLong_AsLongLongAndOverflow, long long, (PyObject*, int*));", False),
    ("CAPI_CHECK_FUNCTION(PyLong_FromLong, PyObject*, (int));", True),
    ("CAPI_CHECK_CALL(Py_SIZE, int, PyObject*);", True),
    ("CAPI_CHECK_TYPE(T_OBJECT_EX, long);", True),
])
def test_a_wrong_declaration_fails_the_compile(tmp_path, line, fails):
    source = tmp_path / "check.cpp"
    # kvpool_type_tag, kvpool_str_keys_only and the kvpool_names_* functions come from
    # manager.pxi's verbatim blocks in the real build.
    source.write_text('#include "fastint.h"\n#include <stdint.h>\n'
                      "static unsigned int kvpool_type_tag(PyObject*) { return 0; }\n"
                      "static uint64_t kvpool_names_version(PyObject*) { return 0; }\n"
                      "static int kvpool_names_absent_known(PyObject*, PyObject*) { return 0; }\n"
                      "static int kvpool_str_keys_only(PyObject*) { return 1; }\n"
                      "static void kvpool_names_absent_store(PyObject*, PyObject*, uint64_t) {}\n"
                      '#include "capi_checks.h"\n' + line + "\nint main() { return 0; }\n")
    result = subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", f"-I{sysconfig.get_paths()['include']}",
         f"-I{SRC}", str(source)], capture_output=True, text=True, check=False)
    assert (result.returncode != 0) == fails, result.stderr[-2000:]
    if fails:
        assert "static assertion failed" in result.stderr
