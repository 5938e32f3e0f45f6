# The running request's step under vLLM's HybridKVCacheCoordinator when it changes
# nothing (kvpool.patches.hybrid_fast_path; included by _core.pyx after manager.pxi).
#
# A decode step of a running request on a model with full-attention and sliding-window
# KV cache groups usually needs no new block in any group, frees no block that left the
# window, and caches no block: vLLM's KVCacheManager.allocate_slots then returns the
# manager's shared empty KVCacheBlocks after about fifteen Python calls across the
# coordinator and the groups' managers. _hybrid_running_step recognises that case from
# the same plain attributes vLLM's code reads, and answers it; every other call (a step
# that allocates, frees, caches or copies a block, another manager type, a patched
# method) goes to vLLM's code before anything is changed.


@cython.auto_pickle(False)
cdef class _HybridStep:
    """The hybrid path's configuration (``configure_hybrid_running_step``): the classes
    whose methods it mirrors, the checks that they are still vLLM's, its counters."""
    cdef public bint enabled
    cdef public object coordinator_cls       # vLLM's HybridKVCacheCoordinator
    cdef public object full_attention_cls    # FullAttentionManager
    cdef public object sliding_window_cls    # SlidingWindowManager
    cdef public object full_spec_cls, sliding_spec_cls   # FullAttentionSpec, SlidingWindowSpec
    cdef public object mamba_cls, mamba_spec_cls   # MambaManager, MambaSpec (None: not armed)
    cdef public object no_prefix_cls         # KVCacheCoordinatorNoPrefixCache (None: not armed)
    cdef public object spec_group_cls        # SpecGroup (hybrid_lookup.pxi; None: lookups stay vLLM's)
    cdef public tuple class_checks           # ((cls, name, function), ...)
    cdef public tuple class_data             # class_data_snapshot of the classes checked
    cdef public tuple coordinator_names      # not to be set on the coordinator instance
    cdef public tuple single_type_names      # ... nor on a group's manager
    cdef public tuple mamba_names            # ... nor on a Mamba group's manager
    cdef readonly tuple step_globals         # ((namespace dict, name, value), ...)
    cdef vector[PyObject*] step_checks
    cdef unsigned int tags[8]
    cdef int n_classes
    cdef public Py_ssize_t native_steps, vllm_steps
    cdef public Py_ssize_t native_cache_calls, vllm_cache_calls
    cdef public Py_ssize_t native_changes   # steps that freed or allocated natively
    cdef public Py_ssize_t group_cache_calls   # cache_blocks run group by group
    cdef public Py_ssize_t native_lookups   # get_computed_blocks answered by hybrid_lookup.pxi
    cdef public Py_ssize_t native_admissions, vllm_admissions   # hybrid_admit.pxi's first allocations
    cdef public object pool_free_blocks, pool_get_new_blocks, pool_needs_vllm_loop   # kvpool's BlockPool's
    cdef public object pool_touch
    cdef public object table_factory   # the managers' req_to_blocks default_factory (vLLM's untracked_list)
    cdef public tuple policy_hooks     # ((policy class, after_change, after_free), ...): kvpool's
    cdef public object policy_noop_change   # AllocationPolicy.after_change (does nothing)

    def __init__(self):
        self.enabled = False
        self.class_checks = self.coordinator_names = self.single_type_names = self.mamba_names = ()
        self.class_data = ()
        self.mamba_cls = self.mamba_spec_cls = self.no_prefix_cls = self.spec_group_cls = None
        self.n_classes = 5
        self.step_globals = ()
        self.tags[0] = 0
        self.native_steps = self.vllm_steps = 0
        self.native_cache_calls = self.vllm_cache_calls = 0
        self.native_changes = self.group_cache_calls = self.native_lookups = 0
        self.native_admissions = self.vllm_admissions = 0
        self.pool_free_blocks = self.pool_get_new_blocks = self.pool_needs_vllm_loop = None
        self.pool_touch = self.table_factory = None
        self.policy_hooks = ()
        self.policy_noop_change = None

    cdef bint classes_unchanged(self):
        """The hybrid coordinator's, the managers' and their specs' classes (Mamba's and
        the coordinator without prefix caching when armed) still resolve every mirrored
        method and property to vLLM's, and the module names they read are vLLM's (no
        module name shadows a builtin they call; checked through getattr after any change
        to the classes). The request's class is the native
        manager path's (``_AllocateSlotsFastPath.request_cls``), checked by
        :func:`_eligible` before it returns ``_HYBRID``."""
        cdef int i, n
        cdef PyObject* classes[8]
        if not _namespace_entries_are(self.step_checks) or not _no_virtual_subclass():
            return False
        classes[0] = <PyObject*>self.coordinator_cls
        classes[1] = <PyObject*>self.full_attention_cls
        classes[2] = <PyObject*>self.sliding_window_cls
        classes[3] = <PyObject*>self.full_spec_cls
        classes[4] = <PyObject*>self.sliding_spec_cls
        n = 5
        if self.mamba_cls is not None:
            classes[5] = <PyObject*>self.mamba_cls
            classes[6] = <PyObject*>self.mamba_spec_cls
            n = 7
        if self.no_prefix_cls is not None:
            classes[n] = <PyObject*>self.no_prefix_cls
            n += 1
        if n != self.n_classes:
            return False
        if self.tags[0] != 0:
            i = 0
            while i < n and kvpool_type_tag(classes[i]) == self.tags[i]:
                i += 1
            if i == n:
                return True
        # (the attributes first: a replaced one refuses before _resolve_to reads it)
        if not _class_data_unchanged(self.class_data) or not _resolve_to(self.class_checks):
            self.tags[0] = 0
            return False
        for i in range(n):
            self.tags[i] = kvpool_type_tag(classes[i])
        return True


from collections import defaultdict as _defaultdict


cdef inline object _list_item(list items, long long index):
    """``items[index]`` for ``0 <= index < len(items)``, else None. The bound is read at
    the access: a dict look-up or an attribute read before it may have run Python code
    (a key's ``__eq__``) that shortened the list, and the module is built without
    bounds checks."""
    if index < 0 or index >= len(items):
        return None
    return items[index]

cdef _HybridStep _hybrid = _HybridStep()
cdef object _HYBRID = object()   # _eligible: the coordinator is the hybrid one (armed)


def configure_hybrid_running_step(*, coordinator_cls, full_attention_cls, sliding_window_cls,
                                  full_spec_cls, sliding_spec_cls,
                                  class_checks, coordinator_names, single_type_names,
                                  step_globals=(), mamba_cls=None, mamba_spec_cls=None,
                                  mamba_names=(), pool_methods=None, no_prefix_cls=None,
                                  spec_group_cls=None, table_factory=None, contiguous=None,
                                  policy_hooks=(), policy_noop_change=None):
    """Arm the hybrid running step of :func:`kv_cache_manager_allocate_slots` (called by
    ``kvpool.patches.hybrid_fast_path`` after the native allocate_slots is configured;
    ``disable_allocate_slots_fast_path`` disarms both).

    ``class_checks``: ``(class, name, function)`` triples that must hold (vLLM's
    ``HybridKVCacheCoordinator``, ``FullAttentionManager``, ``SlidingWindowManager``
    methods the step's code calls, the specs' ``prefix_cacheable`` properties);
    ``*_names``: method names that must not be set on the coordinator / group manager
    instances; ``step_globals``: ``(namespace dict, name,
    value)`` triples of the module names those methods read (value None: the name must
    be absent, a builtin they call). ``mamba_cls`` / ``mamba_spec_cls``: vLLM's
    ``MambaManager`` and ``MambaSpec`` when the Mamba groups' idle step is armed too
    (``class_checks`` and ``step_globals`` then cover its methods; ``mamba_names``: its
    methods that must not be set on a Mamba manager instance); None: a model with a
    Mamba group keeps vLLM's step. ``pool_methods``: kvpool's ``BlockPool.free_blocks``,
    ``get_new_blocks``, ``_needs_vllm_loop`` and ``touch`` (the functions), which the
    steps that free and allocate (``hybrid_alloc.pxi``) and a waiting request's first
    allocation (``hybrid_admit.pxi``) require a pool to have; None: those stay vLLM's.
    ``no_prefix_cls``: vLLM's ``KVCacheCoordinatorNoPrefixCache`` (the coordinator of
    every model with prefix caching off), whose methods ``class_checks``
    then cover too: a hybrid model's running step under it is this step's (with caching
    off in every group); None: such steps stay vLLM's. ``spec_group_cls``: vLLM's
    ``SpecGroup`` (the entries of the coordinator's ``attention_groups``), which arms the
    native prefix-cache lookup of ``hybrid_lookup.pxi`` (``class_checks`` then cover
    ``HybridKVCacheCoordinator.find_longest_cache_hit``); None: lookups stay vLLM's.
    ``table_factory``: the ``default_factory`` of vLLM's managers' ``req_to_blocks``
    (``vllm.utils.gc_utils.untracked_list``), which a waiting request's first
    allocation (``hybrid_admit.pxi``) lets make the request's tables as vLLM's code
    does; None: those allocations stay vLLM's. ``contiguous``: kvpool's
    ``(ContiguousPolicy, ContiguousPolicy.extend_table, ContiguousPolicy.after_change,
    AllocationPolicy.queue_policy, ContiguousPolicy.expect_tokens, BlockPool._take)``,
    which the native manager path's allocations under ``allocation="contiguous"`` run
    natively while they are those (``contiguous_take.pxi``); None: through the pool.
    ``policy_hooks``: ``(policy class, after_change, after_free)`` of kvpool's allocation
    policies, the hooks the steps call after the pool's native loops
    (:func:`_pool_runs_no_code` requires a pool's policy to be one of those classes with
    those functions, not set on the instance; empty: the steps that free and allocate
    stay vLLM's); ``policy_noop_change``: ``AllocationPolicy.after_change``, which does
    nothing (an allocation of the default policy then runs no hook)."""
    if (mamba_cls is None) != (mamba_spec_cls is None):
        raise ValueError("mamba_cls and mamba_spec_cls go together")
    _hybrid.enabled = False
    _hybrid.coordinator_cls = coordinator_cls
    _hybrid.full_attention_cls = full_attention_cls
    _hybrid.sliding_window_cls = sliding_window_cls
    _hybrid.full_spec_cls = full_spec_cls
    _hybrid.sliding_spec_cls = sliding_spec_cls
    _hybrid.class_checks = tuple(class_checks)
    _hybrid.class_data = class_data_snapshot((coordinator_cls, full_attention_cls, sliding_window_cls,
                                              full_spec_cls, sliding_spec_cls, mamba_cls,
                                              mamba_spec_cls, no_prefix_cls))
    _hybrid.coordinator_names = tuple(coordinator_names)
    _hybrid.single_type_names = tuple(single_type_names)
    _hybrid.mamba_cls = mamba_cls
    _hybrid.mamba_spec_cls = mamba_spec_cls
    _hybrid.mamba_names = tuple(mamba_names)
    _hybrid.no_prefix_cls = no_prefix_cls
    _hybrid.spec_group_cls = spec_group_cls
    _hybrid.table_factory = table_factory
    _hybrid.policy_hooks = tuple(tuple(hooks) for hooks in policy_hooks)
    _hybrid.policy_noop_change = policy_noop_change
    _configure_contiguous_take(contiguous)
    _hybrid.n_classes = (5 if mamba_cls is None else 7) + (no_prefix_cls is not None)
    _hybrid.step_globals = tuple(step_globals)
    _fill_checks(_hybrid.step_checks, _hybrid.step_globals)
    _hybrid.tags[0] = 0
    _hybrid.native_steps = _hybrid.vllm_steps = 0
    _hybrid.native_cache_calls = _hybrid.vllm_cache_calls = 0
    _hybrid.native_changes = _hybrid.group_cache_calls = _hybrid.native_lookups = 0
    _hybrid.native_admissions = _hybrid.vllm_admissions = 0
    (_hybrid.pool_free_blocks, _hybrid.pool_get_new_blocks, _hybrid.pool_needs_vllm_loop,
     _hybrid.pool_touch) = (None, None, None, None) if pool_methods is None else tuple(pool_methods)
    _hybrid.enabled = True


def hybrid_running_step_state():
    """``{"enabled", "mamba", "native_steps", "vllm_steps", "native_changes",
    "group_cache_calls", "native_cache_calls", "vllm_cache_calls", "native_lookups",
    "native_admissions", "vllm_admissions", "contiguous_takes"}``:
    whether the hybrid step is armed (and for Mamba groups), the idle running steps it
    answered, those of a hybrid coordinator it handed to vLLM's code, the steps that
    freed or allocated natively, the coordinator's ``cache_blocks`` calls run group by
    group (a full-attention group natively), found caching nothing, and handed on, and
    the prefix-cache lookups answered by ``hybrid_lookup.pxi``, and the first allocations
    of waiting requests under a hybrid coordinator answered by ``hybrid_admit.pxi`` and
    handed to vLLM's code, and the native manager path's allocations that ran the
    contiguous policy natively (``contiguous_take.pxi``; tests, ``kvpool info``)."""
    return {"enabled": _hybrid.enabled, "mamba": _hybrid.enabled and _hybrid.mamba_cls is not None,
            "native_steps": _hybrid.native_steps, "vllm_steps": _hybrid.vllm_steps,
            "native_changes": _hybrid.native_changes,
            "group_cache_calls": _hybrid.group_cache_calls,
            "native_cache_calls": _hybrid.native_cache_calls,
            "vllm_cache_calls": _hybrid.vllm_cache_calls,
            "native_lookups": _hybrid.native_lookups,
            "native_admissions": _hybrid.native_admissions,
            "vllm_admissions": _hybrid.vllm_admissions,
            "contiguous_takes": _contiguous.native_takes}


cdef object _hybrid_running_step(_AllocateSlotsFastPath fp, manager, request, _Step* s,
                                 bint has_scheduled_reqs, bint delay_cache_blocks):
    """vLLM 0.34.0's ``KVCacheManager.allocate_slots`` for a running request under
    ``HybridKVCacheCoordinator`` (the manager already checked by :func:`_eligible`, the
    arguments by :func:`_step_arguments`), after the checks of
    :func:`_hybrid_step_prelude`: when every group is idle (:func:`_hybrid_step_idle`)
    the manager's ``empty_kv_cache_blocks``, or None when the watermark / reserved
    blocks refuse the step as vLLM's free-count check does; on a full + sliding-window
    model a step that frees, allocates or caches is :func:`_hybrid_step_changes`'s;
    _VLLM otherwise (a Mamba group's changing step), before anything is changed. An
    attribute missing where the step
    reads one (a test's or a plugin's deletion) also leaves the call to vLLM's code,
    which reads it, or not, as it does: every read here is a plain attribute of an
    object of vLLM's exact class, so reading it twice runs no code twice."""
    cdef _HybridStep hp = _hybrid
    cdef long long free_blocks = 0, to_alloc = 0
    cdef _HybridTokens t
    try:
        pre = _hybrid_step_prelude(hp, fp, manager, request, s, has_scheduled_reqs,
                                   delay_cache_blocks, &t)
    except AttributeError:
        pre = None
    if pre is None:
        hp.vllm_steps += 1
        return _VLLM
    try:
        idle = _hybrid_step_idle(hp, fp, manager, request, s, delay_cache_blocks, pre, &t,
                                 &free_blocks, &to_alloc)
    except AttributeError:
        idle = False
    if not idle:
        # (a Mamba group's changing step is vLLM's: nothing read again before its call)
        result = _VLLM if t.served != 1 else _hybrid_step_changes(
            hp, fp, manager, request, s, has_scheduled_reqs, delay_cache_blocks)
        if result is _VLLM:
            hp.vllm_steps += 1
        return result
    hp.native_steps += 1
    # (an idle step allocates nothing: the contiguous policy needs no expected length;
    # to_alloc: vLLM's sum of get_num_blocks_to_allocate, which a Mamba group whose
    # table is longer than it needs makes negative)
    if to_alloc + s.watermark > free_blocks - s.reserved:
        return None
    return manager.empty_kv_cache_blocks


cdef struct _HybridTokens:
    # the hybrid step's token counts (vLLM 0.34.0 allocate_slots' arithmetic for a
    # running request: no new hit, no external tokens)
    int served                   # _hybrid_managers_served: 1, or 2 with a Mamba group
    bint no_prefix               # the coordinator is KVCacheCoordinatorNoPrefixCache
    long long in_flight, request_tokens
    long long main               # computed (capped at max_model_len) + new tokens
    long long need               # main + lookahead, capped at max_model_len
    long long processed          # computed less the in-flight tokens, at least 0


cdef tuple _hybrid_step_prelude(_HybridStep hp, _AllocateSlotsFastPath fp, manager, request,
                                _Step* s, bint has_scheduled_reqs, bint delay_cache_blocks,
                                _HybridTokens* t):
    """The checks every native hybrid step starts with, read only (the idle test's and
    the changing step's): the request of the native path's class, the mirrored classes
    unchanged, a coordinator of served managers (:func:`_hybrid_managers_served`) with
    no mirrored method on its instance and plain numbers
    (:func:`_hybrid_coordinator_plain`), a ``str`` request id, the manager's empty
    ``KVCacheBlocks`` a tuple with one entry per group, and the request's numbers exact
    ints (:func:`_hybrid_request_numbers`). Returns ``(managers, request_id,
    empty_blocks)`` with the token counts in ``t``; None when vLLM's code runs the
    call. AttributeError propagates (the caller's: vLLM's call)."""
    cdef long long total
    if type(request) is not fp.request_cls or not hp.classes_unchanged():
        return None
    coordinator = manager.coordinator
    t.no_prefix = hp.no_prefix_cls is not None and type(coordinator) is hp.no_prefix_cls
    managers = coordinator.single_type_managers
    t.served = _hybrid_managers_served(hp, managers)   # first: another group type leaves here
    if (not t.served
            or not _not_overridden(coordinator, hp.coordinator_names)
            or not _hybrid_coordinator_plain(coordinator, delay_cache_blocks)):
        return None
    request_id = request.request_id
    empty_blocks = getattr(manager.empty_kv_cache_blocks, "blocks", None)
    if (type(request_id) is not str
            or type(empty_blocks) is not tuple
            or len(<tuple>empty_blocks) != len(<tuple>managers)
            or not _hybrid_request_numbers(fp, manager, request, s, has_scheduled_reqs,
                                           &t.in_flight, &t.request_tokens)):
        return None
    total = s.computed if s.computed < s.max_len else s.max_len
    t.main = total + s.new_tokens
    t.need = t.main + s.lookahead if t.main + s.lookahead < s.max_len else s.max_len
    t.processed = total - t.in_flight if total > t.in_flight else 0
    return (managers, request_id, empty_blocks)


cdef bint _hybrid_step_idle(_HybridStep hp, _AllocateSlotsFastPath fp, manager, request,
                            _Step* s, bint delay_cache_blocks, tuple pre, _HybridTokens* t,
                            long long* free_blocks, long long* to_alloc) except -1:
    """After :func:`_hybrid_step_prelude` (``pre``, ``t``): every group of the step is
    idle (:func:`_hybrid_group_idle`, :func:`_mamba_group_idle`) and the pool's free
    count is read natively into ``free_blocks`` (``get_num_free_blocks`` vLLM's: one
    that is not is vLLM's to call), the groups' ``get_num_blocks_to_allocate`` summed
    into ``to_alloc``; False otherwise."""
    cdef long long n_cache, sbs, n_cacheable = -1
    cdef Py_ssize_t i, n_groups, n_hashes = 0
    managers, request_id, empty_blocks = pre
    coordinator = manager.coordinator
    if not delay_cache_blocks:
        block_hashes = request.block_hashes
        if type(block_hashes) is not list:
            return False
        n_hashes = len(<list>block_hashes)
    n_cache = t.main if t.main < t.request_tokens else t.request_tokens
    if t.no_prefix:
        # (KVCacheCoordinatorNoPrefixCache: cache_blocks skips every group, whose caching
        # is off; a group whose caching is not is vLLM's)
        n_cache = -1
    elif t.served == 2 and not delay_cache_blocks:
        # HybridKVCacheCoordinator.get_num_cacheable_tokens of a group without EAGLE
        # (_hybrid_coordinator_plain: sbs a positive int, the flag a bool)
        n_cacheable = n_cache
        if coordinator.enable_partial_hash_hits is False:
            _nonneg(coordinator.scheduler_block_size, &sbs)
            n_cacheable = n_cache // sbs * sbs
    n_groups = len(<tuple>managers)
    for i in range(n_groups):
        mgr = (<tuple>managers)[i]
        if t.no_prefix and not delay_cache_blocks and mgr.enable_caching is not False:
            return False
        if type(mgr) is hp.mamba_cls:
            if not _mamba_group_idle(hp, mgr, request, <str>request_id, t.main, t.need,
                                     t.processed, n_cacheable, n_hashes, s.computed,
                                     (<tuple>empty_blocks)[i], to_alloc):
                return False
        elif not _hybrid_group_idle(hp, mgr, <str>request_id, t.need, t.processed,
                                    -1 if delay_cache_blocks else n_cache, n_hashes,
                                    (<tuple>empty_blocks)[i], t.no_prefix):
            return False
    return _native_free_count(fp, manager.block_pool, free_blocks)


cdef inline int _hybrid_managers_served(_HybridStep hp, managers):
    """The coordinator's ``single_type_managers`` is a tuple of managers of the exact
    classes the step mirrors (``FullAttentionManager``, ``SlidingWindowManager``, and
    ``MambaManager`` when armed): 1, or 2 with a Mamba group. A model with another group
    type (chunked local attention, cross attention, ...) fails here (0), at the cost of a
    few type tests, before anything else of its call is read."""
    cdef Py_ssize_t i
    cdef int served = 1
    if type(managers) is not tuple:
        return 0
    for i in range(len(<tuple>managers)):
        t = type((<tuple>managers)[i])
        if t is hp.mamba_cls and t is not None:
            served = 2
        elif t is not hp.full_attention_cls and t is not hp.sliding_window_cls:
            return 0
    return served


cdef bint _hybrid_coordinator_plain(coordinator, bint delay_cache_blocks) except -1:
    """What the hybrid coordinator reads of itself is plain: ``retention_interval`` an
    int or None (``get_num_blocks_to_allocate`` compares it with 0); unless the caching
    is delayed (``cache_blocks`` not called), no EAGLE group (``drop_eagle_group_ids`` an
    empty set, as vLLM builds it without EAGLE: ``replay_boundaries`` then needs no block
    size), a positive int ``scheduler_block_size`` and a bool
    ``enable_partial_hash_hits`` (``_align_cacheable``), so vLLM's
    ``get_num_cacheable_tokens`` returns at most the tokens it is given and raises
    nothing; anything else is vLLM's to run."""
    cdef long long sbs
    retention = coordinator.retention_interval
    if retention is not None and type(retention) is not int:
        return False
    if delay_cache_blocks:
        return True
    eagle = coordinator.drop_eagle_group_ids
    partial = coordinator.enable_partial_hash_hits
    return ((type(eagle) is set or type(eagle) is frozenset) and len(eagle) == 0
            and _nonneg(coordinator.scheduler_block_size, &sbs) and sbs > 0
            and (partial is True or partial is False))


cdef bint _hybrid_request_numbers(_AllocateSlotsFastPath fp, manager, request, _Step* s,
                                  bint has_scheduled_reqs, long long* in_flight,
                                  long long* request_tokens):
    """The request's and manager's numbers that vLLM's arithmetic reads, as exact
    non-negative ints (else False: vLLM's call), into ``s`` / the outputs; the watermark
    of a waiting or preempted request."""
    return (_nonneg(manager.max_model_len, &s.max_len)
            and _nonneg(request.num_computed_tokens, &s.computed)
            and _nonneg(request.num_in_flight_tokens, in_flight)
            and type(request.num_prompt_tokens) is int
            and _nonneg(request.num_tokens, request_tokens)
            and _step_watermark(fp, manager, request, has_scheduled_reqs, s))


cdef object _hybrid_group_ready(_HybridStep hp, mgr, str request_id, empty_list,
                               long long* bs, long long* n_cached, bint no_prefix):
    """What the step reads of one full-attention or sliding-window group is plain: the
    manager and its spec of the exact classes the step mirrors, no mirrored method set
    on the instance, a positive int ``block_size`` (into ``bs``), and
    :func:`_group_table`'s reads (``n_cached``, ``no_prefix``: its own). Returns the
    request's table; None otherwise (vLLM's code runs the call)."""
    if not _group_manager_plain(hp, mgr, bs):
        return None
    return _group_table(mgr, request_id, empty_list, n_cached, no_prefix)


cdef bint _group_manager_plain(_HybridStep hp, mgr, long long* bs) except -1:
    """A full-attention or sliding-window group's manager and its spec are of the exact
    classes the step mirrors, no mirrored method is set on the manager instance, and its
    ``block_size`` is a positive int (into ``bs``): the group checks shared by the running
    step (:func:`_hybrid_group_ready`) and a first allocation (:func:`_admit_group_ready`)."""
    cdef object t = type(mgr)
    if t is hp.full_attention_cls:
        spec_cls = hp.full_spec_cls
    elif t is hp.sliding_window_cls:
        spec_cls = hp.sliding_spec_cls
    else:
        return False
    if type(mgr.kv_cache_spec) is not spec_cls:   # (its prefix_cacheable: vLLM's, checked)
        return False
    return _not_overridden(mgr, hp.single_type_names) and _nonneg(mgr.block_size, bs) and bs[0] != 0


cdef object _group_table(mgr, str request_id, empty_list, long long* n_cached, bint no_prefix):
    """The request's table in one group's manager (of a class the step mirrors, checked
    by the caller), or None (vLLM's code runs the call): ``req_to_blocks`` a dict or
    defaultdict holding a list for the request, ``num_cached_block`` and
    ``_partial_hit_reqs`` dicts, no pending copy-on-write block of the request, the
    group's entry of the manager's empty ``KVCacheBlocks`` empty. Into ``n_cached``
    (unless NULL: the caller reads no entry) the request's ``num_cached_block`` entry, a
    non-negative int; with ``no_prefix`` (prefix caching off) the request need not have
    one: ``n_cached`` -1 then (vLLM's ``get_num_blocks_to_allocate`` takes its other
    branch)."""
    req_to_blocks = mgr.req_to_blocks
    num_cached_block = mgr.num_cached_block
    partial = mgr._partial_hit_reqs
    if (not (type(req_to_blocks) is dict or type(req_to_blocks) is _defaultdict)
            or type(num_cached_block) is not dict or type(partial) is not dict
            or not (type(empty_list) is tuple or type(empty_list) is list) or len(empty_list) != 0):
        return None
    blocks = (<dict>req_to_blocks).get(request_id)
    if n_cached == NULL:
        pass
    elif no_prefix:
        # (vLLM's branch is `request_id in num_cached_block`; the value is read only by
        # cache_blocks, which skips every group here: 0 for an entry of any value)
        n_cached[0] = 0 if request_id in <dict>num_cached_block else -1
    elif not _nonneg((<dict>num_cached_block).get(request_id), n_cached):
        return None
    if type(blocks) is not list or request_id in <dict>partial:
        return None
    return blocks


cdef bint _null_block_at(mgr, list blocks, long long idx) except -1:
    """``blocks[idx]`` is the group's null block, by identity, and that null block is
    kvpool's own ``KVCacheBlock`` (vLLM's code compares blocks with ``==`` / ``!=``,
    which for kvpool's block is identity). ``mgr._null_block`` is read first (it may run
    code: the list's bound is read after it, :func:`_list_item`; out of range: False)."""
    null_block = mgr._null_block
    return type(null_block) is KVCacheBlock and _list_item(blocks, idx) is null_block


cdef bint _hybrid_group_idle(_HybridStep hp, mgr, str request_id, long long need,
                             long long processed, long long n_cache, Py_ssize_t n_hashes,
                             empty_list, bint no_prefix) except -1:
    """One KV cache group of a running request does nothing in this step, in vLLM
    0.34.0's code: ``remove_skipped_blocks`` frees no block (full attention skips no
    token; a sliding window's last block before it is already the null block),
    ``get_num_blocks_to_allocate`` / ``allocate_new_blocks`` find the table long enough
    (:func:`_hybrid_group_ready`), and ``cache_blocks`` finds its full blocks cached
    (``get_num_cacheable_tokens`` gives at most ``n_cache`` tokens; a full-attention
    group caches a partial prompt tail when its block is larger than the hash block, so
    that shape is vLLM's). ``no_prefix``: the coordinator is
    ``KVCacheCoordinatorNoPrefixCache`` (:func:`_hybrid_group_ready`). False: vLLM's
    code runs the call."""
    cdef long long bs, hash_bs, n_cached, n_skip
    cdef object t = type(mgr)
    blocks = _hybrid_group_ready(hp, mgr, request_id, empty_list, &bs, &n_cached, no_prefix)
    if blocks is None:
        return False
    if t is hp.sliding_window_cls:
        if not _sliding_skip(mgr, processed, bs, len(<list>blocks), &n_skip):
            return False
        # (vLLM's walk stops at the first block, from the last skipped one back, that is
        # the null block: the last skipped one already is)
        if n_skip > 0 and not _null_block_at(mgr, <list>blocks, n_skip - 1):
            return False
    if (need + bs - 1) // bs > len(<list>blocks):
        return False
    if n_cache < 0 or mgr.enable_caching is False:   # (n_cache -1: caching delayed)
        return True
    if not _full_blocks_cached(mgr, n_cached, n_cache, n_hashes, bs, &hash_bs):
        return False
    return t is hp.sliding_window_cls or bs == hash_bs


cdef bint _full_blocks_cached(mgr, long long n_cached, long long n_tokens, Py_ssize_t n_hashes,
                              long long bs, long long* hash_bs) except -1:
    """``SingleTypeKVCacheManager.cache_blocks`` (vLLM 0.34.0) caches no full block for a
    group with caching on: ``enable_caching`` True and ``use_eagle`` False (the
    coordinator's count of cacheable tokens is then at most ``n_tokens``), the pool's
    ``hash_block_size`` an exact int (read into ``hash_bs``), and ``n_cached``
    (``num_cached_block``) at least ``min(n_tokens, hashed tokens) // block_size``. The
    idle step's test for every group type, and ``_group_caches_nothing``'s."""
    cdef long long full
    if (mgr.enable_caching is not True or mgr.use_eagle is not False
            or not _nonneg(mgr.block_pool.hash_block_size, hash_bs)
            or (n_hashes > 0 and hash_bs[0] > _NATIVE_INT_LIMIT // n_hashes)):
        return False
    full = n_hashes * hash_bs[0]
    if n_tokens < full:
        full = n_tokens
    return n_cached >= full // bs
