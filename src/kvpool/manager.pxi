# The KV cache manager's common step in one native call: KVCacheManager.allocate_slots
# for a running request of a model with one full-attention KV cache group (issue 17).
#
# Mirrors vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots and what it
# calls for that shape (UnitaryKVCacheCoordinator: remove_skipped_blocks,
# get_num_blocks_to_allocate, allocate_new_blocks, cache_blocks; FullAttentionManager
# and SingleTypeKVCacheManager: the same names; create_kv_cache_blocks), vLLM 0.30.0 to
# 0.33.0, whose sources kvpool.patches.manager_fast_path fingerprints before it binds
# this function. For a running request with no new prefix hit, no external tokens and
# no encoder tokens those calls reduce to integer arithmetic on the request's table:
#
#   need      = min(min(num_computed, max_model_len) + new + lookahead, max_model_len)
#   to_alloc  = max(cdiv(need, block_size) - len(table), 0)
#   None      if to_alloc + watermark > free blocks - reserved_blocks
#   new       = block_pool.get_new_blocks(to_alloc) appended to the table (if > 0)
#   coordinator.cache_blocks(request, min(total + new, request.num_tokens)) unless
#             it would cache nothing (every full block already cached)
#
# and vLLM's own pool, coordinator and manager methods are still what run whenever
# anything is allocated or cached. Every other call (a waiting request, a prefix hit,
# a connector's tokens, a subclass, a patched method, an argument of an unexpected
# type) goes to vLLM's allocate_slots unchanged. Whether a call may go native is one
# check shared with the native cache_blocks and get_computed_blocks (_eligible).

cdef extern from *:
    """
    /* A type's attribute-cache version tag: CPython gives a type a new tag whenever it
     * or a base class is modified (PyType_Modified), and 0 when it has none. */
    static unsigned int kvpool_type_tag(PyObject* t) {
        PyTypeObject* tp = (PyTypeObject*)t;
    #ifdef Py_TPFLAGS_VALID_VERSION_TAG
        if (!(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) return 0;
    #endif
        return tp->tp_version_tag;
    }
    """
    unsigned int kvpool_type_tag(PyObject* t)


cdef extern from *:
    """
    /* _not_overridden's memory of instance dicts found holding none of a tuple of
     * method names: (dict, its ma_version_tag then, the names tuple, held). CPython
     * 3.11 and 3.12 give a dict a version tag unique in the interpreter when it is
     * created and a new one whenever it is modified, and an instance whose __dict__ has
     * been read stores its attributes in that dict; so an unchanged (dict, tag) holds
     * the same keys. Where that is not so (3.13's inline values beside a materialized
     * dict; 3.14 has no version tag), nothing is remembered and every call looks. */
    #include <stdint.h>
    /* 1: every key of dict d is an exact str, so a look-up of an exact str in it runs no
     * Python code (PyDict_Next runs none either). */
    static int kvpool_str_keys_only(PyObject* d) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(d, &pos, &key, &value)) {
            if (!PyUnicode_CheckExact(key)) return 0;
        }
        return 1;
    }
    #if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
    #define KVPOOL_DICT_VERSIONS 1
    typedef struct { PyObject* dict; uint64_t version; PyObject* names; } kvpool_absent_entry;
    static kvpool_absent_entry kvpool_absent_cache[64];
    static inline uint64_t kvpool_dict_version(PyObject* d) {
    #if defined(__GNUC__)
    #pragma GCC diagnostic push
    #pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    #endif
        return ((PyDictObject*)d)->ma_version_tag;
    #if defined(__GNUC__)
    #pragma GCC diagnostic pop
    #endif
    }
    static inline kvpool_absent_entry* kvpool_absent_slot(PyObject* d, PyObject* names) {
        uintptr_t h = ((uintptr_t)d >> 4) ^ ((uintptr_t)names >> 3);
        return &kvpool_absent_cache[(h ^ (h >> 6)) & 63];
    }
    #endif
    /* The version tag of exact dict d (0 where none is kept). */
    static uint64_t kvpool_names_version(PyObject* d) {
    #ifdef KVPOOL_DICT_VERSIONS
        return kvpool_dict_version(d);
    #else
        (void)d;
        return 0;
    #endif
    }
    /* 1: d, unchanged since, was found holding none of names. */
    static int kvpool_names_absent_known(PyObject* d, PyObject* names) {
    #ifdef KVPOOL_DICT_VERSIONS
        kvpool_absent_entry* e = kvpool_absent_slot(d, names);
        return e->dict == d && e->names == names && e->version == kvpool_dict_version(d);
    #else
        (void)d; (void)names;
        return 0;
    #endif
    }
    /* Remember that d at version tag `version` holds none of names (version 0: nothing).
     * Only a dict whose keys are all exact strs: another key's __eq__ may answer a look-up
     * differently later without changing the dict (PyDict_Next runs no Python code). */
    static void kvpool_names_absent_store(PyObject* d, PyObject* names, uint64_t version) {
    #ifdef KVPOOL_DICT_VERSIONS
        kvpool_absent_entry* e = kvpool_absent_slot(d, names);
        PyObject* old = e->names;
        if (version == 0 || !kvpool_str_keys_only(d)) return;
        Py_INCREF(names);
        e->dict = d;
        e->version = version;
        e->names = names;
        Py_XDECREF(old);
    #else
        (void)d; (void)names; (void)version;
    #endif
    }
    """
    bint kvpool_str_keys_only(PyObject* d)
    uint64_t kvpool_names_version(PyObject* d)
    bint kvpool_names_absent_known(PyObject* d, PyObject* names)
    void kvpool_names_absent_store(PyObject* d, PyObject* names, uint64_t version)


@cython.auto_pickle(False)
cdef class _Entry:
    """One native entry point's part of the shared eligibility check (:func:`_eligible`):
    the method names (``kvpool.vllm_calls``) that must not be set on the manager /
    coordinator / single-type manager instances, and what it accepts besides vLLM's
    ``UnitaryKVCacheCoordinator``."""
    cdef readonly tuple manager_names, coordinator_names, single_type_names
    # allocate_slots: KVCacheCoordinatorNoPrefixCache too (its allocation methods are
    # the unitary coordinator's; prefix caching off).
    cdef readonly bint no_prefix_cache_ok
    # get_computed_blocks: the manager's enable_caching decides first, as vLLM's
    # prefix_cache_lookup_enabled does (False: answered without the coordinator).
    cdef readonly bint reads_enable_caching
    # allocate_slots: HybridKVCacheCoordinator too, when its running step is armed
    # (hybrid_step.pxi): _eligible then returns _HYBRID.
    cdef readonly bint hybrid_ok

    def __init__(self, manager_names=(), coordinator_names=(), single_type_names=(), *,
                 bint no_prefix_cache_ok=False, bint reads_enable_caching=False,
                 bint hybrid_ok=False):
        self.manager_names = tuple(manager_names)
        self.coordinator_names = tuple(coordinator_names)
        self.single_type_names = tuple(single_type_names)
        self.no_prefix_cache_ok = no_prefix_cache_ok
        self.reads_enable_caching = reads_enable_caching
        self.hybrid_ok = hybrid_ok


@cython.auto_pickle(False)
cdef class _AllocateSlotsFastPath:
    """What the fast path was configured with (one per process)."""
    cdef public object manager_cls, coordinator_cls, full_attention_cls
    cdef public object no_prefix_cache_cls   # KVCacheCoordinatorNoPrefixCache, or None
    cdef public object vanilla            # vLLM's KVCacheManager.allocate_slots
    cdef public object vanilla_cache_blocks   # vLLM's KVCacheCoordinator.cache_blocks
    cdef public object waiting, preempted, status_type
    cdef public dict manager_module_dict  # vllm.v1.core.kv_cache_manager.__dict__
    cdef public tuple class_checks        # ((cls, name, function), ...)
    cdef public tuple class_data          # class_data_snapshot of the classes checked
    # The three entry points' parts of the eligibility check (_eligible):
    cdef public _Entry allocate_entry, cache_entry, lookup_entry
    cdef public bint enabled
    cdef public bint manager_hooks        # the policy's manager hooks are installed
    cdef public Py_ssize_t fast_calls, vllm_calls
    # The native cache_blocks (coordinator.cache_blocks -> BlockPool.cache_full_blocks):
    cdef public object pool_cls, hash_map_cls   # kvpool's BlockPool, BlockHashToBlockMap
    cdef public object pool_free_count    # vLLM's BlockPool.get_num_free_blocks, or None
    cdef public tuple pool_names          # pool methods that must not be set on the instance
    cdef public tuple cache_checks        # ((cls, name, function), ...) of the pool and map
    cdef public tuple map_names           # map methods that must not be set on the instance
    cdef readonly tuple module_functions  # ((namespace dict, name, function), ...)
    cdef readonly tuple step_globals      # the same, read by every native call's arithmetic
    # Both as C arrays of borrowed pointers (the tuples above own them): checked with one
    # PyDict_GetItemWithError each, no tuple unpacking (this runs in every native call).
    cdef vector[PyObject*] module_checks, step_checks   # dict, name, function, dict, ...
    cdef public bint native_cache, check_prefix_cacheable
    # vLLM >= 0.34.0: the map stores block ids (VllmRelease.block_ids_map), and a
    # request's cache reads are bounded by prefix_cache_hit_limit (.prefix_cache_hit_limit).
    cdef public bint map_ids, hit_limit
    cdef public Py_ssize_t native_cache_calls, vllm_cache_calls, native_evictions
    # The native get_computed_blocks (lookup.pxi):
    cdef public bint native_lookup, lookup_takes_max
    cdef public object vanilla_lookup     # vLLM's KVCacheManager.get_computed_blocks
    cdef public tuple lookup_specs        # the spec types FullAttentionManager asserts
    cdef public str eagle_attr            # the coordinator's EAGLE group ids attribute
    cdef public Py_ssize_t native_lookups, vllm_lookups
    # ... and get_num_cached_tokens (vLLM >= 0.34.0's probe of the waiting queue)
    cdef public object vanilla_num_cached   # vLLM's KVCacheManager.get_num_cached_tokens, or None
    cdef public Py_ssize_t native_probes, vllm_probes
    cdef unsigned int tags[5]
    cdef public object request_cls        # vLLM's Request (its num_tokens property), or None
    cdef unsigned int pool_tag, map_tag

    def __init__(self):
        self.enabled = False
        self.manager_hooks = False
        self.fast_calls = 0
        self.vllm_calls = 0
        self.native_cache = False
        self.check_prefix_cacheable = True
        self.map_ids = False
        self.hit_limit = False
        self.native_cache_calls = 0
        self.vllm_cache_calls = 0
        self.native_evictions = 0
        self.native_lookup = False
        self.lookup_takes_max = True
        self.native_lookups = 0
        self.vllm_lookups = 0
        self.vanilla_num_cached = None
        self.native_probes = self.vllm_probes = 0
        self.lookup_specs = ()
        self.eagle_attr = "drop_eagle_group_ids"
        self.allocate_entry = self.cache_entry = self.lookup_entry = _Entry()
        self.pool_names = ()
        self.map_names = ()
        self.cache_checks = ()
        self.module_functions = ()
        self.step_globals = ()
        self.tags[0] = self.tags[1] = self.tags[2] = self.tags[3] = self.tags[4] = 0
        self.request_cls = None
        self.no_prefix_cache_cls = None
        self.class_data = ()
        self.pool_tag = 0
        self.map_tag = 0

    cdef bint classes_unchanged(self):
        """True when the three classes still resolve every skipped method to vLLM's
        function (checked through getattr after any change to them; a classmethod by
        the function it binds)."""
        cdef object no_cache = self.no_prefix_cache_cls
        if not _namespace_entries_are(self.step_checks) or not _no_virtual_subclass():
            return False
        if self.tags_match():
            return True
        # (the attributes first: a replaced one refuses before _resolve_to reads it)
        if not _class_data_unchanged(self.class_data) or not _resolve_to(self.class_checks):
            self.tags[0] = 0
            return False
        self.tags[0] = kvpool_type_tag(<PyObject*>self.manager_cls)
        self.tags[1] = kvpool_type_tag(<PyObject*>self.coordinator_cls)
        self.tags[2] = kvpool_type_tag(<PyObject*>self.full_attention_cls)
        if no_cache is not None:
            self.tags[3] = kvpool_type_tag(<PyObject*>no_cache)
        if self.request_cls is not None:
            self.tags[4] = kvpool_type_tag(<PyObject*>self.request_cls)
        return True

    cdef inline bint tags_match(self):
        """The classes' version tags are those of their last verified state."""
        cdef object no_cache = self.no_prefix_cache_cls
        return (self.tags[0] != 0 and kvpool_type_tag(<PyObject*>self.manager_cls) == self.tags[0]
                and kvpool_type_tag(<PyObject*>self.coordinator_cls) == self.tags[1]
                and kvpool_type_tag(<PyObject*>self.full_attention_cls) == self.tags[2]
                and (no_cache is None or kvpool_type_tag(<PyObject*>no_cache) == self.tags[3])
                and (self.request_cls is None
                     or kvpool_type_tag(<PyObject*>self.request_cls) == self.tags[4]))

    cdef bint classes_verified(self):
        """:meth:`classes_unchanged` as far as it runs no code: True only when the
        classes' version tags still match those of their last verified state (no
        ``getattr`` of a patched attribute, whose descriptor could run Python code)."""
        return _namespace_entries_are(self.step_checks) and self.tags_match()

    cdef bint cache_path_unchanged(self):
        """The same for what the native cache_blocks and eviction skip: kvpool's pool
        class (and vLLM's, its base), kvpool's hash map class, and the functions of
        vLLM's module namespaces that vLLM's caching calls."""
        if not _namespace_entries_are(self.module_checks):
            return False
        if (self.pool_tag != 0 and kvpool_type_tag(<PyObject*>self.pool_cls) == self.pool_tag
                and kvpool_type_tag(<PyObject*>self.hash_map_cls) == self.map_tag):
            return True
        if not _resolve_to(self.cache_checks):
            self.pool_tag = 0
            return False
        self.pool_tag = kvpool_type_tag(<PyObject*>self.pool_cls)
        self.map_tag = kvpool_type_tag(<PyObject*>self.hash_map_cls)
        return True


# vLLM's mirrored code tells managers and coordinators apart with isinstance (a
# CrossAttentionManager, a MambaManager, a HybridKVCacheCoordinator), and an ABC's
# register() makes any class a virtual subclass without changing a version tag.
cdef object _abc_token_fn = None   # abc.get_cache_token (moves on every ABC's register())
cdef tuple _abc_pairs = ()          # ((class, ABC), ...): not subclasses when armed
cdef object _abc_token = None       # the token _abc_ok was computed at
cdef bint _abc_ok = True


def configure_virtual_subclass_check(token_fn, pairs):
    """Arm :func:`_no_virtual_subclass`: ``pairs`` ``((class, ABC), ...)``, the classes
    kvpool's native paths accept by exact type and vLLM's ABCs they are not subclasses of
    (``issubclass`` False when armed); ``token_fn``: ``abc.get_cache_token``."""
    global _abc_token_fn, _abc_pairs, _abc_token, _abc_ok
    _abc_pairs = tuple(pairs)
    _abc_token_fn = token_fn
    _abc_token = None
    _abc_ok = True


cdef bint _no_virtual_subclass():
    """No pair of ``configure_virtual_subclass_check`` has become a subclass relation
    (``CrossAttentionManager.register(FullAttentionManager)`` would make vLLM's code
    treat the full-attention group as cross-attention): ``issubclass`` of each pair read
    again only when ``abc``'s cache token moved since the last reading; an error from
    it counts as related (vLLM's call)."""
    global _abc_token, _abc_ok
    if _abc_token_fn is None:
        return True
    token = _abc_token_fn()
    if _abc_token is not None and type(token) is int and token == _abc_token:
        return _abc_ok
    ok = True
    try:
        for sub, abc_cls in _abc_pairs:
            if issubclass(sub, abc_cls):
                ok = False
                break
    except Exception:
        ok = False
    _abc_token = token
    _abc_ok = ok
    return ok


cdef bint _resolve_to(tuple checks):
    for cls, name, func in checks:
        attr = getattr(cls, name, None)
        if attr is not func and getattr(attr, "__func__", None) is not func:
            return False
    return True


cdef object _ABSENT = object()
# A class's own attributes, read through type's own descriptors (no metaclass's code runs).
cdef object _TYPE_MRO = type.__dict__["__mro__"]
cdef object _TYPE_DICT = type.__dict__["__dict__"]
# Plain methods: the class_checks' concern (a skipped method patched) or not read at all.
import types as _types
cdef object _FUNCTION = _types.FunctionType


def _cython_function_probe():   # (its type: the Cython function type kvpool binds with)
    pass


cdef object _CYFUNCTION = type(_cython_function_probe)
# Names that change how every attribute is read or set: kept whatever they hold.
cdef frozenset _ACCESS_NAMES = frozenset(("__getattribute__", "__getattr__", "__setattr__",
                                          "__delattr__", "__dict__", "__slots__", "__class__"))


cdef inline bint _is_method(obj):
    """``obj`` is exactly a Python function or a Cython function (kvpool's own bindings):
    by its type's identity only, so that no code of ``obj`` runs. Anything else is kept by
    :func:`_class_data`: a data descriptor, a value, a classmethod or staticmethod (one
    put over a mirrored method resolves, through ``getattr``, to the same function), or
    a callable or descriptor of another type (whose type could gain a ``__set__`` later
    without changing the class's version tag)."""
    t = type(obj)
    return t is _FUNCTION or t is _CYFUNCTION


cdef dict _class_data(cls):
    """``cls``'s attributes other than methods (:func:`_is_method`; the names of
    ``_ACCESS_NAMES`` always kept), by name, as an attribute look-up on the class finds
    them (the nearest class of its MRO; ``object`` left out). The native paths read the
    instances' own attributes (``req_to_blocks``, ``block_size``, ...), which a data
    descriptor added to the class would hide, and a few from the class. Reads the
    classes' dicts through ``type``'s own descriptors: no code of the classes, their
    metaclass or their attributes runs.

    Left out: ``__slotnames__`` holding exactly a list, which ``copyreg._slotnames``
    stores on an instance's class the first time the instance is copied or pickled
    (``copy.copy(coordinator)``, ``__reduce_ex__(2)`` and up). Only ``copyreg`` reads
    it; neither vLLM's mirrored methods nor the native paths do, so it changes nothing
    they read, and keeping it would turn the native path off for the rest of the
    process after one copy."""
    cdef dict found = {}
    for base in reversed(_TYPE_MRO.__get__(cls, type)):
        if base is not object:
            for name, obj in _TYPE_DICT.__get__(base, type).items():
                if name == "__slotnames__" and type(obj) is list:
                    continue   # (copyreg's cache of a class's slot names: below)
                if name in _ACCESS_NAMES or not _is_method(obj):
                    found[name] = obj
                else:
                    found.pop(name, None)   # (a method over a base's attribute)
    return found


def class_data_snapshot(classes):
    """``((cls, its attributes other than methods), ...)`` for the classes given (None
    left out), as :func:`_class_data_unchanged` compares them: taken when a native path
    is armed."""
    cdef list out = []
    for cls in classes:
        if cls is not None:
            out.append((cls, _class_data(cls)))
    return tuple(out)


cdef bint _class_data_unchanged(tuple snapshots):
    """Every class of ``snapshots`` (:func:`class_data_snapshot`) has the same attributes
    that are not methods as when the path was armed, by identity: none added (a property
    over an attribute the instances hold, which vLLM's code would read through it as
    often as it reads the attribute), removed or replaced. Methods are the
    ``class_checks``' (a patched method the native code skips) or not read at all.
    Runs after a change to a class only (its version tag)."""
    for cls, before in snapshots:
        now = _class_data(cls)
        if len(now) != len(<dict>before):
            return False
        for name, obj in now.items():
            if (<dict>before).get(name, _ABSENT) is not obj:
                return False
    return True


cdef extern from "Python.h":
    PyObject* _PyDict_GetItemWithError "PyDict_GetItemWithError"(PyObject* d, PyObject* key)


cdef inline bint _namespace_entries_are(vector[PyObject*]& checks):
    """Each (dict, name, function) triple of ``checks``: ``dict[name] is function``. A
    lookup error (a name's ``__eq__`` cannot raise: names are exact str) counts as
    changed."""
    cdef size_t i = 0
    cdef PyObject* got
    while i < checks.size():
        got = _PyDict_GetItemWithError(checks[i], checks[i + 1])
        if got != checks[i + 2]:
            if got == NULL:
                _PyErr_Clear()
            return False
        i += 3
    return True


cdef int _fill_checks(vector[PyObject*]& out, tuple triples) except -1:
    """``triples`` ((dict, str, function), ...) into ``out`` as borrowed pointers (a
    function None: NULL, the name must be absent from the dict)."""
    out.clear()
    for d, name, func in triples:
        if type(d) is not dict or type(name) is not str:
            raise TypeError("(namespace dict, name, function) triples expected")
        out.push_back(<PyObject*>d)
        out.push_back(<PyObject*>name)
        out.push_back(<PyObject*>NULL if func is None else <PyObject*>func)   # None: name absent
    return 0


cdef _AllocateSlotsFastPath _fast_path = _AllocateSlotsFastPath()


def allocate_slots_fast_path_state():
    """The fast path's configuration and counters (tests, ``kvpool info``):
    ``{"enabled", "manager_hooks", "fast_calls", "vllm_calls", "native_cache",
    "native_cache_calls", "vllm_cache_calls", "native_evictions"}`` (``*_cache_calls``:
    a one-group coordinator's ``cache_blocks`` done natively / by vLLM's code;
    ``native_evictions``: cached blocks that ``pool_get_new_blocks`` evicted itself;
    ``native_lookup``, ``native_lookups``, ``vllm_lookups``: ``get_computed_blocks``
    bound, and its calls done natively / by vLLM's code; ``native_probes``,
    ``vllm_probes``: the same for ``get_num_cached_tokens``)."""
    return {"enabled": _fast_path.enabled, "manager_hooks": _fast_path.manager_hooks,
            "fast_calls": _fast_path.fast_calls, "vllm_calls": _fast_path.vllm_calls,
            "native_cache": _fast_path.native_cache,
            "native_cache_calls": _fast_path.native_cache_calls,
            "vllm_cache_calls": _fast_path.vllm_cache_calls,
            "native_evictions": _fast_path.native_evictions,
            "native_lookup": _fast_path.native_lookup,
            "native_lookups": _fast_path.native_lookups,
            "vllm_lookups": _fast_path.vllm_lookups,
            "native_probes": _fast_path.native_probes,
            "vllm_probes": _fast_path.vllm_probes}


def configure_allocate_slots_fast_path(*, manager_cls, coordinator_cls, full_attention_cls,
                                       vanilla, waiting, preempted, manager_module_dict,
                                       class_checks, manager_names, coordinator_names,
                                       single_type_names, manager_hooks=False,
                                       pool_cls=None, hash_map_cls=None, pool_names=(),
                                       map_names=(), cache_checks=(),
                                       module_functions=(), step_globals=(), native_cache=False,
                                       check_prefix_cacheable=True, vanilla_cache_blocks=None,
                                       no_prefix_cache_cls=None, block_ids_map=False,
                                       request_cls=None):
    """Arm :func:`kv_cache_manager_allocate_slots` (called by
    ``kvpool.patches.manager_fast_path``; ``disable_allocate_slots_fast_path`` undoes it).

    ``class_checks``: ``(class, name, function)`` triples that must hold for a call to
    take the native path (a classmethod: the function it binds); ``*_names``: method
    names that must not be overridden on the manager / coordinator / single-type
    manager / pool instances. ``native_cache``: the fast path's ``cache_blocks`` runs
    natively for a pool of type ``pool_cls`` whose map is a ``hash_map_cls``, while
    ``cache_checks`` hold, each ``(namespace, name, function)`` of ``module_functions``
    (``step_globals``: the same for every native call: what the mirrored methods'
    arithmetic calls from their modules' namespaces)
    holds, and ``pool_names`` / ``map_names`` are not set on the pool / its map
    (``check_prefix_cacheable``: the release's ``SingleTypeKVCacheManager.cache_blocks``
    returns early for a spec that is not ``prefix_cacheable``, as 0.31.0's and later do:
    ``VllmRelease.cache_checks_prefix_cacheable``).
    ``no_prefix_cache_cls``: vLLM's ``KVCacheCoordinatorNoPrefixCache`` when its
    allocation methods are ``coordinator_cls``'s (prefix caching off), or None.
    ``block_ids_map``: the map's layout is vLLM >= 0.34.0's (``_cache`` of block ids,
    ``_dup_ids``); else 0.30.0-0.33.0's (blocks, a dict of them for duplicates).
    ``request_cls``: vLLM's ``Request``; a running request must be of exactly that class
    and ``class_checks`` hold its ``num_tokens`` property (vLLM reads it more often than
    the native path does), or None.
    """
    _fast_path.manager_cls = manager_cls
    _fast_path.coordinator_cls = coordinator_cls
    _fast_path.full_attention_cls = full_attention_cls
    _fast_path.no_prefix_cache_cls = no_prefix_cache_cls
    _fast_path.request_cls = request_cls
    _fast_path.vanilla = vanilla
    _fast_path.waiting = waiting
    _fast_path.preempted = preempted
    _fast_path.status_type = type(waiting)
    _fast_path.manager_module_dict = manager_module_dict
    _fast_path.class_checks = tuple(class_checks)
    _fast_path.class_data = class_data_snapshot((manager_cls, coordinator_cls, full_attention_cls,
                                                 no_prefix_cache_cls, request_cls))
    _fast_path.allocate_entry = _Entry(manager_names, coordinator_names, single_type_names,
                                       no_prefix_cache_ok=True, hybrid_ok=True)
    _fast_path.cache_entry = _Entry((), coordinator_names, single_type_names)
    _fast_path.manager_hooks = manager_hooks
    _fast_path.pool_cls = pool_cls
    _fast_path.hash_map_cls = hash_map_cls
    _fast_path.pool_names = tuple(pool_names)
    _fast_path.cache_checks = tuple(cache_checks)
    _fast_path.map_names = tuple(map_names)
    _fast_path.enabled = False          # (until the arrays below match their tuples)
    _fast_path.module_functions = tuple(module_functions)
    _fast_path.step_globals = tuple(step_globals)
    _fill_checks(_fast_path.module_checks, _fast_path.module_functions)
    _fill_checks(_fast_path.step_checks, _fast_path.step_globals)
    # (_fill_checks above raised for a namespace that is not a dict)
    _fast_path.native_cache = bool(native_cache) and pool_cls is not None and hash_map_cls is not None
    _fast_path.vanilla_cache_blocks = vanilla_cache_blocks
    _fast_path.pool_free_count = None
    if _fast_path.native_cache:   # (kvpool's pool inherits vLLM's caching methods and count)
        for cls, name, func in _fast_path.cache_checks:
            if cls is pool_cls and name == "get_num_free_blocks":
                _fast_path.pool_free_count = func
    _fast_path.pool_tag = 0
    _fast_path.map_tag = 0
    _fast_path.check_prefix_cacheable = check_prefix_cacheable
    _fast_path.map_ids = bool(block_ids_map)
    _fast_path.tags[0] = 0
    _fast_path.fast_calls = 0
    _fast_path.vllm_calls = 0
    _fast_path.native_cache_calls = 0
    _fast_path.vllm_cache_calls = 0
    _fast_path.native_evictions = 0
    _fast_path.native_lookup = False     # (configure_prefix_lookup arms it)
    _fast_path.native_lookups = 0
    _fast_path.vllm_lookups = 0
    _fast_path.enabled = True


def disable_allocate_slots_fast_path():
    """Every call of :func:`kv_cache_manager_allocate_slots` goes to vLLM's function
    (the hybrid running step too, until ``configure_hybrid_running_step`` arms it
    again)."""
    _fast_path.enabled = False
    _hybrid.enabled = False


#: The largest value _nonneg takes natively (exclusive): the native arithmetic adds at
#: most three such values (computed + new + lookahead tokens), which stays below 2**63.
#: A larger int is vLLM's to read: its Python arithmetic is unbounded.
cdef long long _NATIVE_INT_LIMIT = (<long long>1) << 60


cdef inline bint _nonneg(object x, long long* out):
    """x is an exact int in [0, 2**60): store it. Anything else (a subclass, a bool, a
    negative or larger value) -> False, and the caller hands the call to vLLM. The value
    is read at full width (CPython's own declaration of PyLong_AsLongLongAndOverflow,
    cimported: a hand-written one once returned int and kept the low 32 bits)."""
    cdef int overflow = 0
    cdef long long v
    if type(x) is not int:
        return False
    v = PyLong_AsLongLongAndOverflow(x, &overflow)
    if overflow or v < 0 or v >= _NATIVE_INT_LIMIT:
        return False
    out[0] = v
    return True


cdef inline bint _not_overridden(object obj, tuple names):
    """None of ``names`` (exact strs) is set on ``obj``'s instance dict. An exact dict
    of exact-str keys found without them is remembered with its version tag (CPython
    3.11, 3.12), so the next call on the unchanged dict reads no key; a dict holding
    another key (whose ``__eq__`` may answer differently later without changing the
    dict), or changed during the look-ups, is not remembered."""
    cdef dict d
    cdef uint64_t version
    try:
        d = obj.__dict__
    except AttributeError:
        return True
    except TypeError:   # a __dict__ that is not a dict: not ours to reason about
        return False
    if d is None:
        return False
    if kvpool_names_absent_known(<PyObject*>d, <PyObject*>names):
        return True
    version = kvpool_names_version(<PyObject*>d)
    for name in names:
        if name in d:
            return False
    if version == kvpool_names_version(<PyObject*>d):
        kvpool_names_absent_store(<PyObject*>d, <PyObject*>names, version)
    return True


cdef object _BUILTIN_METHOD = type([].extend)


cdef list _removed_events_list(object pool):
    """The list whose ``extend`` is set as ``pool._emit_block_removed_events`` on the
    instance (``pool._emit_block_removed_events = hashes.extend``: record the removed
    block hashes, in order, as the ``BlockRemoved`` events vLLM would publish), else
    None. Read without running Python code: the instance dict's entry must be a
    built-in method bound to an exact ``list`` and equal to that list's ``extend``
    (a built-in method's comparison compares its C function and its ``__self__``)."""
    cdef dict d
    try:
        d = pool.__dict__
    except (AttributeError, TypeError):
        return None
    if type(d) is not dict:
        return None
    attr = d.get("_emit_block_removed_events")
    if attr is None or type(attr) is not _BUILTIN_METHOD:
        return None
    owner = attr.__self__
    if type(owner) is not list or not (attr == (<list>owner).extend):
        return None
    return <list>owner


cdef bint _pool_not_overridden(object pool, tuple names):
    """``_not_overridden(pool, names)``, except that ``_emit_block_removed_events`` may be
    a list's ``extend`` (``_removed_events_list``), which the native eviction calls as
    vLLM's would (the native caching never removes a hash: vLLM's code does that)."""
    if _not_overridden(pool, names):
        return True
    if _removed_events_list(pool) is None:
        return False
    cdef dict d = pool.__dict__
    for name in names:
        if name in d and name != "_emit_block_removed_events":
            return False
    return True


@cython.auto_pickle(False)
cdef class VllmCallGuard:
    """Whether the methods that vLLM's version of one pool operation calls through
    ``self.`` are still vLLM's on a pool: resolved on ``type(pool)`` to ``functions``
    (checked again only after that class or a base changed: its version tag) and none
    set on the instance (``_emit_block_removed_events`` may be a list's ``extend``,
    which the native eviction honours). kvpool's native loop calls them less often
    than vLLM's (or not at all), so an operation whose guard fails runs vLLM's loop.
    The names are ``kvpool.vllm_calls.POOL_SELF_CALLS``'s; ``vllm_cls``: vLLM's class,
    whose functions of those names are vLLM's (read once, here)."""
    cdef readonly tuple names, functions
    cdef object cls
    cdef unsigned int tag

    def __init__(self, vllm_cls, tuple names):
        cdef list functions = []
        for name in names:
            functions.append(getattr(vllm_cls, <str>name))
        self.names = names
        self.functions = tuple(functions)
        self.cls = None
        self.tag = 0

    cpdef bint needs_vllm_loop(self, pool) except -1:
        """``BlockPool._needs_vllm_loop`` in one native call: callbacks must see every
        block the operation touches (reuse watchers, a metrics collector) or a method of
        :attr:`names` is not vLLM's (:meth:`intact`)."""
        if pool._reuse_watchers or pool.metrics_collector is not None:
            return True
        return not self.intact(pool)

    cpdef bint intact(self, pool) except -1:
        """True while every method of :attr:`names` is vLLM's for ``pool``."""
        cdef object cls = type(pool)
        cdef unsigned int tag = kvpool_type_tag(<PyObject*>cls)
        cdef Py_ssize_t i
        if tag == 0 or cls is not self.cls or tag != self.tag:
            for i in range(len(self.names)):
                attr = getattr(cls, <str>self.names[i], None)
                func = self.functions[i]
                if attr is not func and getattr(attr, "__func__", None) is not func:
                    return False
            self.cls = cls
            self.tag = tag
        return _pool_not_overridden(pool, self.names)


def kv_cache_manager_allocate_slots(
        self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
        num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False,
        num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0,
        has_scheduled_reqs=True, *args, **kwargs):
    """``KVCacheManager.allocate_slots`` (vllm/v1/core/kv_cache_manager.py, vLLM
    0.30.0-0.33.0) with the running request of a one-group full-attention model in one
    native call; same arguments, return value (``KVCacheBlocks`` or ``None`` when the
    pool cannot give the blocks), exceptions and side effects as vLLM's, which every
    other call runs unchanged."""
    result = _allocate_slots_native(self, request, num_new_tokens, num_new_computed_tokens,
                                    new_computed_blocks, num_lookahead_tokens,
                                    num_external_computed_tokens, delay_cache_blocks,
                                    num_encoder_tokens, full_sequence_must_fit,
                                    reserved_blocks, has_scheduled_reqs, args, kwargs)
    if result is not _VLLM:
        return result
    _fast_path.vllm_calls += 1
    context = _vllm_call_table(_fast_path, self, request) if _fast_path.manager_hooks else None
    if context is None and _context_pool is None:
        return _fast_path.vanilla(self, request, num_new_tokens, num_new_computed_tokens,
                                  new_computed_blocks, num_lookahead_tokens,
                                  num_external_computed_tokens, delay_cache_blocks,
                                  num_encoder_tokens, full_sequence_must_fit, reserved_blocks,
                                  has_scheduled_reqs, *args, **kwargs)
    # The table for the pool (or, for a call inside one that set it, none: the enclosing
    # call's table is not this call's)
    if context is None:
        state = _enter_table_context(None, None)
    else:
        state = _enter_table_context((<tuple>context)[0], (<tuple>context)[1])
    try:
        return _fast_path.vanilla(self, request, num_new_tokens, num_new_computed_tokens,
                                  new_computed_blocks, num_lookahead_tokens,
                                  num_external_computed_tokens, delay_cache_blocks,
                                  num_encoder_tokens, full_sequence_must_fit, reserved_blocks,
                                  has_scheduled_reqs, *args, **kwargs)
    finally:
        _exit_table_context(state)


# The kvpool pool whose _table_context kvpool set last (the innermost call that set one),
# or None: a call inside it that sets none hides it (_enter_table_context).
cdef object _context_pool = None


cdef tuple _enter_table_context(pool, context):
    """``pool._table_context = context`` (``pool`` kvpool's exact ``BlockPool``, or None:
    set nothing), the context an enclosing call set hidden (None) until
    :func:`_exit_table_context`, so that the pool never reads another call's table.
    Returns what the exit restores."""
    global _context_pool
    outer_pool = _context_pool
    outer = None
    if outer_pool is not None:
        outer = outer_pool._table_context
        outer_pool._table_context = None
    before = None
    if pool is not None:
        before = pool._table_context
        pool._table_context = context
    _context_pool = pool
    return (outer_pool, outer, pool, before)


cdef int _exit_table_context(tuple state) except -1:
    """Undo :func:`_enter_table_context` (``state``: its result), innermost first."""
    global _context_pool
    outer_pool, outer, pool, before = state
    if pool is not None:
        pool._table_context = before
    if outer_pool is not None:
        outer_pool._table_context = outer
    _context_pool = outer_pool
    return 0


cdef tuple _vllm_call_table(_AllocateSlotsFastPath fp, manager, request):
    """For vLLM's own ``allocate_slots`` on a one-group full-attention model (a waiting
    request's, a new prefix hit's): ``(pool, (mgr, request_id, expected_tokens))``, the
    table every allocation of that call extends, as
    :func:`kvpool.allocation.base.table_of_caller` would find it in the call's frames
    (the one ``FullAttentionManager``'s ``allocate_new_blocks`` /
    ``allocate_external_computed_blocks`` for ``request.request_id``; ``expected_tokens``
    ``num_prompt_tokens + max_tokens`` when both are ints, else None), for the pool to
    read as ``_table_context`` instead of walking the frames on each allocation. On a
    hybrid model (the hybrid step's coordinator and classes, :func:`_eligible`'s
    ``_HYBRID``): ``(pool, (None, request_id, expected_tokens))``, the pool then finding
    only the allocating group's manager in the frames, not the ``allocate_slots`` frame
    above it (``table_of_caller(frame, told)``). None
    where the call's classes or instances are not vLLM's (:func:`_eligible`), the
    request is not of vLLM's ``Request`` class (the native
    path's: its attributes read as plainly as the native step reads them) or the pool
    is not kvpool's exact ``BlockPool`` (the pool then walks the frames; and where
    checking the classes would run a patched attribute's code)."""
    if (not fp.enabled or (fp.request_cls is not None and type(request) is not fp.request_cls)
            or fp.pool_cls is None or not fp.classes_verified()):
        # (another request class: its attributes may run code; classes whose check would
        # run a patched attribute's descriptor: the pool walks the frames)
        return None
    try:
        mgr = _eligible(fp, fp.allocate_entry, manager, None)
        if mgr is _HYBRID:
            # (the hybrid step's classes vLLM's: the pool is the attribute its step reads)
            if not _hybrid.classes_unchanged():
                return None
            pool = manager.block_pool
            mgr = None   # (which group allocates: the allocating frame's manager)
        elif mgr is None or mgr is _CACHING_OFF:
            return None
        else:
            pool = mgr.block_pool
    except AttributeError:   # (an attribute deleted: vLLM's call reads it, or not)
        return None
    # (read as table_of_caller reads them: never raising before vLLM's call)
    request_id = getattr(request, "request_id", None)
    if (type(request_id) is not str or type(pool) is not fp.pool_cls
            or pool._kvpool_init is not True):   # (kvpool's exact pool: plain attributes)
        return None
    prompt = getattr(request, "num_prompt_tokens", None)
    max_tokens = getattr(request, "max_tokens", None)
    expected = prompt + max_tokens if type(prompt) is int and type(max_tokens) is int else None
    return (pool, (mgr, request_id, expected))


cdef object _VLLM = object()   # "this call is vLLM's": nothing has been changed yet
cdef object _CACHING_OFF = object()   # _eligible: the manager's prefix caching is off


cdef object _eligible(_AllocateSlotsFastPath fp, _Entry entry, manager, coordinator):
    """The one check of the native manager path's entry points (``allocate_slots``, the
    coordinator's ``cache_blocks``, ``get_computed_blocks``): may this call run natively?

    ``manager``: the ``KVCacheManager`` the call is on, whose coordinator is then read
    from it; None for ``cache_blocks`` (``coordinator`` is the call's). Returns the
    coordinator's one ``FullAttentionManager`` when the manager is exactly vLLM's class,
    the coordinator exactly ``UnitaryKVCacheCoordinator`` (or, for
    ``entry.no_prefix_cache_ok``, ``KVCacheCoordinatorNoPrefixCache``) with one
    single-type manager of exactly that class, no skipped method is patched on the
    classes (:meth:`_AllocateSlotsFastPath.classes_unchanged`) nor set on the instances
    (``entry``'s names). For ``entry.hybrid_ok`` with the hybrid step armed
    (hybrid_step.pxi): ``_HYBRID`` for ``HybridKVCacheCoordinator``, and for
    ``KVCacheCoordinatorNoPrefixCache`` over any other groups (the hybrid step checks
    them). For ``entry.reads_enable_caching`` (the lookup) the manager's
    ``enable_caching`` is read before the coordinator, as vLLM's
    ``prefix_cache_lookup_enabled`` reads it: False gives ``_CACHING_OFF``, another
    value than True None. Anything else: None (vLLM's code runs the call). Reads plain
    attributes of objects of vLLM's exact classes only; changes nothing."""
    if manager is not None:
        if (type(manager) is not fp.manager_cls or not fp.classes_unchanged()
                or not _not_overridden(manager, entry.manager_names)):
            return None
        if entry.reads_enable_caching:
            enable_caching = manager.enable_caching
            if enable_caching is False:
                return _CACHING_OFF
            if enable_caching is not True:
                return None
        coordinator = manager.coordinator
    cdef bint hybrid = entry.hybrid_ok and manager is not None and _hybrid.enabled
    if type(coordinator) is not fp.coordinator_cls and not (
            entry.no_prefix_cache_ok and fp.no_prefix_cache_cls is not None
            and type(coordinator) is fp.no_prefix_cache_cls):
        if hybrid and (type(coordinator) is _hybrid.coordinator_cls
                       or (_hybrid.no_prefix_cls is not None
                           and type(coordinator) is _hybrid.no_prefix_cls)):
            return _HYBRID
        return None
    # (a coordinator without prefix caching over other groups than one full-attention
    # group: the hybrid step's, when armed for it)
    hybrid = (hybrid and _hybrid.no_prefix_cls is not None
              and type(coordinator) is _hybrid.no_prefix_cls)
    managers = coordinator.single_type_managers
    if type(managers) is not tuple or len(<tuple>managers) != 1:
        return _HYBRID if hybrid else None
    mgr = (<tuple>managers)[0]
    if type(mgr) is not fp.full_attention_cls:
        return _HYBRID if hybrid else None
    if ((manager is None and not fp.classes_unchanged())
            or not _not_overridden(coordinator, entry.coordinator_names)
            or not _not_overridden(mgr, entry.single_type_names)):
        return None
    return mgr


cdef struct _Step:
    # allocate_slots' numbers for one native call (tokens; blocks for the last three)
    long long new_tokens, lookahead, computed, max_len, block_size, reserved, watermark


cdef bint _step_arguments(_Step* s, num_new_tokens, num_new_computed_tokens,
                          new_computed_blocks, num_lookahead_tokens,
                          num_external_computed_tokens, delay_cache_blocks,
                          num_encoder_tokens, full_sequence_must_fit, reserved_blocks,
                          has_scheduled_reqs):
    """``allocate_slots``' arguments are those of a running request's step (no new
    prefix hit, connector or encoder tokens; exact ints and bools), read into ``s``;
    False for any other call (vLLM's)."""
    return not (new_computed_blocks is not None
                or type(num_new_computed_tokens) is not int or num_new_computed_tokens != 0
                or type(num_external_computed_tokens) is not int
                or num_external_computed_tokens != 0
                or type(num_encoder_tokens) is not int or num_encoder_tokens != 0
                or full_sequence_must_fit is not False
                or (delay_cache_blocks is not False and delay_cache_blocks is not True)
                or (has_scheduled_reqs is not False and has_scheduled_reqs is not True)
                or not _nonneg(num_new_tokens, &s.new_tokens) or s.new_tokens == 0
                or not _nonneg(num_lookahead_tokens, &s.lookahead)
                or not _nonneg(reserved_blocks, &s.reserved))


cdef bint _running_step(_AllocateSlotsFastPath fp, manager, coordinator, mgr, request,
                        str request_id, bint has_scheduled_reqs, _Step* s):
    """The request is a running one whose step the native arithmetic computes (it has a
    table, no pending copy-on-write block, and the counts vLLM's arithmetic reads are
    exact ints), its numbers read into ``s``; False otherwise (vLLM's call)."""
    if fp.request_cls is not None and type(request) is not fp.request_cls:
        return False
    num_cached_block = mgr.num_cached_block
    if type(coordinator) is fp.coordinator_cls:
        running = type(num_cached_block) is dict and request_id in <dict>num_cached_block
    else:
        # Without prefix caching num_cached_block stays empty; with no computed blocks
        # vLLM's get_num_blocks_to_allocate gives max(required - len(table), 0) on
        # either of its branches, so the request only needs a table.
        req_to_blocks = mgr.req_to_blocks
        running = (mgr.enable_caching is False and isinstance(req_to_blocks, dict)
                   and request_id in <dict>req_to_blocks)
    if (not running                                           # not a running request
            or request_id in getattr(mgr, "_partial_hit_reqs", ())  # a pending CoW copy
            or not _nonneg(mgr.block_size, &s.block_size) or s.block_size == 0
            or not _nonneg(manager.max_model_len, &s.max_len)
            or not _nonneg(request.num_computed_tokens, &s.computed)
            # read by vLLM's arithmetic and discarded for this shape (remove_skipped_blocks'
            # in-flight tokens and prompt length, 0.33.0's prefill_end): of another type
            # they make vLLM's raise, so they are vLLM's to read
            or type(request.num_in_flight_tokens) is not int
            or type(request.num_prompt_tokens) is not int):
        return False
    return _step_watermark(fp, manager, request, has_scheduled_reqs, s)


cdef bint _step_watermark(_AllocateSlotsFastPath fp, manager, request,
                          bint has_scheduled_reqs, _Step* s):
    """``s.watermark``: vLLM's ``allocate_slots`` reserves the manager's
    ``watermark_blocks`` (an exact non-negative int, else False: vLLM's call) for a
    waiting or preempted request when ``has_scheduled_reqs``, else 0 (the status is then
    not read, as vLLM does not read it)."""
    s.watermark = 0
    if not has_scheduled_reqs:
        return True
    status = request.status
    if type(status) is not fp.status_type:
        return False
    if status is fp.waiting or status is fp.preempted:
        return _nonneg(manager.watermark_blocks, &s.watermark)
    return True


cdef object _allocate_slots_native(self, request, num_new_tokens, num_new_computed_tokens,
                                   new_computed_blocks, num_lookahead_tokens,
                                   num_external_computed_tokens, delay_cache_blocks,
                                   num_encoder_tokens, full_sequence_must_fit,
                                   reserved_blocks, has_scheduled_reqs, tuple args,
                                   dict kwargs):
    """The native path, or _VLLM before any side effect when the call is not its: the
    arguments (:func:`_step_arguments`), the shared check (:func:`_eligible`), the
    request (:func:`_running_step`); then vLLM's ``get_num_blocks_to_allocate`` against
    the free count, ``allocate_new_blocks`` (:func:`_extend_table`), ``cache_blocks``
    (:func:`_cache_after_step`) and ``create_kv_cache_blocks``."""
    cdef _AllocateSlotsFastPath fp = _fast_path
    cdef _Step s
    cdef long long total, need, to_alloc, free_blocks
    if not fp.enabled:
        return _VLLM
    if (args or kwargs
            or not _step_arguments(&s, num_new_tokens, num_new_computed_tokens,
                                   new_computed_blocks, num_lookahead_tokens,
                                   num_external_computed_tokens, delay_cache_blocks,
                                   num_encoder_tokens, full_sequence_must_fit,
                                   reserved_blocks, has_scheduled_reqs)):
        if not _hybrid.enabled:
            return _VLLM
        # (a waiting request's admission, under the hybrid coordinator: hybrid_admit.pxi)
        return _hybrid_admission(fp, self, request, num_new_tokens, num_new_computed_tokens,
                                 new_computed_blocks, num_lookahead_tokens,
                                 num_external_computed_tokens, delay_cache_blocks,
                                 num_encoder_tokens, full_sequence_must_fit,
                                 reserved_blocks, has_scheduled_reqs, args, kwargs)
    mgr = _eligible(fp, fp.allocate_entry, self, None)
    if mgr is None:
        return _VLLM
    if mgr is _HYBRID:
        return _hybrid_running_step(fp, self, request, &s, has_scheduled_reqs is True,
                                    delay_cache_blocks is True)
    coordinator = self.coordinator
    request_id = request.request_id
    if (type(request_id) is not str
            or not _running_step(fp, self, coordinator, mgr, request, <str>request_id,
                                 has_scheduled_reqs is True, &s)):
        return _VLLM
    total = s.computed if s.computed < s.max_len else s.max_len
    need = total + s.new_tokens + s.lookahead
    if need > s.max_len:
        need = s.max_len
    # coordinator.remove_skipped_blocks: full attention skips no token.
    # coordinator.get_num_blocks_to_allocate (a running request, no new hit):
    to_alloc = ((need + s.block_size - 1) // s.block_size
                - len(mgr.req_to_blocks.get(request_id, ())))
    if to_alloc < 0:
        to_alloc = 0
    pool = self.block_pool
    if not _native_free_count(fp, pool, &free_blocks) \
            and not _nonneg(pool.get_num_free_blocks(), &free_blocks):
        return _VLLM
    fp.fast_calls += 1
    if fp.manager_hooks and to_alloc > 0:
        # what kvpool.allocation.base.table_of_caller finds for vLLM's managers:
        # the request's expected length, for the allocation's table (_extend_table)
        policy = getattr(self.block_pool, "_policy", None)
        if policy is not None:
            policy.expect_tokens(request_id, request.num_prompt_tokens + request.max_tokens)
    if to_alloc + s.watermark > free_blocks - s.reserved:
        return None
    new_blocks = _extend_table(fp, mgr, <str>request_id, need, s.block_size)
    if not delay_cache_blocks:
        _cache_after_step(fp, coordinator, mgr, request, <str>request_id,
                          total + s.new_tokens, s.block_size)
    # create_kv_cache_blocks((new_blocks,))
    if not new_blocks:
        return self.empty_kv_cache_blocks
    return fp.manager_module_dict["KVCacheBlocks"]((new_blocks,))


cdef object _extend_table(_AllocateSlotsFastPath fp, mgr, str request_id, long long need,
                          long long block_size):
    """``coordinator.allocate_new_blocks`` -> ``FullAttentionManager.allocate_new_blocks``
    for a request whose table must cover ``need`` tokens: the pool's ``get_new_blocks``
    appended to the table (and to ``new_block_ids`` when the manager records them);
    returns ``[] + new blocks`` (vLLM's ``cow_blocks + new_blocks``), or None when the
    table already covers them."""
    table = mgr.req_to_blocks[request_id]
    cdef long long to_alloc = (need + block_size - 1) // block_size - len(table)
    if to_alloc <= 0:
        return None
    pool = mgr.block_pool
    new_blocks = None
    if (fp.manager_hooks and type(pool) is fp.pool_cls and pool._kvpool_init is True
            and type(table) is list and _pool_runs_no_code(_hybrid, pool)):
        # kvpool's contiguous policy, natively (contiguous_take.pxi)
        new_blocks = _contiguous_take(pool, mgr, request_id, <list>table, to_alloc)
    if new_blocks is not None:
        pass
    elif fp.manager_hooks and getattr(pool, "_kvpool_init", False):
        # The pool's table context (a C frame has no locals for
        # kvpool.allocation.base.table_of_caller to find).
        state = _enter_table_context(pool, (mgr, request_id))
        try:
            new_blocks = pool.get_new_blocks(to_alloc)
        finally:
            _exit_table_context(state)
    elif _default_take_native(fp, pool, table):
        # kvpool's BlockPool.get_new_blocks without its Python frames: the native loop,
        # and no hook (the default policies' after_change does nothing; run by the
        # method, between the loop and the table's extend, an exception entering it, a
        # signal's, left the blocks held by no table)
        new_blocks = pool_get_new_blocks(pool.free_block_queue, to_alloc, pool.enable_caching,
                                         pool.cached_block_hashes_by_block,
                                         pool._maybe_evict_cached_block, pool=pool)
    else:
        new_blocks = pool.get_new_blocks(to_alloc)
    try:
        table.extend(new_blocks)
    except BaseException:
        # (a MemoryError: vLLM's allocate_new_blocks would keep the new blocks held by
        # no table; they go back to the pool, without the hashes they were evicted of)
        pool.free_blocks(new_blocks)
        raise
    if mgr._record_new_block_ids:
        ids = []   # (built by hand: tests/repo/test_layout.py, no comprehensions)
        for b in new_blocks:
            ids.append(b.block_id)
        mgr.new_block_ids.extend(ids)
    return [] + new_blocks   # vLLM returns cow_blocks + new_blocks


cdef bint _default_take_native(_AllocateSlotsFastPath fp, pool, table) except -1:
    """An allocation of :func:`_extend_table` may call kvpool's native loop itself, as
    kvpool's ``BlockPool.get_new_blocks`` would: the pool kvpool's exact class, its
    calls and its policy's hooks kvpool's own (:func:`_pool_runs_no_code`: armed with
    the hybrid step, vLLM 0.34.0), no table context set, a policy that needs no table
    and whose ``after_change`` does nothing (kvpool's default policies), the table a
    list."""
    if (fp.manager_hooks or type(pool) is not fp.pool_cls or type(table) is not list
            or not _pool_runs_no_code(_hybrid, pool) or pool._table_context is not None):
        return False
    policy = pool._policy
    return (type(policy).manager_hooks is False
            and getattr(type(policy), "after_change", None) is _hybrid.policy_noop_change)


cdef int _cache_after_step(_AllocateSlotsFastPath fp, coordinator, mgr, request,
                           str request_id, long long num_tokens,
                           long long block_size) except -1:
    """``coordinator.cache_blocks(request, min(num_tokens, request.num_tokens))`` as
    vLLM's ``allocate_slots`` calls it, natively (:func:`_cache_blocks_native`) where it
    can, skipped where it would cache nothing: each manager caches at most
    ``min(tokens, hashed tokens) // block_size`` blocks of the request."""
    cdef long long request_tokens, n_cache, n_cached
    rt = request.num_tokens
    if not _nonneg(rt, &request_tokens):
        coordinator.cache_blocks(request, min(num_tokens, rt))
        return 0
    n_cache = num_tokens if num_tokens < request_tokens else request_tokens
    if not mgr.enable_caching:
        return 0
    num_cached_block = mgr.num_cached_block
    cached = ((<dict>num_cached_block).get(request_id, 0)
              if type(num_cached_block) is dict else None)
    # (FullAttentionManager also caches a partial prompt tail when its block is larger
    # than the hash block: then every call caches.)
    if (not _nonneg(cached, &n_cached) or n_cached < n_cache // block_size
            or mgr.block_pool.hash_block_size != mgr.block_size):
        if not _cache_blocks_native(fp, coordinator, mgr, request, request_id, n_cache):
            # vLLM's function: what coordinator.cache_blocks resolves to (checked by
            # _eligible), less the native attempt just made.
            fp.vllm_cache_calls += 1
            fp.vanilla_cache_blocks(coordinator, request, n_cache)
    return 0


def kv_cache_coordinator_cache_blocks(self, request, num_computed_tokens, *args, **kwargs):
    """``KVCacheCoordinator.cache_blocks`` (vllm/v1/core/kv_cache_coordinator.py, vLLM
    0.30.0-0.34.0) as ``UnitaryKVCacheCoordinator.cache_blocks``: for one full-attention
    group, the blocks of ``request`` that ``num_computed_tokens`` (tokens, including
    those already cached) fill are hashed and inserted into the prefix cache natively
    (see ``_cache_blocks_native``); every other call (another coordinator or manager
    type, a patched method, events on, an argument of another type) is vLLM's. Also
    bound as ``HybridKVCacheCoordinator.cache_blocks`` when the hybrid step is armed: a
    call that caches nothing in any group returns at once (:func:`_hybrid_cache_blocks`).
    Returns None, raises what vLLM's raises."""
    cdef _AllocateSlotsFastPath fp = _fast_path
    cdef long long n
    if (fp.enabled and _hybrid.enabled and type(self) is _hybrid.coordinator_cls
            and not args and not kwargs and _nonneg(num_computed_tokens, &n)):
        return _hybrid_cache_blocks(fp, self, request, num_computed_tokens, n)
    if fp.enabled and fp.native_cache and not args and not kwargs \
            and _nonneg(num_computed_tokens, &n):
        mgr = _eligible(fp, fp.cache_entry, None, self)
        if mgr is not None:
            request_id = request.request_id
            if (type(request_id) is str
                    and _cache_blocks_native(fp, self, mgr, request, <str>request_id, n)):
                return None
    fp.vllm_cache_calls += 1
    return fp.vanilla_cache_blocks(self, request, num_computed_tokens, *args, **kwargs)


cdef tuple _FREE_COUNT_NAMES = ("get_num_free_blocks",)


cdef bint _native_free_count(_AllocateSlotsFastPath fp, pool, long long* out) except -1:
    """``pool.get_num_free_blocks()`` (vLLM's ``BlockPool.get_num_free_blocks``: the
    queue's ``num_free_blocks``) read natively from kvpool's queue when that is the
    method the pool's class and instance have; False (nothing read) otherwise, or
    when the count is negative (a test's assignment), for vLLM's call to decide."""
    cdef Py_ssize_t n
    if (fp.pool_free_count is None or type(pool) is not fp.pool_cls
            or getattr(fp.pool_cls, "get_num_free_blocks", None) is not fp.pool_free_count
            or not _not_overridden(pool, _FREE_COUNT_NAMES)):
        return False
    queue = pool.free_block_queue
    if type(queue) is not FreeKVCacheBlockQueue:
        return False
    n = <Py_ssize_t>(<FreeKVCacheBlockQueue>queue)._list.size() + (<FreeKVCacheBlockQueue>queue)._count_offset
    if n < 0:
        return False
    out[0] = n
    return True


cdef dict _native_map_cache(_AllocateSlotsFastPath fp, pool, tuple pool_names=None):
    """The ``_cache`` dict of ``pool``'s prefix-cache map when the native caching and
    eviction may write it: kvpool's pool and map, their methods unpatched (class and
    instance), the module functions vLLM's caching calls unreplaced, KV events off;
    else None (vLLM's code). ``pool_names``: for a reader (the lookup), the only pool
    methods that must not be set on the instance, and the pool's KV events do not
    matter (the caller checks what it needs)."""
    if (not fp.native_cache or type(pool) is not fp.pool_cls or not fp.cache_path_unchanged()
            or not (_pool_not_overridden(pool, fp.pool_names) if pool_names is None
                    else _not_overridden(pool, pool_names))):
        return None
    if pool_names is None and pool.enable_kv_cache_events is not False:
        return None
    hash_map = pool.cached_block_hash_to_block
    if type(hash_map) is not fp.hash_map_cls or not _not_overridden(hash_map, fp.map_names):
        return None
    if fp.map_ids and (type(hash_map._dup_ids) is not dict or hash_map._blocks is not pool.blocks):
        return None
    cache = hash_map._cache
    return <dict>cache if type(cache) is dict else None


cdef int _insert_block_id(dict cache, dict dup_ids, key, block_id) except -1:
    """vLLM >= 0.34.0's ``BlockHashToBlockMap.insert`` of a block (``block_id`` an int;
    the caller checked the key's entries are ints): ``_cache`` keeps the first id of a
    key, ``_dup_ids`` every id, in insertion order, of a key several blocks cache."""
    first = cache.setdefault(key, block_id)
    if first != block_id:
        dups = dup_ids.get(key)
        if dups is None:
            dups = {first: None}
            dup_ids[key] = dups
        (<dict>dups)[block_id] = None
    return 0


cdef bint _ids_entry_readable(dict cache, dict dup_ids, key) except -1:
    """The key's entries in an ids map are what :func:`_insert_block_id` and the native
    eviction read without running Python code: an int (or nothing) in ``_cache``, a
    dict (or nothing) in ``_dup_ids``."""
    entry = cache.get(key)
    if entry is not None and type(entry) is not int:
        return False
    dups = dup_ids.get(key)
    return dups is None or type(dups) is dict


cdef bint _cache_blocks_native(_AllocateSlotsFastPath fp, coordinator, mgr, request,
                               str request_id, long long num_computed_tokens) except -1:
    """``coordinator.cache_blocks(request, num_computed_tokens)`` for the fast path's
    shape, natively: True when done (vLLM's result exactly), False before any side
    effect when the call is vLLM's to make.

    Mirrors, for one ``FullAttentionManager`` whose block size is the hash block size
    and a pool without KV events (vLLM 0.30.0-0.34.0, fingerprinted with the rest):
    ``KVCacheCoordinator.cache_blocks`` (tokens less ``num_reprefillable_tokens``),
    ``SingleTypeKVCacheManager.cache_blocks`` (``num_full_blocks``; full attention's
    ``reachable_block_mask`` is None), ``BlockPool.cache_full_blocks`` and
    ``_insert_block_hash`` (:func:`_insert_full_blocks`). A block that already has a
    hash (vLLM's partial-to-full promotion), a block, map, hash or count of another
    type, an event queue, a pool subclass or a patched pool method: vLLM's code.
    """
    cdef long long reprefill, num_tokens
    if not _nonneg(coordinator.num_reprefillable_tokens, &reprefill):
        return False
    # KVCacheCoordinator.cache_blocks / get_num_cacheable_tokens
    num_tokens = num_computed_tokens - reprefill
    if num_tokens < 0:
        num_tokens = 0
    return _cache_group_native(fp, mgr, request, request_id, num_tokens)


cdef bint _cache_group_native(_AllocateSlotsFastPath fp, mgr, request, str request_id,
                              long long num_tokens) except -1:
    """``SingleTypeKVCacheManager.cache_blocks(request, num_tokens)`` of one
    ``FullAttentionManager`` (no mask) whose block size is the hash block size, natively
    (:func:`_cache_blocks_native`'s conditions): True when done, False before any side
    effect when the call is vLLM's to make."""
    cdef long long num_cached, num_full, group_id, bs, hash_bs
    pool = mgr.block_pool
    cache_o = _native_map_cache(fp, pool)
    if (cache_o is None
            or not _nonneg(mgr.block_size, &bs) or bs == 0
            or not _nonneg(pool.hash_block_size, &hash_bs) or hash_bs != bs
            or not _nonneg(mgr.kv_cache_group_id, &group_id)
            or group_id >= (<long long>1 << 32)):
        return False
    if mgr.enable_caching is not True:
        return False
    if fp.check_prefix_cacheable and mgr.kv_cache_spec.prefix_cacheable is not True:
        return False
    num_cached_block = mgr.num_cached_block
    block_hashes = request.block_hashes
    if type(num_cached_block) is not dict or type(block_hashes) is not list:
        return False
    # SingleTypeKVCacheManager.cache_blocks
    if not _nonneg((<dict>num_cached_block).get(request_id, 0), &num_cached):
        return False
    num_full = num_tokens // bs
    if num_full > len(<list>block_hashes):
        return False        # (0.33.0 caps at the hashed tokens; 0.30.0 would index past them)
    if num_cached >= num_full:
        return True
    blocks = mgr.req_to_blocks.get(request_id)
    if (type(blocks) is not list or len(<list>blocks) < num_full
            or not _blocks_cacheable(<list>blocks, <list>block_hashes, num_cached, num_full)):
        return False
    fp.native_cache_calls += 1
    _insert_full_blocks(fp, pool, <dict>cache_o, request, request_id, <list>blocks,
                        <list>block_hashes, num_cached, num_full, bs, group_id)
    (<dict>num_cached_block)[request_id] = num_full
    return True


cdef bint _blocks_cacheable(list blocks, list block_hashes, long long start,
                            long long stop) except -1:
    """Every block of ``blocks[start:stop]`` is one :func:`_insert_full_blocks` reads
    without running Python code: a kvpool block, null or without a hash, whose hash in
    ``block_hashes`` is bytes and whose id is an int (checked before anything changes)."""
    cdef KVCacheBlock blk
    cdef PyObject* null_o
    cdef long long i
    for i in range(start, stop):
        b = blocks[i]
        if type(b) is not KVCacheBlock:
            return False
        blk = <KVCacheBlock>b
        null_o = blk._is_null_o
        if null_o != kvpool_false() and null_o != kvpool_true():
            return False
        if null_o == kvpool_true():
            continue
        if (blk._block_hash is not None or blk._block_hash_num_tokens is not None
                or type(block_hashes[i]) is not bytes or blk._block_id_o is NULL
                or type(<object>blk._block_id_o) is not int):
            return False
    return True


cdef bytes _group_suffix(long long group_id):
    """``make_block_hash_with_group_id``'s suffix: the group id as 4 big-endian bytes."""
    cdef unsigned char buf[4]
    buf[0] = (group_id >> 24) & 0xFF
    buf[1] = (group_id >> 16) & 0xFF
    buf[2] = (group_id >> 8) & 0xFF
    buf[3] = group_id & 0xFF
    return PyBytes_FromStringAndSize(<const char*>buf, 4)


cdef int _insert_full_blocks(_AllocateSlotsFastPath fp, pool, dict cache, request,
                             str request_id, list blocks, list block_hashes,
                             long long start, long long num_full, long long bs,
                             long long group_id) except -1:
    """``BlockPool.cache_full_blocks`` / ``_insert_block_hash`` for ``blocks[start:
    num_full]`` (checked by :func:`_blocks_cacheable`): each non-null block's key (its
    hash + the group suffix) set on the block and inserted into the pool's map
    (``cache``: its ``_cache``), block by block, as vLLM's loop does without events or
    mask. Where a block or map entry is one this cannot read without running Python
    code, vLLM's own ``cache_full_blocks`` does the rest of the blocks."""
    cdef KVCacheBlock blk
    cdef long long i
    dup_ids = None
    suffix = _group_suffix(group_id)
    for i in range(start, num_full):
        # (Re-read: a finalizer run by the garbage collector while this loop creates a
        # dict could have changed the lists; none does in vLLM.)
        if (i >= len(blocks) or i >= len(block_hashes) or type(blocks[i]) is not KVCacheBlock
                or type(block_hashes[i]) is not bytes):
            raise RuntimeError(f"kvpool: the block table or block hashes of request "
                               f"{request_id!r} changed during cache_blocks")
        blk = <KVCacheBlock>blocks[i]
        if blk._is_null_o == kvpool_true():
            continue
        if blk._block_hash is not None:
            # Only if the table holds one block twice (checked None above, hashed by
            # this loop): vLLM's own cache_full_blocks for the rest, which is what it
            # would have done with these blocks (no events, no mask: block by block).
            pool.cache_full_blocks(request, blocks, i, num_full, bs, group_id)
            break
        key = <bytes>block_hashes[i] + suffix
        block_id = <object>blk._block_id_o
        if fp.map_ids:
            # vLLM >= 0.34.0's _insert_block_hash for a block without a hash:
            # set_block_hash, then the map's insert (no contain check first).
            if dup_ids is None:
                dup_ids = pool.cached_block_hash_to_block._dup_ids
            if type(dup_ids) is not dict or not _ids_entry_readable(cache, <dict>dup_ids, key):
                pool.cache_full_blocks(request, blocks, i, num_full, bs, group_id)
                break
            blk._block_hash = key
            blk._block_hash_num_tokens = (i + 1) * bs
            _insert_block_id(cache, <dict>dup_ids, key, block_id)
        elif not _insert_block(cache, key, blk, block_id, (i + 1) * bs):
            # An entry this loop cannot read without running Python code (which could
            # change the table it walks): vLLM's own code for the rest.
            pool.cache_full_blocks(request, blocks, i, num_full, bs, group_id)
            break
    return 0


cdef bint _insert_block(dict cache, bytes key, KVCacheBlock blk, block_id,
                        long long num_tokens) except -1:
    """vLLM 0.30.0-0.33.0's ``_insert_block_hash`` of a block without a hash into a map
    of blocks (``cache``: key -> block, or -> {block id: block}): skipped when the key
    already holds it (``BlockHashToBlockMap.contain``), else ``set_block_hash`` and
    ``insert``. False, nothing changed, for an entry of another type."""
    entry = cache.get(key)
    entry_id = None
    if entry is not None and type(entry) is not dict:
        entry_id = _block_id(<KVCacheBlock>entry) if type(entry) is KVCacheBlock else None
        if type(entry_id) is not int:
            return False
    if entry is not None:
        if type(entry) is dict:
            if block_id in <dict>entry:
                return True
        elif entry_id == block_id:
            return True
    # KVCacheBlock.set_block_hash, then BlockHashToBlockMap.insert
    blk._block_hash = key
    blk._block_hash_num_tokens = num_tokens
    if entry is None:
        cache[key] = blk
    elif type(entry) is dict:
        (<dict>entry)[block_id] = blk
    else:
        cache[key] = {entry_id: entry, block_id: blk}
    return True


def kv_cache_blocks_get_block_ids(self, allow_none=False, *, group_ids=None):
    """``KVCacheBlocks.get_block_ids`` (vllm/v1/core/kv_cache_manager.py, vLLM
    0.30.0-0.33.0) compiled: per KV cache group (all, or ``group_ids`` in that order)
    the list of its blocks' ``block_id``; ``None`` when ``allow_none`` and every
    selected group is empty. The scheduler calls it for every scheduled request of
    every step. Same results and exceptions as vLLM's."""
    cdef list ids
    cdef list out
    blocks = self.blocks
    if group_ids is None:
        groups = blocks
    else:
        out = []
        for group_id in group_ids:
            out.append(blocks[group_id])
        groups = tuple(out)
    if allow_none:
        for group in groups:
            if not len(group) == 0:
                break
        else:
            return None
    out = []
    for group in groups:
        ids = []
        for blk in group:
            ids.append(blk.block_id)
        out.append(ids)
    return tuple(out)
