/* The build's check of every C function, macro and struct field that src/ declares by
 * hand in a `cdef extern` block (Cython trusts such a declaration: a wrong result type
 * converts silently, as a hand-written PyLong_AsLongLongAndOverflow returning `int` once
 * kept the low 32 bits of every integer the native manager path read). Each line states
 * the declaration as src/ writes it, in C; the compiler compares it with CPython's
 * headers (and fastint.h), so a wrong one fails the build. tests/repo/test_capi_checks.py
 * checks that every hand-written declaration has its line here and that the line says
 * what the Cython declaration says.
 *
 * Included last by _core.pyx, after every header and verbatim block it declares from.
 * Declarations that Cython's own cpython/*.pxd provide are cimported instead.
 */
#pragma once
#include <Python.h>
#include <structmember.h>
#include <type_traits>
#include <utility>

/* A function: its exact type (result and parameters). */
#define CAPI_CHECK_FUNCTION(name, ret, params)                               \
  static_assert(std::is_same<decltype(&name), ret(*) params>::value,            \
                #name ": the declaration in src/ is not the header's " #ret #params)

/* A macro or an inline function that may be a macro in some CPython: the type of a
 * call with arguments of the declared parameter types. */
#define CAPI_CHECK_CALL(name, ret, ...)                                        \
  static_assert(std::is_same<decltype(name(std::declval<__VA_ARGS__>())), ret>::value, \
                #name ": the declared result type in src/ is not the header's " #ret)

#define CAPI_CHECK_CALL0(name, ret)                                            \
  static_assert(std::is_same<decltype(name()), ret>::value,                      \
                #name ": the declared result type in src/ is not the header's " #ret)

/* A struct field or a constant: its type. */
#define CAPI_CHECK_TYPE(expr, expected)                                               \
  static_assert(std::is_same<std::remove_cv<std::remove_reference<decltype(expr)>::type>::type, \
                             expected>::value,                                          \
                #expr ": the declared type in src/ is not the header's " #expected)

/* _core.pyx, cdef extern from "Python.h" */
CAPI_CHECK_CALL(PyLong_CheckExact, int, PyObject*);
CAPI_CHECK_FUNCTION(PyLong_FromLong, PyObject*, (long));
CAPI_CHECK_FUNCTION(PyList_Append, int, (PyObject*, PyObject*));
CAPI_CHECK_FUNCTION(PyErr_Clear, void, ());
CAPI_CHECK_FUNCTION(PyLong_AsLong, long, (PyObject*));
CAPI_CHECK_FUNCTION(PyDescr_NewMember, PyObject*, (PyTypeObject*, PyMemberDef*));
CAPI_CHECK_FUNCTION(PyType_Modified, void, (PyTypeObject*));
CAPI_CHECK_FUNCTION(PyObject_GC_UnTrack, void, (void*));
CAPI_CHECK_CALL(PyList_CheckExact, int, PyObject*);
CAPI_CHECK_CALL(Py_SIZE, Py_ssize_t, PyObject*);
CAPI_CHECK_TYPE(std::declval<PyMemberDef&>().name, const char*);
CAPI_CHECK_TYPE(std::declval<PyMemberDef&>().type, int);
CAPI_CHECK_TYPE(std::declval<PyMemberDef&>().offset, Py_ssize_t);
CAPI_CHECK_TYPE(std::declval<PyMemberDef&>().flags, int);
CAPI_CHECK_TYPE(std::declval<PyMemberDef&>().doc, const char*);
CAPI_CHECK_TYPE(std::declval<PyTypeObject&>().tp_dict, PyObject*);
CAPI_CHECK_TYPE(std::declval<PyTypeObject&>().tp_traverse, traverseproc);
static_assert(std::is_same<traverseproc, int (*)(PyObject*, visitproc, void*)>::value,
              "traverseproc: the declaration in src/ is not the header's");
static_assert(std::is_same<visitproc, int (*)(PyObject*, void*)>::value,
              "visitproc: the declaration in src/ is not the header's");

/* _core.pyx, cdef extern from "structmember.h" */
CAPI_CHECK_TYPE(T_OBJECT_EX, int);

/* _core.pyx, cdef extern from "fastint.h" */
CAPI_CHECK_FUNCTION(kvpool_long_value, long, (PyObject*));
CAPI_CHECK_FUNCTION(kvpool_true, PyObject*, ());
CAPI_CHECK_FUNCTION(kvpool_false, PyObject*, ());
CAPI_CHECK_FUNCTION(kvpool_none, PyObject*, ());
CAPI_CHECK_FUNCTION(kvpool_is_int, int, (PyObject*));
CAPI_CHECK_FUNCTION(kvpool_list_items, PyObject**, (PyObject*));
CAPI_CHECK_TYPE(KVPOOL_SI_MAX, int);
CAPI_CHECK_TYPE(KVPOOL_BATCHED, int);
CAPI_CHECK_FUNCTION(kvpool_si_init, int, ());
CAPI_CHECK_FUNCTION(kvpool_si_disable, void, ());
CAPI_CHECK_FUNCTION(kvpool_si_value, long, (PyObject*));
CAPI_CHECK_FUNCTION(kvpool_long_read, int, (PyObject*, long*));
CAPI_CHECK_FUNCTION(kvpool_si_enabled, int, ());
CAPI_CHECK_FUNCTION(kvpool_si_obj, PyObject*, (long));
CAPI_CHECK_TYPE(std::declval<kvpool_refbatch&>().d[0], Py_ssize_t);
static_assert(sizeof(((kvpool_refbatch*)0)->d) / sizeof(Py_ssize_t) == 8,
              "kvpool_refbatch.d: src/ declares 8 entries");
CAPI_CHECK_FUNCTION(kvpool_refbatch_init, void, (kvpool_refbatch*));
CAPI_CHECK_FUNCTION(kvpool_refbatch_flush, void, (kvpool_refbatch*));
CAPI_CHECK_CALL(Py_INCREF, void, PyObject*);
CAPI_CHECK_CALL(Py_DECREF, void, PyObject*);

/* manager.pxi, cdef extern from "Python.h" */
CAPI_CHECK_FUNCTION(PyDict_GetItemWithError, PyObject*, (PyObject*, PyObject*));

/* manager.pxi, cdef extern from * (its verbatim block) */
CAPI_CHECK_FUNCTION(kvpool_type_tag, unsigned int, (PyObject*));

/* manager.pxi, its second cdef extern from * (verbatim block) */
CAPI_CHECK_FUNCTION(kvpool_names_version, uint64_t, (PyObject*));
CAPI_CHECK_FUNCTION(kvpool_names_absent_known, int, (PyObject*, PyObject*));
CAPI_CHECK_FUNCTION(kvpool_str_keys_only, int, (PyObject*));
CAPI_CHECK_FUNCTION(kvpool_names_absent_store, void, (PyObject*, PyObject*, uint64_t));
