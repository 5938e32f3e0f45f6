# The KV cache manager's common step in one native call: KVCacheManager.allocate_slots
# for a running request of a model with one full-attention KV cache group (issue 17).
#
# Mirrors vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots and what it
# calls for that shape (UnitaryKVCacheCoordinator: remove_skipped_blocks,
# get_num_blocks_to_allocate, allocate_new_blocks, cache_blocks; FullAttentionManager
# and SingleTypeKVCacheManager: the same names; create_kv_cache_blocks), vLLM 0.30.0 and
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
# type) goes to vLLM's allocate_slots unchanged.

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
    int PyLong_AsLongLongAndOverflow(object o, int* overflow) except? -1


cdef class _AllocateSlotsFastPath:
    """What the fast path was configured with (one per process)."""
    cdef public object manager_cls, coordinator_cls, full_attention_cls
    cdef public object vanilla            # vLLM's KVCacheManager.allocate_slots
    cdef public object waiting, preempted, status_type
    cdef public dict manager_module_dict  # vllm.v1.core.kv_cache_manager.__dict__
    cdef public tuple class_checks        # ((cls, name, function), ...)
    cdef public tuple manager_names, coordinator_names, single_type_names
    cdef public bint enabled
    cdef public bint manager_hooks        # the policy's manager hooks are installed
    cdef public Py_ssize_t fast_calls, vllm_calls
    cdef unsigned int tags[3]

    def __init__(self):
        self.enabled = False
        self.manager_hooks = False
        self.fast_calls = 0
        self.vllm_calls = 0
        self.tags[0] = self.tags[1] = self.tags[2] = 0

    cdef bint classes_unchanged(self):
        """True when the three classes still resolve every skipped method to vLLM's
        function (checked through getattr after any change to them)."""
        if (self.tags[0] != 0 and kvpool_type_tag(<PyObject*>self.manager_cls) == self.tags[0]
                and kvpool_type_tag(<PyObject*>self.coordinator_cls) == self.tags[1]
                and kvpool_type_tag(<PyObject*>self.full_attention_cls) == self.tags[2]):
            return True
        for cls, name, func in self.class_checks:
            if getattr(cls, name, None) is not func:
                self.tags[0] = 0
                return False
        self.tags[0] = kvpool_type_tag(<PyObject*>self.manager_cls)
        self.tags[1] = kvpool_type_tag(<PyObject*>self.coordinator_cls)
        self.tags[2] = kvpool_type_tag(<PyObject*>self.full_attention_cls)
        return True


cdef _AllocateSlotsFastPath _fast_path = _AllocateSlotsFastPath()


def allocate_slots_fast_path_state():
    """The fast path's configuration and counters (tests, ``kvpool info``):
    ``{"enabled", "manager_hooks", "fast_calls", "vllm_calls"}``."""
    return {"enabled": _fast_path.enabled, "manager_hooks": _fast_path.manager_hooks,
            "fast_calls": _fast_path.fast_calls, "vllm_calls": _fast_path.vllm_calls}


def configure_allocate_slots_fast_path(*, manager_cls, coordinator_cls, full_attention_cls,
                                       vanilla, waiting, preempted, manager_module_dict,
                                       class_checks, manager_names, coordinator_names,
                                       single_type_names, manager_hooks=False):
    """Arm :func:`kv_cache_manager_allocate_slots` (called by
    ``kvpool.patches.manager_fast_path``; ``disable_allocate_slots_fast_path`` undoes it).

    ``class_checks``: ``(class, name, function)`` triples that must hold for a call to
    take the native path; ``*_names``: method names that must not be overridden on the
    manager / coordinator / single-type manager instances.
    """
    _fast_path.manager_cls = manager_cls
    _fast_path.coordinator_cls = coordinator_cls
    _fast_path.full_attention_cls = full_attention_cls
    _fast_path.vanilla = vanilla
    _fast_path.waiting = waiting
    _fast_path.preempted = preempted
    _fast_path.status_type = type(waiting)
    _fast_path.manager_module_dict = manager_module_dict
    _fast_path.class_checks = tuple(class_checks)
    _fast_path.manager_names = tuple(manager_names)
    _fast_path.coordinator_names = tuple(coordinator_names)
    _fast_path.single_type_names = tuple(single_type_names)
    _fast_path.manager_hooks = manager_hooks
    _fast_path.tags[0] = 0
    _fast_path.fast_calls = 0
    _fast_path.vllm_calls = 0
    _fast_path.enabled = True


def disable_allocate_slots_fast_path():
    """Every call of :func:`kv_cache_manager_allocate_slots` goes to vLLM's function."""
    _fast_path.enabled = False


cdef inline bint _nonneg(object x, long long* out):
    """x is an exact int in [0, 2**62): store it. Anything else (a subclass, a bool, a
    negative or huge value) -> False, and the caller hands the call to vLLM."""
    cdef int overflow = 0
    cdef long long v
    if type(x) is not int:
        return False
    v = PyLong_AsLongLongAndOverflow(x, &overflow)
    if overflow or v < 0 or v >= (<long long>1 << 62):
        return False
    out[0] = v
    return True


cdef inline bint _not_overridden(object obj, tuple names):
    cdef dict d
    try:
        d = obj.__dict__
    except AttributeError:
        return True
    except TypeError:   # a __dict__ that is not a dict: not ours to reason about
        return False
    for name in names:
        if name in d:
            return False
    return True


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
    return _fast_path.vanilla(self, request, num_new_tokens, num_new_computed_tokens,
                              new_computed_blocks, num_lookahead_tokens,
                              num_external_computed_tokens, delay_cache_blocks,
                              num_encoder_tokens, full_sequence_must_fit, reserved_blocks,
                              has_scheduled_reqs, *args, **kwargs)


cdef object _VLLM = object()   # "this call is vLLM's": nothing has been changed yet


cdef object _allocate_slots_native(self, request, num_new_tokens, num_new_computed_tokens,
                                   new_computed_blocks, num_lookahead_tokens,
                                   num_external_computed_tokens, delay_cache_blocks,
                                   num_encoder_tokens, full_sequence_must_fit,
                                   reserved_blocks, has_scheduled_reqs, tuple args,
                                   dict kwargs):
    """The native path, or _VLLM before any side effect when the call is not its."""
    cdef _AllocateSlotsFastPath fp = _fast_path
    cdef long long new_tokens, lookahead, reserved, computed, max_len, block_size
    cdef long long watermark = 0, total, need, to_alloc, free_blocks, n_cache
    cdef long long n_cached, request_tokens
    cdef object coordinator, mgr, managers, request_id, status, table, new_blocks, pool
    cdef object num_cached_block
    if (not fp.enabled or args or kwargs or type(self) is not fp.manager_cls
            or new_computed_blocks is not None
            or type(num_new_computed_tokens) is not int or num_new_computed_tokens != 0
            or type(num_external_computed_tokens) is not int or num_external_computed_tokens != 0
            or type(num_encoder_tokens) is not int or num_encoder_tokens != 0
            or full_sequence_must_fit is not False
            or (delay_cache_blocks is not False and delay_cache_blocks is not True)
            or (has_scheduled_reqs is not False and has_scheduled_reqs is not True)
            or not _nonneg(num_new_tokens, &new_tokens) or new_tokens == 0
            or not _nonneg(num_lookahead_tokens, &lookahead)
            or not _nonneg(reserved_blocks, &reserved)):
        return _VLLM
    coordinator = self.coordinator
    if type(coordinator) is not fp.coordinator_cls:
        return _VLLM
    managers = coordinator.single_type_managers
    if type(managers) is not tuple or len(<tuple>managers) != 1:
        return _VLLM
    mgr = (<tuple>managers)[0]
    request_id = request.request_id
    if (type(mgr) is not fp.full_attention_cls or type(request_id) is not str
            or not fp.classes_unchanged()
            or not _not_overridden(self, fp.manager_names)
            or not _not_overridden(coordinator, fp.coordinator_names)
            or not _not_overridden(mgr, fp.single_type_names)):
        return _VLLM
    num_cached_block = mgr.num_cached_block   # read once: checked, then used
    if (type(num_cached_block) is not dict
            or request_id not in <dict>num_cached_block      # not a running request
            or request_id in getattr(mgr, "_partial_hit_reqs", ())  # a pending CoW copy
            or not _nonneg(mgr.block_size, &block_size) or block_size == 0
            or not _nonneg(self.max_model_len, &max_len)
            or not _nonneg(request.num_computed_tokens, &computed)):
        return _VLLM
    if has_scheduled_reqs:
        status = request.status
        if type(status) is not fp.status_type:
            return _VLLM
        if status is fp.waiting or status is fp.preempted:
            if not _nonneg(self.watermark_blocks, &watermark):
                return _VLLM
    total = computed if computed < max_len else max_len
    need = total + new_tokens + lookahead
    if need > max_len:
        need = max_len
    # coordinator.remove_skipped_blocks: full attention skips no token.
    # coordinator.get_num_blocks_to_allocate (a running request, no new hit):
    to_alloc = (need + block_size - 1) // block_size - len(mgr.req_to_blocks.get(request_id, ()))
    if to_alloc < 0:
        to_alloc = 0
    if not _nonneg(self.block_pool.get_num_free_blocks(), &free_blocks):
        return _VLLM
    fp.fast_calls += 1
    if fp.manager_hooks:
        # kvpool.patches.manager_hooks._recording_expected_tokens
        policy = getattr(self.block_pool, "_policy", None)
        if policy is not None:
            policy.expect_tokens(request_id, request.num_prompt_tokens + request.max_tokens)
    if to_alloc + watermark > free_blocks - reserved:
        return None
    # coordinator.allocate_new_blocks -> FullAttentionManager.allocate_new_blocks
    table = mgr.req_to_blocks[request_id]
    to_alloc = (need + block_size - 1) // block_size - len(table)
    new_blocks = None
    if to_alloc > 0:
        pool = mgr.block_pool
        if fp.manager_hooks and getattr(pool, "_kvpool_init", False):
            # kvpool.patches.manager_hooks._extending_table: the pool knows the table.
            outer = pool._table_context
            pool._table_context = (mgr, request_id)
            try:
                new_blocks = pool.get_new_blocks(to_alloc)
            finally:
                pool._table_context = outer
        else:
            new_blocks = pool.get_new_blocks(to_alloc)
        table.extend(new_blocks)
        if mgr._record_new_block_ids:
            ids = []   # (built by hand: tests/repo/test_layout.py, no comprehensions)
            for b in new_blocks:
                ids.append(b.block_id)
            mgr.new_block_ids.extend(ids)
        new_blocks = [] + new_blocks   # vLLM returns cow_blocks + new_blocks
    if not delay_cache_blocks:
        # coordinator.cache_blocks, unless it would cache nothing: each manager caches
        # at most min(tokens, hashed tokens) // block_size blocks of the request.
        rt = request.num_tokens
        if not _nonneg(rt, &request_tokens):
            coordinator.cache_blocks(request, min(total + new_tokens, rt))
        else:
            n_cache = total + new_tokens
            if request_tokens < n_cache:
                n_cache = request_tokens
            if mgr.enable_caching:
                num_cached_block = mgr.num_cached_block
                cached = ((<dict>num_cached_block).get(request_id, 0)
                          if type(num_cached_block) is dict else None)
                # (FullAttentionManager also caches a partial prompt tail when its
                # block is larger than the hash block: then every call caches.)
                if (not _nonneg(cached, &n_cached) or n_cached < n_cache // block_size
                        or mgr.block_pool.hash_block_size != mgr.block_size):
                    coordinator.cache_blocks(request, n_cache)
    # create_kv_cache_blocks((new_blocks,))
    if not new_blocks:
        return self.empty_kv_cache_blocks
    return fp.manager_module_dict["KVCacheBlocks"]((new_blocks,))




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
