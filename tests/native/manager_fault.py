"""Fault injection through kvpool's native ``allocate_slots`` under a real vLLM
Scheduler (run by tests/native/test_fault_injection.py in a child process, like
fault_sweep.py).

A scheduler runs a small workload (a request whose blocks get cached, two that hit
its prefix, three long ones that evict) until a chosen ``allocate_slots`` call that
kvpool answers natively: a running request's step that allocates on one
full-attention group (``manager.pxi``), and on full attention + sliding window a
waiting request's first allocation with its prefix-cache hit (``hybrid_admit.pxi``),
a running request's step that allocates and one that frees the blocks that left the
window (``hybrid_alloc.pxi``), each under the default and the contiguous policy
(``contiguous_take.pxi``). For every k the k-th allocation inside that call fails
once. vLLM's own ``allocate_slots`` has no undo either, so the call may stop
part-way; what must hold is the pool's side: no crash, a Python exception
(MemoryError, or what vLLM's code the call runs made of it: its ``untracked_list``
raises ctypes' ArgumentError), the free list consistent, every block's ``ref_cnt``
the number of tables holding it (no block lost, none freed while a table holds it),
every hashed block in the prefix-cache map under its hash and nothing else there,
and once every table is freed through vLLM's coordinator the whole pool free again.

    python tests/native/manager_fault.py [--interrupt] [SCENARIO ...]   # default: all

``--interrupt``: instead of an allocation, a KeyboardInterrupt raised as the k-th Python
function called inside that call starts (a signal's exception, as CPython delivers it):
the pool's Python methods the native path calls run a policy hook after their native
part, so an exception there comes after the change.

(``KVPOOL_FAULT_KEEP_GOING=1``: report each failed check as a ``FAIL`` line and go on.)
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MAX_K = int(os.environ.get("KVPOOL_FAULT_MAX_K", "5000"))
from failmalloc_ctl import disarm, lib  # noqa: E402  (tests/native: the script's own folder)

import kvpool  # noqa: E402
from kvpool import _core  # noqa: E402

NUM_BLOCKS = 300   # (above 257: the pool's counts are ints the interpreter allocates)
PREFIX = list(range(1000, 1064))   # 4 full blocks of 16 tokens, shared


def _counters() -> dict:
    state = dict(_core.allocate_slots_fast_path_state())
    state.update(_core.hybrid_running_step_state())
    return state


class Step:
    """Drives one scheduler through the workload; ``arm`` = (call index, k): that
    ``allocate_slots`` call runs with the k-th allocation inside it failing once (with
    ``interrupt``: a KeyboardInterrupt as the k-th Python function called inside it
    starts)."""

    def __init__(self, hybrid: bool, arm: tuple[int, int] | None = None, interrupt: bool = False):
        from tests.support.scheduler import make_request, make_scheduler
        self.scheduler = make_scheduler(num_blocks=NUM_BLOCKS, enable_prefix_caching=True, hybrid=hybrid)
        self.make_request = make_request
        self.arm = arm
        self.interrupt = interrupt   # arm: a KeyboardInterrupt at the k-th Python call instead
        # per allocate_slots call: (request id, first?, allocated?, native counters moved,
        # num_new_computed_tokens of a first allocation); None, None for the armed call
        self.calls = []
        self.hit = 0
        self.error = None
        manager = self.scheduler.kv_cache_manager
        self.manager = manager
        real = manager.allocate_slots
        step = self

        def allocate_slots(request, *args, **kwargs):
            index = len(step.calls)
            first = not any(m.req_to_blocks.get(request.request_id)
                            for m in manager.coordinator.single_type_managers)
            # (a first allocation that adopts a prefix-cache hit: num_new_computed_tokens)
            hit = (args[1] if len(args) > 1 else kwargs.get("num_new_computed_tokens", 0)) if first else 0
            free = manager.block_pool.get_num_free_blocks()
            nulls = _nulls(manager, request.request_id)
            before = _counters()
            if step.arm is not None and step.arm[0] == index:
                step.start_fault()
                try:
                    return real(request, *args, **kwargs)
                finally:
                    step.stop_fault()
                    step.calls.append((request.request_id, first, None, None, hit))
            result = real(request, *args, **kwargs)
            after = _counters()
            moved = tuple(sorted(k for k in ("fast_calls", "native_admissions", "native_changes",
                                             "contiguous_takes") if after[k] != before[k]))
            if _nulls(manager, request.request_id) > nulls:
                moved += ("window_freed",)
            step.calls.append((request.request_id, first,
                               manager.block_pool.get_num_free_blocks() < free, moved, hit))
            return result

        # (an instance attribute: the scheduler calls it; the native path reads the
        # manager's class, which is unchanged)
        self.scheduler.kv_cache_manager = _Proxy(manager, allocate_slots)

    def start_fault(self) -> None:
        if self.interrupt:
            sys.setprofile(_interrupt_at(self, self.arm[1]))
        else:
            lib.kvpool_fault_arm(self.arm[1])

    def stop_fault(self) -> None:
        # (sets self.hit: the failure was injected; _interrupt_at's hook sets it itself)
        if self.interrupt:
            sys.setprofile(None)
        else:
            self.hit = disarm()

    def run(self, steps: int = 24) -> None:
        from tests.support.scheduler import runner_output
        s = self.scheduler
        add = {0: [("a", PREFIX + list(range(6)), 6)],
               3: [("long", list(range(5000, 5000 + 1900)), 3)],
               5: [("long2", list(range(9000, 9000 + 1900)), 3)],
               7: [("long3", list(range(12000, 12000 + 1900)), 3)],
               8: [("b", PREFIX + list(range(7000, 7010)), 20), ("c", PREFIX + list(range(8000, 8020)), 20)]}
        for i in range(steps):
            for rid, prompt, max_tokens in add.get(i, ()):
                s.add_request(self.make_request(rid, prompt, max_tokens=max_tokens))
            try:
                out = s.schedule()
            except (Exception, KeyboardInterrupt) as exc:   # MemoryError, or what vLLM's code made of it
                self.error = exc
                return
            s.update_from_output(out, runner_output(out))


def _interrupt_at(step: Step, k: int):
    """A profile function raising KeyboardInterrupt as the k-th Python function called
    is entered: where CPython delivers a signal's exception (its eval loop checks for
    pending signals as a frame starts; kvpool's native code never does)."""
    seen = [0]

    def hook(frame, event, arg):
        if event == "call":
            if seen[0] == k:
                step.hit = 1
                raise KeyboardInterrupt
            seen[0] += 1

    step.hit = 0
    return hook


def _nulls(manager, request_id) -> int:
    # null blocks in the request's tables: a sliding window's blocks freed
    return sum(b.is_null for m in manager.coordinator.single_type_managers
               for b in m.req_to_blocks.get(request_id, ()))


class _Proxy:
    def __init__(self, manager, allocate_slots):
        object.__setattr__(self, "_manager", manager)
        object.__setattr__(self, "allocate_slots", allocate_slots)

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def __setattr__(self, name, value):
        setattr(self._manager, name, value)


def check(step: Step, label: str) -> None:
    """The pool against the tables, then every table freed: the whole pool free."""
    manager = step.manager
    pool = manager.block_pool
    pool.free_block_queue.check_invariants()
    held = collections.Counter()
    for mgr in manager.coordinator.single_type_managers:
        for table in mgr.req_to_blocks.values():
            for block in table:
                if not block.is_null:
                    held[block.block_id] += 1
    free = set(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    assert len(free) == pool.free_block_queue.num_free_blocks, f"{label}: free count"
    for block in pool.blocks.materialized():
        if block.is_null:
            continue
        n = held.get(block.block_id, 0)
        assert block.ref_cnt == n, f"{label}: block {block.block_id} ref_cnt {block.ref_cnt}, {n} tables hold it"
        assert (block.block_id in free) == (n == 0), (
            f"{label}: block {block.block_id} free={block.block_id in free}, held {n}")
    # the prefix cache: every hashed block in the map under its hash, nothing else there
    cache = pool.cached_block_hash_to_block
    hashed = [b for b in pool.blocks.materialized() if b.block_hash is not None]
    for block in hashed:
        assert cache.contain(block.block_hash, block.block_id), (
            f"{label}: block {block.block_id} has a hash the map does not hold")
    entries = sum(len(v) if type(v) is dict else 1 for v in cache._cache.values())
    assert entries == len(hashed), f"{label}: {entries} map entries for {len(hashed)} hashed blocks"
    for rid in {r for m in manager.coordinator.single_type_managers for r in m.req_to_blocks}:
        manager.coordinator.free(rid)
    lost = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
    assert lost == 0, f"{label}: {lost} blocks not back in the pool after every table was freed"
    pool.free_block_queue.check_invariants()


#: scenario -> (hybrid, policy, which call: "running" / "first" / "window")
SCENARIOS = {
    "dense_running": (False, "vllm", "running"),
    "dense_running_contiguous": (False, "contiguous", "running"),
    "dense_admission": (False, "vllm", "first"),
    "dense_admission_contiguous": (False, "contiguous", "first"),
    "hybrid_admission": (True, "vllm", "first"),
    "hybrid_admission_contiguous": (True, "contiguous", "first"),
    "hybrid_running": (True, "vllm", "running"),
    "hybrid_running_contiguous": (True, "contiguous", "running"),
    "hybrid_window": (True, "vllm", "window"),
    "hybrid_window_contiguous": (True, "contiguous", "window"),
}


def target(calls, hybrid: bool, kind: str) -> int:
    """The index of the first native ``allocate_slots`` call of ``kind`` that allocated
    (a first allocation: one that adopted a prefix-cache hit, a request of PREFIX's),
    or for ``"window"`` a running step that freed blocks that left the sliding window."""
    for index, (rid, first, allocated, moved, hit) in enumerate(calls):
        if kind == "window":
            if not first and {"native_changes", "window_freed"} <= set(moved):
                return index
            continue
        if not allocated or first != (kind == "first"):
            continue
        if kind == "first" and (rid not in ("b", "c") or hit <= 0):
            continue
        # (a first allocation: hybrid_admit.pxi's, on either coordinator)
        native = "native_admissions" if kind == "first" else "native_changes" if hybrid else "fast_calls"
        if native not in moved:
            continue
        return index
    raise AssertionError(f"no native {kind} allocation that allocates: {calls}")


def sweep(name: str, interrupt: bool = False) -> int:
    hybrid, policy, kind = SCENARIOS[name]
    kvpool.uninstall()
    kvpool.install(allocation=policy)
    base = Step(hybrid)
    evictions = _counters()["native_evictions"]
    base.run()
    assert base.error is None
    assert _counters()["native_evictions"] > evictions, "the workload evicted nothing natively"
    check(base, f"{name} unarmed")
    index = target(base.calls, hybrid, kind)
    for k in range(MAX_K):
        print(f"{name} call={index} k={k}", flush=True)
        step = Step(hybrid, arm=(index, k), interrupt=interrupt)
        step.run()
        assert step.error is None or step.hit, f"{name} k={k}: {step.error!r} without an injected failure"
        where = "".join(traceback.format_tb(step.error.__traceback__)[-3:]) if step.error else ""
        try:
            check(step, f"{name} k={k} ({step.error!r} at\n{where})")
        except AssertionError as exc:
            if os.environ.get("KVPOOL_FAULT_KEEP_GOING"):
                print("FAIL", exc, flush=True)
            else:
                raise
        if not step.hit:
            return k
    raise AssertionError(f"{name}: still hitting allocations after {MAX_K} tries")


def main(argv: list[str]) -> int:
    interrupt = "--interrupt" in argv
    names = [a for a in argv if a != "--interrupt"]
    for name in names or list(SCENARIOS):
        what = "Python calls, each interrupted once" if interrupt else "allocation points, each failing once"
        print(f"OK {name}: {sweep(name, interrupt)} {what}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
