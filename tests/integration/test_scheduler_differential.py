"""The installed vLLM's (0.30.0-0.33.0) ``Scheduler`` and ``KVCacheManager`` on kvpool's
pool against the same on vLLM's own pool, step by step, under a random seeded workload.

Two processes (``kvpool.install()`` patches vLLM process-wide): one with vLLM's classes,
one with kvpool installed before any scheduler exists, both running
tests/integration/sched_diff_harness.py with the same seed. Each draws the same episodes
(block size, pool size small enough to preempt and wrap the pool, 1-3 KV cache groups,
prefix caching and KV events on or off, speculative tokens with rejections, EAGLE
lookahead slots, FCFS or priority scheduling, chunked prefill budgets, async scheduling
with a KV consumer and its deferred block frees) and the same request stream (prompts at
block multiples and +-1, shared prefixes, repeats, continued conversations, cache salts,
``skip_reading_prefix_cache``, aborts, prefix-cache resets, refused ones included,
prefix-cache lookups under a hit limit). Every engine step prints one line of what it
shows (the ``SchedulerOutput`` with block ids per group, engine outputs, free count and
free-queue order, prefix-cache stats, KV events, every table and cached-block count,
request states; the prefix-cache map every 32 steps) and this test compares the two
streams line by line as they are written, reporting the first differing step with both
lines. The harness's docstring lists the observables.

One deliberate difference is modelled on the vanilla side: kvpool frees a deferred
request's KV cache groups as the immediate path does, where vLLM 0.33.0 reverses the
group order (README, "deferred frees in the immediate path's order"); the vanilla side of
a multi-group async episode defers group by group (``_deferred_free_by_group``).

    KVPOOL_SCHED_DIFF_STEPS=100000 python -m pytest tests/integration/test_scheduler_differential.py -s

runs 10^5 engine steps (default 10^4; CI sets 10^5); ``KVPOOL_DIFF_SEED`` picks the seed.
One side alone: ``python tests/integration/sched_diff_harness.py --side kvpool --steps N --seed S``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

import pytest

from kvpool.cpu_platform import cpu_environment
from tests.support.paths import REPO

# Two child processes for a few seconds at least: not for the sanitizer / debug-interpreter subsets.
pytestmark = [pytest.mark.slow]

HARNESS = Path(__file__).resolve().with_name("sched_diff_harness.py")
NUM_STEPS = int(os.environ.get("KVPOOL_SCHED_DIFF_STEPS", "10000"))
SEED = int(os.environ.get("KVPOOL_DIFF_SEED", "20261204"))
#: kvpool settings that change block placement by design (off: vLLM's order on both sides).
PLACEMENT_SETTINGS = ("KVPOOL_ALLOCATION", "KVPOOL_LRU_WINDOW", "KVPOOL_REORDER_ON_RESET", "KVPOOL_REORDER_ON_IDLE")
#: Vanilla lines kept for the perturbation test (the first episode and some).
KEPT_LINES = 1200


@dataclass
class Difference:
    """The first line (0-based, after the side descriptions) where two streams differ;
    ``None`` for a side whose stream had ended."""

    line: int
    vanilla: str | None
    kvpool: str | None
    context: list[str] = field(default_factory=list)

    def fields(self) -> list[str]:
        """Dotted paths of the differing values (first levels of the JSON objects)."""
        try:
            a, b = json.loads(self.vanilla or "null"), json.loads(self.kvpool or "null")
        except ValueError:
            return []
        return _differing(a, b, "")

    def report(self) -> str:
        lines = [f"first difference at line {self.line}: {', '.join(self.fields()) or 'whole line'}",
                 *(f"  before: {c}" for c in self.context),
                 f"  vanilla: {self.vanilla}", f"  kvpool:  {self.kvpool}"]
        return "\n".join(lines)


def _differing(a, b, path: str, depth: int = 0) -> list[str]:
    if a == b:
        return []
    if isinstance(a, dict) and isinstance(b, dict) and depth < 3:
        return [p for k in sorted(set(a) | set(b)) for p in _differing(a.get(k), b.get(k), f"{path}.{k}", depth + 1)]
    return [path or "."]


def first_difference(vanilla: Iterable[str], kvpool: Iterable[str], context: int = 2) -> Difference | None:
    """Compare two streams of lines in lockstep (consuming them only as far as they
    agree); ``None`` when they are equal, line for line and in length."""
    recent: deque[str] = deque(maxlen=context)
    for n, (a, b) in enumerate(zip_longest(vanilla, kvpool)):
        if a != b:
            return Difference(n, a, b, list(recent))
        recent.append(a)
    return None


class Side:
    """One harness process, its stdout read line by line; its first line (which pool
    it runs) is read at start and not compared."""

    def __init__(self, side: str, steps: int, seed: int, *extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in PLACEMENT_SETTINGS}
        env.update(PYTHONHASHSEED=str(seed % 2**32))  # same set order both sides
        cpu_environment(env)
        if side == "vanilla":
            env["KVPOOL_DISABLE"] = "1"  # kvpool's vLLM plugin must not install it there
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (the process's, closed with it)
        self.proc = subprocess.Popen(
            [sys.executable, str(HARNESS), "--side", side, "--steps", str(steps), "--seed", str(seed), *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1 << 16)
        #: The last ``{"end": ...}`` line's counts, once read.
        self.end: dict | None = None

    def check_header(self, name: str, module: str) -> dict:
        """The first line: the side, the pool class and the ``allocate_slots`` it runs."""
        line = self.proc.stdout.readline()
        assert line, f"{name} side printed nothing: {self.close()}"
        header = json.loads(line)
        assert header["side"] == name and header["pool"].startswith(module + "."), header
        return header

    def lines(self) -> Iterator[str]:
        for line in self.proc.stdout:
            if line.startswith('{"end":'):
                self.end = json.loads(line)["end"]
            yield line.rstrip("\n")

    def close(self) -> str:
        """Stop the process if still running (no longer needed: not a failure); its
        exit status and stderr's tail if it failed by itself."""
        stopped = self.proc.poll() is None
        if stopped:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.stderr.seek(0)
        err = self.stderr.read()
        self.stderr.close()
        if stopped or self.proc.returncode == 0:
            return ""
        return f"{self.proc.args[3]} side, exit {self.proc.returncode}:\n{err[-4000:]}"


def _watchdog(sides: list[Side], seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, lambda: [s.proc.kill() for s in sides])
    timer.daemon = True
    timer.start()
    return timer


@dataclass
class Result:
    difference: Difference | None
    counts: dict | None
    seconds: float
    errors: list[str]
    #: The vanilla side's first :data:`KEPT_LINES` lines.
    vanilla_head: list[str]
    #: Whether the kvpool side ran kvpool's native ``KVCacheManager.allocate_slots``.
    native: bool | None = None


def run_differential(steps: int, seed: int) -> Result:
    start = time.perf_counter()
    vanilla, kvpool = Side("vanilla", steps, seed), Side("kvpool", steps, seed)
    timer = _watchdog([vanilla, kvpool], 300 + steps / 100)
    head: list[str] = []
    native = None

    def keep(lines: Iterator[str]) -> Iterator[str]:
        for line in lines:
            if len(head) < KEPT_LINES:
                head.append(line)
            yield line

    try:
        assert not vanilla.check_header("vanilla", "vllm")["native_allocate_slots"]
        native = kvpool.check_header("kvpool", "kvpool")["native_allocate_slots"]
        difference = first_difference(keep(vanilla.lines()), kvpool.lines())
    finally:
        timer.cancel()
        errors = [e for e in (vanilla.close(), kvpool.close()) if e]
    return Result(difference, kvpool.end, time.perf_counter() - start, errors, head, native)


@pytest.fixture(scope="module")
def differential() -> Result:
    return run_differential(NUM_STEPS, SEED)


def test_every_scheduler_step_matches_vanilla_vllm(differential):
    r = differential
    print(f"\nscheduler differential: seed {SEED}, {NUM_STEPS} steps in {r.seconds:.1f} s "
          f"(kvpool's native allocate_slots: {r.native}); {r.counts}")
    problems = list(r.errors)
    if r.difference is not None:
        problems.insert(0, f"seed {SEED}, {NUM_STEPS} steps (KVPOOL_DIFF_SEED={SEED} "
                           f"KVPOOL_SCHED_DIFF_STEPS={NUM_STEPS}): {r.difference.report()}")
    assert not problems, "\n".join(problems)
    assert r.counts is not None and r.counts["steps"] == NUM_STEPS
    if NUM_STEPS >= 10_000:  # the workload reached what it is meant to exercise
        for what in ("preempted", "aborted", "reset_ok", "reset_refused", "spec_tokens", "events", "deferred",
                     "lookup_hit", "hit_tokens", "zeroed", "evict", "async_episodes"):
            assert r.counts.get(what, 0) > 0, f"no {what} in {r.counts}"


def test_comparison_reports_the_first_differing_line_and_a_short_stream():
    same = ['{"step":0}', '{"step":1,"free":3}']
    assert first_difference(same, list(same)) is None
    d = first_difference([*same, '{"step":2,"free":[1,2]}', "x"], [*same, '{"step":2,"free":[2,1]}', "y"])
    assert (d.line, d.vanilla, d.kvpool, d.context) == (2, '{"step":2,"free":[1,2]}', '{"step":2,"free":[2,1]}', same)
    assert d.fields() == [".free"]
    assert "line 2: .free" in d.report() and "vanilla: " + d.vanilla in d.report()
    # A side that stops early (a crash) differs at its missing line.
    d = first_difference(same, same[:1])
    assert (d.line, d.vanilla, d.kvpool) == (1, same[1], None)
    # Streams are consumed only as far as they agree.
    consumed = []
    kv = iter(['{"a":1}', '{"a":2}', '{"a":3}'])
    first_difference(['{"a":1}', '{"a":0}', '{"a":3}'], (consumed.append(x) or x for x in kv))
    assert consumed == ['{"a":1}', '{"a":2}']


def _perturbation_step(head: list[str]) -> int:
    """A step, past the first 150 lines, that follows a step of the same episode
    leaving at least two blocks free."""
    steps = [json.loads(line) for line in head[150:] if line.startswith('{"acts"')]
    return next(cur["step"] for prev, cur in zip(steps, steps[1:])
                if cur["step"] == prev["step"] + 1 and prev["state"]["free"] >= 2)


def test_a_changed_free_queue_order_in_the_kvpool_process_is_reported(differential):
    """The kvpool process takes the two blocks at the free queue's head and frees them
    again in reverse order (its pool's own ``get_new_blocks`` / ``free_blocks``) before
    step ``k``; same seed and steps as the main run, stopped after the vanilla lines
    kept: the comparison must fail at step ``k``."""
    head = differential.vanilla_head
    k = _perturbation_step(head)
    kvpool = Side("kvpool", NUM_STEPS, SEED, "--perturb-at", str(k))
    timer = _watchdog([kvpool], 180)
    try:
        kvpool.check_header("kvpool", "kvpool")
        d = first_difference(head, (line for _, line in zip(head, kvpool.lines())))
    finally:
        timer.cancel()
        kvpool.close()
    assert d is not None, f"the perturbed pool (step {k}) went unnoticed"
    assert json.loads(d.kvpool)["step"] == k, d.report()
    assert {".state.free_queue", ".so.new", ".so.cached"} & set(d.fields()), d.report()
