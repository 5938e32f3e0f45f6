"""The sources of the vLLM definitions kvpool's native code mirrors, as the installed
vLLM defines them: what ``manager_fast_path`` and ``hybrid_fast_path`` hash into their
fingerprints (``KNOWN_SOURCES``, ``KNOWN_HYBRID_SOURCES``, ``KNOWN_MAMBA_SOURCES``)."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any


def _vanilla(cls: type, name: str):
    """vLLM's function behind ``cls.name`` (seen through kvpool's own wrappers)."""
    func = getattr(cls, name, None)
    while func is not None and hasattr(func, "__kvpool_wrapped__"):
        func = func.__kvpool_wrapped__
    return func


def _source(func) -> str:
    """``func``'s source, dedented (raises ``OSError``/``TypeError`` when unreadable)."""
    return textwrap.dedent(inspect.getsource(func))


#: definitions_source's texts in this process, by what they were read from: the ids of
#: the definitions (functions, classes, code objects), which the entry keeps alive.
_SOURCES: dict[tuple, tuple[tuple, str]] = {}


def definitions_source(entries: tuple, classes: dict[str, Any]) -> str:
    """The sources of ``entries`` (``(class name, method or None)`` in ``classes``) as the
    installed vLLM defines them, dedented, each under a ``# Class.method`` line (``:
    absent`` when the release has none; ``# Class`` before a whole class; a property's
    getter). Raises ``OSError``/``TypeError`` when a source cannot be read.

    Read once per process for the same definitions: a function (or its code object)
    replaced since, or another class, is read again (``install()`` computes the
    fingerprints on every call)."""
    found = []
    for cls_name, name in entries:
        if name is None:
            found.append(classes[cls_name])
            continue
        func = _vanilla(classes[cls_name], name)
        if isinstance(func, property):
            func = func.fget
        found.append(func)
    # (a classmethod is bound anew on each read: its function is what was read)
    funcs = tuple(getattr(obj, "__func__", obj) for obj in found)
    held = funcs + tuple(getattr(obj, "__code__", None) for obj in funcs)
    key = (entries, tuple(map(id, held)))
    cached = _SOURCES.get(key)
    if cached is not None:
        return cached[1]
    parts = []
    for (cls_name, name), obj in zip(entries, found):
        if name is None:
            parts.append(f"# {cls_name}\n{_source(obj)}")
        elif obj is None:
            parts.append(f"# {cls_name}.{name}: absent\n")
        else:
            parts.append(f"# {cls_name}.{name}\n{_source(obj)}")
    text = "".join(parts)
    if len(_SOURCES) >= 64:   # (definitions replaced again and again: keep the newest)
        _SOURCES.pop(next(iter(_SOURCES)))
    _SOURCES[key] = (held, text)
    return text
