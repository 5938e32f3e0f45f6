"""A scheduler step through vLLM 0.33.0's real ``Scheduler``: vanilla vs kvpool (default
policy) vs kvpool with the contiguous policy, in the same run (issue 17).

What a user feels is the engine step, not one pool call: each timed round runs
``STEPS`` engine steps of one of two shapes and counts the CPU of their ``schedule()`` and
``update_from_output()`` calls only (as the replay does: the stand-in model output, the
requests added between steps and the decision trace are not counted). Prefix caching
is on, and the pool is small enough that it has wrapped (every block used once, the LRU
segment evicting) before the timed steps start:

* serving: never idle (a finished request is replaced at once), requests sharing
  system-prompt prefixes;
* grpo: rounds of 2 prompts x 8 samples submitted at once (the samples share their
  prompt, 600-1,700 tokens; 16-300 output tokens each), the next round when the last
  sample finished.
The set-up (building the scheduler under the mode, the warm-up steps) is not timed.

The modes' rounds alternate (round 0 of every mode, then round 1, ...; one stream per
mode, built once), so a change of the machine's speed during the run reaches every mode
alike. Round r of every mode is the same ``STEPS`` steps of the same deterministic
stream (each mode must make vLLM's scheduling decisions, tokens scheduled per request
per step and preemptions: each round's trace is compared with vanilla's), so the ratio
is the median of the rounds' ratios (vanilla's round r / the mode's round r;
``benchmarks/ratios.py``): rounds that are dear for every mode (prompt admissions) and
cheap ones (pure decode) are compared with their own kind. The ratios are printed with
the pool benchmarks' and checked by ``benchmarks/check_ratios.py`` against
``benchmarks/ratios.py``.

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
STEPS = 400
ROUNDS = 15
MAX_TOKENS_BATCH = 2_048  # = max_model_len (opt-125m: 2,048 positions)
#: Prefixes shared by groups of requests (system prompts), in tokens.
PREFIXES = [list(range(10_000 * g, 10_000 * g + n)) for g, n in enumerate((400, 640, 900, 250))]

#: Modes: how kvpool is installed (None: not at all).
MODES = {"vllm": None, "kvpool": "vllm", "kvpool_contiguous": "contiguous"}
_TRACES: dict[tuple[str, int], dict[str, list]] = {}


#: CPU seconds this thread spent in the streams outside ``schedule()`` and
#: ``update_from_output()`` (adding requests, the stand-in model output, the trace).
_OUTSIDE_STEP = [0.0]


def _step_clock() -> float:
    """The benchmarks' timer: this thread's CPU seconds less those outside the engine
    step, so a round's time is the CPU of its ``schedule()`` + ``update_from_output()``
    calls only, what the replay reports per step (kvpool.tools.replay.loop)."""
    return time.thread_time() - _OUTSIDE_STEP[0]


def _step(scheduler, add_requests, trace: list | None) -> None:
    """One engine step: ``add_requests()`` (the engine core's input side), then
    ``schedule()`` and ``update_from_output()`` with a stand-in model output; only the
    two scheduler calls count in :func:`_step_clock`."""
    t0 = time.thread_time()
    add_requests()
    t1 = time.thread_time()
    out = scheduler.schedule()
    t2 = time.thread_time()
    if trace is not None:
        trace.append((sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids or ())))
    model_output = runner_output(out)
    t3 = time.thread_time()
    scheduler.update_from_output(out, model_output)
    _OUTSIDE_STEP[0] += (t1 - t0) + (t3 - t2)


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
        _step(self.scheduler, self._top_up, trace)


def _set_mode(mode: str) -> None:
    from kvpool import patching

    kvpool.uninstall()
    if MODES[mode] is not None:
        # Every mode's stream lives on, each stepped only in its own mode (as in the
        # replay): vanilla's pool is never used while kvpool is installed.
        patching.install(allocation=MODES[mode], allow_vllm_built_pools=True)


class _Grpo:
    """GRPO rollouts: rounds of GRPO_PROMPTS prompts x GRPO_SAMPLES samples submitted at
    once (the samples share their prompt), the next round when the last one finished."""

    def __init__(self, scheduler, seed: int = 1) -> None:
        self.scheduler = scheduler
        self.rng = random.Random(seed)
        self.round = 0
        self.blocks_asked = 0

    def _new_round(self) -> None:
        rng = self.rng
        for p in range(GRPO_PROMPTS):
            prompt = [rng.randrange(1, 30_000) for _ in range(rng.randrange(600, 1_700))]
            for k in range(GRPO_SAMPLES):
                max_tokens = rng.randrange(16, 300)
                self.scheduler.add_request(make_request(f"g{self.round}-{p}-{k}", prompt, max_tokens=max_tokens))
                self.blocks_asked += -(-(len(prompt) + max_tokens) // 16)
        self.round += 1

    def _maybe_new_round(self) -> None:
        if not self.scheduler.requests:
            self._new_round()

    def step(self, trace: list | None = None) -> None:
        _step(self.scheduler, self._maybe_new_round, trace)


GRPO_PROMPTS = 2
GRPO_SAMPLES = 8


#: One stream per (shape, mode), built once and advanced round after round.
_STREAMS: dict[tuple[str, str], object] = {}
SHAPES = {"serving": _Serving, "grpo": _Grpo}


def _stream(shape: str, impl: str):
    key = (shape, impl)
    if key not in _STREAMS:
        _set_mode(impl)
        scheduler = make_scheduler(num_blocks=NUM_BLOCKS, max_num_batched_tokens=MAX_TOKENS_BATCH)
        stream = SHAPES[shape](scheduler)
        for _ in range(WARMUP_STEPS):
            stream.step()
        pool = scheduler.kv_cache_manager.block_pool
        assert type(pool).__module__.startswith("kvpool" if MODES[impl] else "vllm")
        # The pool has wrapped: the requests so far needed more blocks than it has, so
        # the timed steps allocate from the LRU segment, evicting cached blocks.
        assert stream.blocks_asked > 2 * NUM_BLOCKS, stream.blocks_asked
        _STREAMS[key] = stream
    return _STREAMS[key]


def _bench_round(benchmark, shape: str, round_: int, impl: str) -> None:
    """Round ``round_`` of ``impl`` on ``shape``: STEPS steps of its stream, timed as one
    pytest-benchmark round. The modes' rounds alternate (round 0 of each mode, then round
    1 of each, ...), so a change in the machine's speed during the run (other tenants,
    frequency) reaches every mode alike; ``benchmarks/ratios.py`` takes the median of the
    rounds' ratios to vanilla's same rounds. Like vLLM's engine core
    (``freeze_gc_heap``), the objects built before the timed steps are frozen out of the
    garbage collector."""
    stream = _stream(shape, impl)

    def setup():
        _set_mode(impl)  # the class patches of this mode (streams of all modes live on)
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        return (stream,), {}

    trace: list = []

    def run(stream):
        for _ in range(STEPS):
            stream.step(trace)

    group = f"scheduler_step_{shape}"
    # One group, three modes: rows "<group>" (default policy) and "<group>_contiguous"
    # (benchmarks/ratios.py). "blocks" is the number of steps, so the ns-per-block
    # column reads ns per step here.
    benchmark.group = group
    benchmark.extra_info.update(impl=impl, blocks=STEPS, per="step", round=round_)
    try:
        benchmark.pedantic(run, setup=setup, rounds=1, iterations=1, warmup_rounds=0)
    finally:
        gc.unfreeze()
        kvpool.uninstall()
    traces = _TRACES.setdefault((shape, round_), {})
    traces[impl] = trace
    if impl != "vllm" and "vllm" in traces:
        assert traces[impl] == traces["vllm"], f"{impl} scheduled differently from vLLM in round {round_}"


#: (round, mode) in the order the benchmarks run: the modes alternate round by round.
INTERLEAVED = [(r, impl) for r in range(ROUNDS) for impl in MODES]


@pytest.mark.benchmark(timer=_step_clock)  # CPU of the step, as the replay reports it
@pytest.mark.parametrize("round_,impl", INTERLEAVED)
def test_scheduler_step_serving(benchmark, round_, impl):
    _bench_round(benchmark, "serving", round_, impl)


@pytest.mark.benchmark(timer=_step_clock)
@pytest.mark.parametrize("round_,impl", INTERLEAVED)
def test_scheduler_step_grpo(benchmark, round_, impl):
    _bench_round(benchmark, "grpo", round_, impl)
