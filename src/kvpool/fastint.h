/* Fast read of a small Python int (a block's ref_cnt) without a call into
 * PyLong_AsLong: ref counts are almost always one-digit ints. Falls back to
 * PyLong_AsLong for anything else (which also handles non-compact values). */
#pragma once
/* Also: Py_True/Py_False for pointer compares, and an exact int check. */
#include <Python.h>

static inline long kvpool_long_value(PyObject* o) {
#if PY_VERSION_HEX >= 0x030C0000
  if (PyLong_CheckExact(o) && PyUnstable_Long_IsCompact((PyLongObject*)o)) {
    return (long)PyUnstable_Long_CompactValue((PyLongObject*)o);
  }
#else
  if (PyLong_CheckExact(o)) {
    Py_ssize_t size = Py_SIZE(o);
    if (size == 0) return 0;
    if (size == 1) return (long)((PyLongObject*)o)->ob_digit[0];
    if (size == -1) return -(long)((PyLongObject*)o)->ob_digit[0];
  }
#endif
  return PyLong_AsLong(o);
}

static inline PyObject* kvpool_true(void) { return Py_True; }
static inline PyObject* kvpool_false(void) { return Py_False; }
/* An int (bool included): its value is read without calling user code. */
static inline int kvpool_is_int(PyObject* o) { return PyLong_Check(o); }
