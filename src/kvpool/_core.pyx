# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""Native KV cache block metadata, free block queue and block-pool hot loops.

Extension types that vLLM 0.33.0 code touches directly, with the same names,
constructors and attributes as ``vllm/v1/core/kv_cache_utils.py``:

* :class:`KVCacheBlock` - ``block_id``, ``ref_cnt``, ``is_null`` are plain C fields
  exposed as member descriptors (read as fast as a slots dataclass field).
* :class:`FreeKVCacheBlockQueue` - the free list lives in two int32 link arrays
  (``cpp/free_block_list.h``), not in Python object references. A block's
  ``prev_free_block`` / ``next_free_block`` read those arrays, so code that inspects
  the links sees the truth.

The ``pool_*`` functions are the per-block loops of ``BlockPool`` (allocation, free,
touch, unpin, evict). Each validates every block before it changes anything, so a
rejected call leaves ref counts and the free list exactly as they were.
"""

cimport cython
from cpython.list cimport PyList_New, PyList_SET_ITEM, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.tuple cimport PyTuple_GET_ITEM
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from cpython.object cimport Py_TYPE
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
import sys
from libcpp.vector cimport vector
from libcpp.utility cimport pair
from cython.operator cimport dereference as deref

from kvpool.kvpool_cpp cimport (
    FreeBlockList, FencedFreeQueue, Order, ORDER_VLLM, ORDER_SEGMENTS, ORDER_CONTIGUOUS,
    place_ascending, ObjPtr)


cdef extern from "Python.h":
    bint _PyLong_CheckExact "PyLong_CheckExact"(PyObject* o)
    PyObject* _PyLong_FromLong "PyLong_FromLong"(long v)
    int _PyList_Append "PyList_Append"(object lst, PyObject* item)
    void _PyErr_Clear "PyErr_Clear"()
    long _PyLong_AsLong "PyLong_AsLong"(PyObject* o) except? -1
    ctypedef struct PyMemberDef:
        const char* name
        int type
        Py_ssize_t offset
        int flags
        const char* doc
    ctypedef struct _TypeObject "PyTypeObject":
        PyObject* tp_dict
    object PyDescr_NewMember(_TypeObject* tp, PyMemberDef* member)
    void PyType_Modified(_TypeObject* tp)
    # The garbage collector's protocol, for the queue's own tp_traverse.
    ctypedef int (*visitproc)(PyObject* o, void* arg)
    ctypedef int (*traverseproc)(PyObject* o, visitproc visit, void* arg)
    ctypedef struct _GCTypeObject "PyTypeObject":
        traverseproc tp_traverse
    void PyObject_GC_UnTrack(void* op)
    bint _PyList_CheckExact "PyList_CheckExact"(PyObject* o)
    Py_ssize_t _Py_SIZE "Py_SIZE"(PyObject* o)

cdef extern from "structmember.h":
    int T_OBJECT_EX


cdef extern from "fastint.h":
    long kvpool_long_value(PyObject* o) except? -1
    PyObject* kvpool_true()
    PyObject* kvpool_false()
    PyObject* kvpool_none()
    bint kvpool_is_int(PyObject* o)
    PyObject** kvpool_list_items(PyObject* lst)
    int KVPOOL_SI_MAX
    int KVPOOL_BATCHED
    int kvpool_si_init()
    void kvpool_si_disable()
    long kvpool_si_value(PyObject* p)
    bint kvpool_long_read(PyObject* p, long* out)
    bint kvpool_si_enabled()
    PyObject* kvpool_si_obj(long v)
    ctypedef struct kvpool_refbatch:
        Py_ssize_t d[8]
    void kvpool_refbatch_init(kvpool_refbatch* rb)
    void kvpool_refbatch_flush(kvpool_refbatch* rb)
    void Py_INCREF_ptr "Py_INCREF"(PyObject* o)
    void Py_DECREF_ptr "Py_DECREF"(PyObject* o)

from operator import index as _index
from libc.limits cimport LONG_MAX


cdef int32_t HEAD_SLOT = -2
cdef int32_t TAIL_SLOT = -3
cdef int32_t UNREGISTERED = -1


# -- Include submodules: one file per concept, compiled as one module (no cross-module
# calls in the per-block loops). The order is the order of definition.
include "errors.pxi"              # BlockStateError, BlockIdOutOfRangeError; loop error codes
include "block_fields.pxi"        # checked access to ref_cnt / is_null / block_id
include "refcounts.pxi"           # borrowed pointers, small-int ref_cnt, batched refcounts
include "block.pxi"               # KVCacheBlock
include "free_queue.pxi"          # FreeKVCacheBlockQueue, make_pool_blocks
include "policy_handle.pxi"       # FreeQueuePolicy: the allocation policy's handle on a queue
include "block_table.pxi"         # BlockTable (block objects created on first use)
include "block_lists.pxi"         # list / reversed(list) read in place
include "manager.pxi"             # KVCacheManager.allocate_slots for a running request (issue 17)
include "hybrid_step.pxi"         # ... and its idle step under HybridKVCacheCoordinator
include "hybrid_alloc.pxi"        # ... and its steps that free or allocate (full + sliding window)
include "hybrid_admit.pxi"        # ... and a waiting request's first allocation there
include "mamba_step.pxi"          # ... a Mamba group's part of that idle step
include "hybrid_cache.pxi"        # ... and the hybrid coordinator's cache_blocks that caches nothing
include "lookup.pxi"              # KVCacheManager.get_computed_blocks, one full-attention group
include "hybrid_lookup.pxi"       # ... and under HybridKVCacheCoordinator
include "alloc.pxi"               # pool_get_new_blocks (vLLM's order and the contiguous policy)
include "contiguous_take.pxi"     # ... the contiguous policy's allocation for a known table
include "free.pxi"                # pool_free_blocks and the shared free loop
include "touch.pxi"               # pool_touch
include "unpin_evict.pxi"         # pool_unpin_blocks, pool_blocks_to_evict
include "member_descriptors.pxi"  # T_OBJECT_EX descriptors for the hot fields
include "deferred_free.pxi"       # FencedDeferredFreeQueue


# Last: the build's check of every hand-written C declaration above and in the included
# files against CPython's headers (src/kvpool/capi_checks.h).
cdef extern from "capi_checks.h":
    pass
