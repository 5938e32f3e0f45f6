"""The sources of the vLLM definitions kvpool's native code mirrors, as the installed
vLLM defines them: what ``manager_fast_path`` and ``hybrid_fast_path`` hash into their
fingerprints (``KNOWN_SOURCES``, ``KNOWN_HYBRID_SOURCES``, ``KNOWN_MAMBA_SOURCES``), with
what their text does not show (defaults, kinds, globals, attribute hooks, virtual
subclasses: docs/design.md, "The KV cache manager's step")."""

from __future__ import annotations

import abc
import ast
import inspect
import sys
import textwrap
import types
import weakref
from typing import Any

from kvpool import _core

_CYFUNCTION = type(_core.kv_cache_manager_allocate_slots)   # Cython's function type


_METHOD_TYPES = (classmethod, staticmethod, types.MethodType)


#: The wrappers kvpool put on vLLM's classes (:func:`mark_kvpool_wrapper`), by identity:
#: an attribute named ``__kvpool_wrapped__`` can be set on any function.
_KVPOOL_WRAPPERS: weakref.WeakSet = weakref.WeakSet()


def mark_kvpool_wrapper(wrapper, wrapped) -> None:
    """Record ``wrapper`` (a plain or Cython function kvpool binds on a vLLM class) as
    kvpool's own, wrapping ``wrapped``: the fingerprints read vLLM's definition through
    it (``wrapper.__kvpool_wrapped__``), and only through kvpool's; ``inspect`` shows
    vLLM's signature (``__wrapped__``, as ``functools.wraps`` sets it)."""
    wrapper.__wrapped__ = wrapper.__kvpool_wrapped__ = wrapped
    _KVPOOL_WRAPPERS.add(wrapper)


def is_kvpool_wrapper(obj) -> bool:
    """``obj`` (a function, or one under a classmethod/staticmethod) is one of kvpool's
    wrappers (:func:`mark_kvpool_wrapper`). Runs no code of a foreign object."""
    if type(obj) in _METHOD_TYPES:
        obj = obj.__func__
    return (type(obj) is types.FunctionType or type(obj) is _CYFUNCTION) and obj in _KVPOOL_WRAPPERS


def _kvpool_wrapped(obj):
    """What kvpool's wrapper ``obj`` wraps (:func:`mark_kvpool_wrapper`), else None."""
    if not is_kvpool_wrapper(obj):
        return None
    if type(obj) in _METHOD_TYPES:
        obj = obj.__func__
    return obj.__dict__.get("__kvpool_wrapped__")


def _mro_dicts(cls):
    """``(class, its own __dict__)`` along ``cls``'s MRO, read through ``type``'s own
    descriptors: no code of the classes or their metaclass runs."""
    for c in type.__dict__["__mro__"].__get__(cls):
        yield c, type.__dict__["__dict__"].__get__(c)


def _own_attr(obj, name: str, default):
    """``obj.name`` as the dicts hold it, without running attribute code: a class's
    nearest entry along its MRO (:func:`_mro_dicts`), an exact ``types.ModuleType``'s
    ``__dict__`` entry; ``default`` when absent. Raises ``TypeError`` for any other
    object (a module of another class: its attribute reads may run its code)."""
    if issubclass(type(obj), type):
        for _, d in _mro_dicts(obj):
            if name in d:
                return d[name]
        return default
    if type(obj) is types.ModuleType:
        return obj.__dict__.get(name, default)
    raise TypeError(f"not a class or a plain module: {type(obj).__name__}")


def _vanilla(cls, name: str):
    """vLLM's definition behind ``cls.name`` (seen through kvpool's own wrappers), None
    when there is none. On a class, what the class's own ``__dict__`` holds along its
    MRO (a function, a classmethod or staticmethod object, a property, or whatever
    else is there), read without running a descriptor: a descriptor that gives vLLM's
    function on the class and something else on an instance is read as itself, and
    :func:`_source` refuses it. On a module (exactly ``types.ModuleType``, else
    ``TypeError``), its ``__dict__``'s entry."""
    func = _own_attr(cls, name, None)
    while func is not None:
        inner = _kvpool_wrapped(func)
        if inner is None:
            break
        func = inner
    return func


def _source(func) -> str:
    """``func``'s source, dedented: a class, a function, or a method, classmethod or
    staticmethod of a function. Raises ``TypeError`` for anything else (a foreign
    descriptor: its source is not what runs) and ``OSError`` when unreadable."""
    inner = func.__func__ if type(func) in _METHOD_TYPES else func
    if type(inner) is types.FunctionType:
        # (from its code object: inspect.getsource(function) would follow a __wrapped__
        # that functools.wraps set and read the wrapped function's source)
        return textwrap.dedent(inspect.getsource(inner.__code__))
    if not issubclass(type(inner), type):
        raise TypeError(f"not a plain function or class: {type(inner).__name__}")
    return textwrap.dedent(inspect.getsource(inner))


#: definitions_source's texts in this process, by what they were read from: the ids of
#: the definitions (functions, classes, code objects), which the entry keeps alive, with
#: each function's defaults as its source declares them (:func:`_declared_defaults`).
_SOURCES: dict[tuple, tuple[tuple, str, tuple]] = {}

_NOT_LITERAL = object()   # _declared_defaults: a default that is neither literal nor name
_MISSING = object()


def _default_spec(node):
    """One default's AST as ``("literal", value)`` or ``("name", ("A", "B"))`` for a
    dotted name ``A.B`` (resolved when compared: :func:`_resolve`); raises ValueError
    for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ("name", (node.id, *reversed(parts)))
    if parts:
        raise ValueError("an attribute of an expression")
    return ("literal", ast.literal_eval(node))


def _declared_defaults(text: str):
    """The defaults the source ``text`` of one function declares, as
    ``(positional specs, {keyword-only name: spec})`` (:func:`_default_spec`), or
    ``_NOT_LITERAL`` when one is another expression (or ``text`` is not a function's)."""
    try:
        node = ast.parse(text).body[0]
    except (SyntaxError, IndexError, ValueError, MemoryError, RecursionError):
        return _NOT_LITERAL
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _NOT_LITERAL
    args = node.args
    try:
        defaults = tuple(_default_spec(d) for d in args.defaults)
        kwdefaults = {a.arg: _default_spec(d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL
    return defaults, kwdefaults


_KINDS = {classmethod: "classmethod", staticmethod: "staticmethod", property: "property",
          types.MethodType: "bound method", types.FunctionType: "function"}


def _declared_kind(text: str) -> str | None:
    """``"classmethod"``, ``"staticmethod"``, ``"property"`` when the source ``text`` of a
    function is decorated so (a bare name), else ``"function"``; None when ``text`` is
    not a function's."""
    try:
        node = ast.parse(text).body[0]
    except (SyntaxError, IndexError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for d in node.decorator_list:
        if isinstance(d, ast.Name) and d.id in ("classmethod", "staticmethod", "property"):
            return d.id
    return "function"


def _resolve(path: tuple, func):
    """Dotted name ``path`` as ``func``'s module sees it: the first part from its globals
    (or builtins), each next one from a module's or class's own ``__dict__`` (a class's
    along its MRO) without running attribute code; ``_MISSING`` when not found so."""
    glb = func.__globals__
    builtins = glb.get("__builtins__", {})
    builtins = builtins if type(builtins) is dict else getattr(builtins, "__dict__", {})
    obj = glb.get(path[0], builtins.get(path[0], _MISSING))
    for part in path[1:]:
        try:
            obj = _own_attr(obj, part, _MISSING)
        except TypeError:   # (an attribute of another object: not read)
            return _MISSING
        if obj is _MISSING:
            return _MISSING
    return obj


#: The types whose values _same_value compares with ``==`` (their own, built-in); any
#: other object only by identity, so that no foreign ``__eq__`` runs in a fingerprint.
_LITERAL_TYPES = (int, float, complex, str, bytes, bool, type(None), type(...))


def _same_value(a, b) -> bool:
    """``a`` and ``b`` are the same literal: same exact type and equal (tuples, dicts, sets
    element by element, so that ``True`` is not ``1``); another object: ``a is b``."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is tuple:
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return (len(a) == len(b) and all(type(k) in _LITERAL_TYPES for k in a)
                and all(k in b and _same_value(a[k], b[k]) for k in a))
    if type(a) in (set, frozenset):
        return all(type(x) in _LITERAL_TYPES for x in a) and all(type(x) in _LITERAL_TYPES for x in b) and a == b
    return type(a) in _LITERAL_TYPES and a == b


def _is_declared(value, spec, func) -> bool:
    if spec[0] == "literal":
        return _same_value(value, spec[1])
    declared = _resolve(spec[1], func)
    return declared is not _MISSING and _same_value(value, declared)


def _edited(func, declared, owner) -> str | None:
    """What of ``func`` (read from ``owner``, a class or module) differs from its source
    although the source text is the same, or None: its ``__defaults__`` or
    ``__kwdefaults__`` set to other values than the source declares (``declared``: its
    literals, and the names as its module's globals give them now; a default that is
    another expression counts as differing), a closure cell other than the
    ``__class__`` of a class on ``owner``'s MRO (what ``super()`` reads)."""
    if declared is _NOT_LITERAL:
        return "defaults that are neither literals nor names"
    specs, kwspecs = declared
    name = func.__module__
    module = sys.modules.get(name) if type(name) is str else None
    if type(module) is not types.ModuleType or func.__globals__ is not module.__dict__:
        return "globals other than its module's"
    defaults, kwdefaults = func.__defaults__, func.__kwdefaults__
    # (types first: a subclass's __bool__ or __len__ is not run)
    if (defaults is not None and type(defaults) is not tuple) or \
            (kwdefaults is not None and type(kwdefaults) is not dict):
        return "defaults of another type"
    defaults = () if defaults is None else defaults
    kwdefaults = {} if kwdefaults is None else kwdefaults
    if (len(defaults) != len(specs)
            or not all(_is_declared(v, spec, func) for v, spec in zip(defaults, specs))):
        return "defaults differ from its source"
    if (kwdefaults.keys() != kwspecs.keys()
            or not all(_is_declared(kwdefaults[k], kwspecs[k], func) for k in kwspecs)):
        return "keyword-only defaults differ from its source"
    cells = func.__closure__ or ()
    names = func.__code__.co_freevars
    mro = type.__dict__["__mro__"].__get__(owner) if issubclass(type(owner), type) else ()
    for name, cell in zip(names, cells):
        try:
            value = cell.cell_contents
        except ValueError:   # (an empty cell)
            return "an empty closure cell"
        if name != "__class__" or not any(value is c for c in mro):
            return f"closure cell {name!r} differs"
    return None


def definitions_source(entries: tuple, classes: dict[str, Any]) -> str:
    """The sources of ``entries`` (``(class name, method or None)`` in ``classes``) as the
    installed vLLM defines them, dedented, each under a ``# Class.method`` line (``:
    absent`` when the release has none; ``# Class`` before a whole class; a property's
    getter), then one line per difference the text does not show (an entry of another
    kind than its source's decorators say, defaults, closure cells or globals that are
    not the source's, a class with ``__getattribute__``/``__getattr__``). Raises
    ``OSError``/``TypeError`` when a source cannot be read (or an entry is not a plain
    function, classmethod, staticmethod, property or class).

    Read once per process for the same definitions: a function (or its code object)
    replaced since, or another class, is read again (``install()`` computes the
    fingerprints on every call)."""
    found = []
    kinds = []   # what each entry is in its class's dict (_KINDS), None for a class or absent
    for cls_name, name in entries:
        if name is None:
            found.append(classes[cls_name])
            kinds.append(None)
            continue
        func = _vanilla(classes[cls_name], name)
        kinds.append(None if func is None else _KINDS.get(type(func), "other"))
        if type(func) is property:
            func = func.fget
        found.append(func)
    # (a classmethod is bound anew on each read: its function is what was read; anything
    # but a function, a class or None is refused before any of its attributes is read)
    funcs = tuple(obj.__func__ if type(obj) in _METHOD_TYPES else obj for obj in found)
    for obj in funcs:
        if obj is not None and type(obj) is not types.FunctionType and not issubclass(type(obj), type):
            raise TypeError(f"not a plain function or class: {type(obj).__name__}")
    held = funcs + tuple(obj.__code__ if type(obj) is types.FunctionType else None for obj in funcs)
    key = (entries, tuple(map(id, held)))
    cached = _SOURCES.get(key)
    if cached is None:
        parts = []
        declared = []
        for (cls_name, name), obj in zip(entries, found):
            if name is None:
                parts.append(f"# {cls_name}\n{_source(obj)}")
                declared.append(None)
            elif obj is None:
                parts.append(f"# {cls_name}.{name}: absent\n")
                declared.append(None)
            else:
                text = _source(obj)
                parts.append(f"# {cls_name}.{name}\n{text}")
                declared.append((_declared_defaults(text), _declared_kind(text)))
        cached = (held, "".join(parts), tuple(declared))
        if len(_SOURCES) >= 64:   # (definitions replaced again and again: keep the newest)
            _SOURCES.pop(next(iter(_SOURCES)))
        _SOURCES[key] = cached
    # What the text does not show is read every time (defaults and closure cells change
    # in place; docs/design.md, "The KV cache manager's step"): each difference adds a
    # line, and the text then no longer matches.
    edits = []
    for (cls_name, name), func, kind, declared in zip(entries, funcs, kinds, cached[2]):
        if declared is None:
            continue
        if kind != declared[1]:   # (a staticmethod where vLLM has a method, ...)
            edits.append(f"# {cls_name}.{name}: a {kind} where its source declares a {declared[1]}\n")
        elif type(func) is types.FunctionType:
            what = _edited(func, declared[0], classes[cls_name])
            if what is not None:
                edits.append(f"# {cls_name}.{name}: {what}\n")
    for cls_name in dict.fromkeys(c for c, _ in entries):
        hook = _access_hook(classes[cls_name])
        if hook is not None:
            edits.append(f"# {cls_name}: {hook}\n")
    return cached[1] + "".join(edits)


def _access_hook(cls) -> str | None:
    """``"C defines __getattribute__"`` (or ``__getattr__``) for the first class ``C`` of
    ``cls``'s MRO other than ``object`` whose own dict has one: every attribute read on
    an instance then runs its code, which no source of a mirrored method shows. None
    for a module or a class without one."""
    if not issubclass(type(cls), type):
        return None
    for c, d in _mro_dicts(cls):
        if c is object:
            continue
        for hook in ("__getattribute__", "__getattr__"):
            if hook in d:
                return f"{type.__dict__['__name__'].__get__(c)} defines {hook}"
    return None


#: The classes the native paths accept by exact type (unitary, then hybrid).
_EXACT_CLASSES = (("kv_cache_manager", "KVCacheManager"), ("kv_cache_coordinator", "UnitaryKVCacheCoordinator"),
                  ("kv_cache_coordinator", "KVCacheCoordinatorNoPrefixCache"),
                  ("kv_cache_coordinator", "HybridKVCacheCoordinator"),
                  ("single_type_kv_cache_manager", "FullAttentionManager"),
                  ("single_type_kv_cache_manager", "SlidingWindowManager"),
                  ("single_type_kv_cache_manager", "MambaManager"))


def unrelated_abc_pairs() -> tuple[tuple[type, type], ...] | str:
    """``((class, ABC), ...)``: each class of :data:`_EXACT_CLASSES` with each ABC that
    ``vllm.v1.core``'s manager, coordinator and single-type modules define and that is
    not on the class's MRO, the relations vLLM's ``isinstance`` checks would see and the
    native code assumes absent (``_core.configure_virtual_subclass_check``); or, when
    one is already a virtual subclass (an ABC's ``register()``), which (a message):
    vLLM's code then runs."""
    import importlib

    modules = {n: importlib.import_module(f"vllm.v1.core.{n}") for n in
               ("kv_cache_manager", "kv_cache_coordinator", "single_type_kv_cache_manager")}
    abcs = [obj for m in modules.values() for obj in vars(m).values()
            if isinstance(obj, abc.ABCMeta) and obj.__module__ == m.__name__]
    pairs = []
    for module, name in _EXACT_CLASSES:
        cls = vars(modules[module]).get(name)
        if not isinstance(cls, type):
            continue
        for target in abcs:
            if target in cls.__mro__:
                continue
            if issubclass(cls, target):
                return f"{name} is registered as a virtual subclass of {target.__name__}"
            pairs.append((cls, target))
    return tuple(pairs)
