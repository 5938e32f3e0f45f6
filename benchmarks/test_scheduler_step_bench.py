"""A scheduler step through vLLM 0.33.0's real ``Scheduler``: vanilla vs kvpool (default
policy) vs kvpool with the contiguous policy, in the same run (issue 17).

What a user feels is the engine step, not one pool call: each timed round runs
``STEPS`` engine steps (``schedule()`` + ``update_from_output()`` with a stand-in model
output) of a serving shape: never idle (a finished request is replaced at once), prefix
caching on, requests sharing system-prompt prefixes, and a pool small enough that it has
wrapped (every block used once, the LRU segment evicting) before the timed steps start.
The set-up (building the scheduler under the mode, the warm-up steps) is not timed.

Every mode must make vLLM's scheduling decisions (tokens scheduled per request, per
step, and preemptions): the traces of a mode's first round are compared with vanilla's.
Ratios (vanilla / mode, of medians) are printed with the pool benchmarks' and checked
by ``benchmarks/check_ratios.py`` against ``benchmarks/ratios.py``.

Run: ``.venv/bin/python -m pytest benchmarks/test_scheduler_step_bench.py --benchmark-only``.
"""

from __future__ import annotations

import gc
import random
import time

import pytest

import kvpool
from tests.support.scheduler import make_request, make_scheduler, runner_output

#: Pool size (blocks of 16 tokens): 16 requests of up to ~1,900 tokens fill at most
#: two thirds of it (no preemption), and the warm-up has asked for ~4x its blocks.
NUM_BLOCKS = 3_000
IN_FLIGHT = 16  # the helper scheduler's max_num_seqs
WARMUP_STEPS = 1_500
STEPS = 300
ROUNDS = 5
MAX_TOKENS_BATCH = 2_048  # = max_model_len (opt-125m: 2,048 positions)
#: Prefixes shared by groups of requests (system prompts), in tokens.
PREFIXES = [list(range(10_000 * g, 10_000 * g + n)) for g, n in enumerate((400, 640, 900, 250))]

#: Modes: how kvpool is installed (None: not at all).
MODES = {"vllm": None, "kvpool": "vllm", "kvpool_contiguous": "contiguous"}
_TRACES: dict[str, list] = {}


class _Serving:
    """A never-idle stream of requests on one scheduler (deterministic from the seed)."""

    def __init__(self, scheduler, seed: int = 0) -> None:
        self.scheduler = scheduler
        self.rng = random.Random(seed)
        self.next_id = 0
        self.blocks_asked = 0  # blocks of all requests added (prompt + max_tokens)

    def _top_up(self) -> None:
        while len(self.scheduler.requests) < IN_FLIGHT:
            rng = self.rng
            prompt = list(rng.choice(PREFIXES)) + [rng.randrange(1, 30_000) for _ in range(rng.randrange(16, 700))]
            max_tokens = rng.randrange(8, 300)
            self.scheduler.add_request(make_request(f"q{self.next_id}", prompt, max_tokens=max_tokens))
            self.next_id += 1
            self.blocks_asked += -(-(len(prompt) + max_tokens) // 16)

    def step(self, trace: list | None = None) -> None:
        self._top_up()
        out = self.scheduler.schedule()
        if trace is not None:
            trace.append((sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids or ())))
        self.scheduler.update_from_output(out, runner_output(out))


def _set_mode(mode: str) -> None:
    kvpool.uninstall()
    if MODES[mode] is not None:
        kvpool.install(allocation=MODES[mode])


@pytest.mark.benchmark(timer=time.thread_time)  # CPU of the step, as the replay reports it
@pytest.mark.parametrize("impl", list(MODES))
def test_scheduler_step_serving(benchmark, impl):
    rounds_seen = []

    def setup():
        _set_mode(impl)
        scheduler = make_scheduler(num_blocks=NUM_BLOCKS, max_num_batched_tokens=MAX_TOKENS_BATCH)
        serving = _Serving(scheduler)
        for _ in range(WARMUP_STEPS):
            serving.step()
        pool = scheduler.kv_cache_manager.block_pool
        assert type(pool).__module__.startswith("kvpool" if MODES[impl] else "vllm")
        # The pool has wrapped: the requests so far needed more blocks than it has, so
        # the timed steps allocate from the LRU segment, evicting cached blocks.
        assert serving.blocks_asked > 2 * NUM_BLOCKS, serving.blocks_asked
        gc.collect()  # the previous rounds' schedulers: not collected inside the timed steps
        return (serving,), {}

    def run(serving):
        trace = [] if not rounds_seen else None
        for _ in range(STEPS):
            serving.step(trace)
        if trace is not None:
            rounds_seen.append(trace)

    # One group, three modes: rows "scheduler_step_serving" (default policy) and
    # "scheduler_step_serving_contiguous" (benchmarks/ratios.py). "blocks" is the number
    # of steps, so the ns-per-block column reads ns per step here.
    benchmark.group = "scheduler_step_serving"
    benchmark.extra_info.update(impl=impl, blocks=STEPS, per="step")
    try:
        benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    finally:
        kvpool.uninstall()
    _TRACES[impl] = rounds_seen[0]
    if impl != "vllm" and "vllm" in _TRACES:
        assert _TRACES[impl] == _TRACES["vllm"], f"{impl} scheduled differently from vLLM"
