/* Fast access to the small Python ints that hold a block's ref_cnt.
 *
 * A block's ref_cnt is an int object (vLLM's Python code reads and writes it as
 * one). Almost always it is one of the interpreter's cached small ints 0..256, which
 * CPython keeps in one contiguous static array. kvpool_si_* recognise such a pointer
 * and read its value from its address, and give the object for a value, without
 * touching the int object itself; anything else takes the slow path (type check and
 * PyLong_AsLong in _core.pyx).
 *
 * The hot loops also batch the reference-count updates of the ints 0..7 in a
 * kvpool_refbatch and apply them once per call (kvpool_refbatch_flush): per block,
 * an INCREF of the new value and a DECREF of the old one are read-modify-writes of
 * the same two words, a serial dependency chain through memory that dominated the
 * loops. These ints are referenced by the interpreter's cache for its whole life, so
 * a pending delta can never let one reach zero; the loops flush before any Python
 * code can run (callbacks, errors). On Python >= 3.12 small ints are immortal and
 * need no reference counting at all.
 */
#pragma once
#include <Python.h>
#include <stdint.h>

#define KVPOOL_SI_MAX 256      /* cached ints 0..256 are recognised by address */
#define KVPOOL_BATCHED 8       /* refcount updates of 0..7 are batched */

static char kvpool_si_never; /* never an int object: the "disabled" anchor */
static char* kvpool_si_zero = &kvpool_si_never;
static int kvpool_si_shift = 0;
static uintptr_t kvpool_si_span = 0;

/* Check that the ints 0..KVPOOL_SI_MAX are one contiguous array with a power-of-two
 * stride and enable the address fast path; 0 if not (the fast path stays off and
 * every access takes the checked slow path). */
static int kvpool_si_init(void) {
  PyObject* objs[KVPOOL_SI_MAX + 1];
  int v, ok = 1, shift = 0;
  uintptr_t stride;
  for (v = 0; v <= KVPOOL_SI_MAX; v++) {
    objs[v] = PyLong_FromLong(v); /* new references to the cached objects */
    if (objs[v] == NULL) {
      PyErr_Clear();
      ok = 0;
    }
  }
  if (ok) {
    stride = (uintptr_t)((char*)objs[1] - (char*)objs[0]);
    while (shift < 12 && ((uintptr_t)1 << shift) != stride) shift++;
    ok = (objs[1] > objs[0]) && (((uintptr_t)1 << shift) == stride);
    for (v = 0; ok && v <= KVPOOL_SI_MAX; v++) {
      if ((char*)objs[v] != (char*)objs[0] + ((uintptr_t)v << shift)) ok = 0;
      if (!PyLong_CheckExact(objs[v]) || PyLong_AsLong(objs[v]) != v) ok = 0;
    }
    /* A cached object is shared: PyLong_FromLong(v) again must return it. */
    for (v = 0; ok && v <= KVPOOL_SI_MAX; v++) {
      PyObject* again = PyLong_FromLong(v);
      if (again != objs[v]) ok = 0;
      Py_XDECREF(again);
    }
  }
  if (ok) {
    kvpool_si_zero = (char*)objs[0];
    kvpool_si_shift = shift;
    kvpool_si_span = (uintptr_t)KVPOOL_SI_MAX << shift;
  }
  for (v = 0; v <= KVPOOL_SI_MAX; v++) Py_XDECREF(objs[v]);
  return ok;
}

/* Turn the fast path off (every access then takes the checked slow path); for tests
 * of that path. Call between pool operations only (kvpool_si_init turns it back on). */
static void kvpool_si_disable(void) {
  kvpool_si_zero = &kvpool_si_never;
  kvpool_si_shift = 0;
  kvpool_si_span = 0;
}

/* Value of p if it is the interpreter's cached int 0..KVPOOL_SI_MAX, else -1.
 * Reads nothing from *p. */
static inline long kvpool_si_value(PyObject* p) {
  uintptr_t d = (uintptr_t)((char*)p - kvpool_si_zero);
  if (d <= kvpool_si_span && (d & (((uintptr_t)1 << kvpool_si_shift) - 1)) == 0) {
    return (long)(d >> kvpool_si_shift);
  }
  return -1;
}

/* Whether kvpool_si_obj may be used. */
static inline int kvpool_si_enabled(void) { return kvpool_si_span != 0; }

/* The cached int v, 0 <= v <= KVPOOL_SI_MAX (borrowed). Without the fast path it is
 * an address that is never an object, so pointer comparisons with it fail; only
 * kvpool_si_enabled() callers may store it. */
static inline PyObject* kvpool_si_obj(long v) {
  return (PyObject*)(kvpool_si_zero + ((uintptr_t)v << kvpool_si_shift));
}

typedef struct {
  Py_ssize_t d[KVPOOL_BATCHED]; /* pending refcount deltas of the ints 0..7 */
} kvpool_refbatch;

static inline void kvpool_refbatch_init(kvpool_refbatch* rb) {
  int v;
  for (v = 0; v < KVPOOL_BATCHED; v++) rb->d[v] = 0;
}

/* Apply the pending deltas. Never deallocates (the cache holds each object). */
static inline void kvpool_refbatch_flush(kvpool_refbatch* rb) {
  int v;
  for (v = 0; v < KVPOOL_BATCHED; v++) {
    Py_ssize_t d = rb->d[v];
    if (d == 0) continue;
    rb->d[v] = 0;
#if PY_VERSION_HEX < 0x030C0000
    {
      PyObject* o = kvpool_si_obj(v);
#ifdef Py_REF_DEBUG
      for (; d > 0; d--) Py_INCREF(o);
      for (; d < 0; d++) Py_DECREF(o);
#else
      o->ob_refcnt += d;
#endif
    }
#endif
  }
}

/* Fast read of an int's value without a call into PyLong_AsLong for one-digit ints;
 * PyLong_AsLong for anything else (which also handles non-compact values). */
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
static inline PyObject* kvpool_none(void) { return Py_None; }
/* An int (bool included): its value is read without calling user code. */
static inline int kvpool_is_int(PyObject* o) { return PyLong_Check(o); }
static inline PyObject** kvpool_list_items(PyObject* list) { return ((PyListObject*)list)->ob_item; }

/* The value of an int (a PyLong_Check object) into *out without raising: 0 when it
 * does not fit a C long (the error is cleared). Runs no Python code. */
static inline int kvpool_long_read(PyObject* o, long* out) {
  long v = kvpool_long_value(o);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return 0;
  }
  *out = v;
  return 1;
}
