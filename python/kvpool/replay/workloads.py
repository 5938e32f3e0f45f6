"""Workloads for ``python -m kvpool replay``: request shapes and the engine they run on.

A workload is a list of :class:`RequestSpec` grouped into rounds, plus the
:class:`EngineSpec` (scheduler and cache settings) it is meant to run with. Nothing here
imports vLLM; :mod:`kvpool.replay.driver` turns specs into ``vllm.v1.request.Request``
objects one round at a time.

Lengths are drawn with ``numpy.random.default_rng(seed)``, so a workload is a pure
function of its arguments: every mode of one run, and every run with the same
arguments, sees the same requests.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

#: Model whose shipped config (kvpool/hf_configs) the replay builds ModelConfig from.
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
#: Token id the replay's stand-in model samples to end a request (EOS-style stop).
STOP_TOKEN_ID = 2
#: Prompt and sampled token ids are drawn from [TOKEN_LO, TOKEN_HI): never STOP_TOKEN_ID.
TOKEN_LO, TOKEN_HI = 1000, 150_000


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
        round: round index, from 0. Rounds run one after another; between rounds no
            request is alive (the RFC's precondition for ``reset_prefix_cache``).
        prompt_len: prompt tokens.
        output_len: tokens the stand-in model samples, the last being the stop token.
        prefix_group: requests with the same ``(round, prefix_group)`` share prompt
            token ids (the longest one's prefix), as the n samples of one GRPO prompt
            do; ``None``: a prompt of its own.
        arrival_step: engine steps after the round starts at which the request is added
            (in a continuous workload: after the run starts).
        prefix_len: tokens of the prompt taken from its prefix group (a shared system
            prompt), the rest being its own; ``None``: the whole prompt comes from the
            group (the n samples of one GRPO prompt).
    """

    round: int
    prompt_len: int
    output_len: int
    prefix_group: str | None = None
    arrival_step: int = 0
    prefix_len: int | None = None

    def shared_len(self) -> int:
        """Prompt tokens taken from the prefix group (0 without a group)."""
        if self.prefix_group is None:
            return 0
        return self.prompt_len if self.prefix_len is None else min(self.prefix_len, self.prompt_len)


@dataclass(frozen=True)
class EngineSpec:
    """Scheduler/cache settings a workload runs with (block pool geometry comes from the CLI)."""

    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = False
    max_num_batched_tokens: int | None = None  # None: max_model_len
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: from the requests (rounded up to 1024)
    #: Async scheduling with a consumer KV connector: vLLM's deferred block frees.
    async_scheduling: bool = False
    kv_connector: str | None = None
    kv_role: str | None = None
    model: str = DEFAULT_MODEL


@dataclass
class Workload:
    name: str
    description: str
    requests: list[RequestSpec]
    engine: EngineSpec
    #: Distributions and knobs, recorded in the JSON report.
    params: dict[str, Any] = field(default_factory=dict)
    #: A continuous workload never drains between rounds: its requests arrive at
    #: ``arrival_step`` steps after the run starts, round ``r`` is the window of engine
    #: steps ``[r * window_steps, (r + 1) * window_steps)``, prefix groups span the whole
    #: run and no reset runs between rounds (``serving``, traces without ``round``).
    continuous: bool = False
    window_steps: int = 0

    @property
    def num_rounds(self) -> int:
        return 1 + max((r.round for r in self.requests), default=-1)

    def round_requests(self, rnd: int) -> list[RequestSpec]:
        return [r for r in self.requests if r.round == rnd]

    def stream_requests(self) -> list[RequestSpec]:
        """All requests of a continuous workload in arrival order (stable)."""
        return sorted(self.requests, key=lambda r: r.arrival_step)

    def max_model_len(self) -> int:
        if self.engine.max_model_len is not None:
            return self.engine.max_model_len
        longest = max(r.prompt_len + r.output_len for r in self.requests)
        return 1024 * math.ceil((longest + 1) / 1024)

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "description": self.description,
            "num_rounds": self.num_rounds,
            "num_requests": len(self.requests),
            "params": self.params,
            "engine": asdict(self.engine),
        }
        if self.continuous:
            out["continuous"] = True
            out["window_steps"] = self.window_steps
        return out


def _uniform(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    lo, hi = lo_hi
    return int(rng.integers(lo, hi + 1))


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def grpo(
    rounds: int = 20,
    prompts_per_round: int = 2,
    samples_per_prompt: int = 4,
    prompt_len: tuple[int, int] = (70_000, 90_000),
    output_len: tuple[int, int] = (2_048, 6_144),
    scale: float = 1.0,
    seed: int = 0,
) -> Workload:
    """The RFC's GRPO rollout shape: each round, ``prompts_per_round`` prompts with
    ``samples_per_prompt`` samples each (identical prompt token ids, so prefix caching
    shares the prompt blocks), prefix caching on, chunked prefill off.

    Prompt lengths ~ U{prompt_len} per prompt, output lengths ~ U{output_len} * scale
    per sample (the RFC reports "long input (70000+ token) + long output (4096)").
    All requests of a round arrive together, as one ``LLM.generate`` call does.
    """
    rng = np.random.default_rng(seed)
    reqs = []
    for rnd in range(rounds):
        for p in range(prompts_per_round):
            plen = _uniform(rng, prompt_len)
            for _ in range(samples_per_prompt):
                olen = _scaled(_uniform(rng, output_len), scale)
                reqs.append(RequestSpec(rnd, plen, olen, prefix_group=f"p{p}"))
    return Workload(
        name="grpo",
        description=(
            f"GRPO rollout: {rounds} rounds x {prompts_per_round} prompts x "
            f"n={samples_per_prompt} samples sharing the prompt; prefix caching on, "
            "chunked prefill off"
        ),
        requests=reqs,
        engine=EngineSpec(enable_prefix_caching=True, enable_chunked_prefill=False),
        params={
            "rounds": rounds,
            "prompts_per_round": prompts_per_round,
            "samples_per_prompt": samples_per_prompt,
            "prompt_len": f"U{{{prompt_len[0]}..{prompt_len[1]}}} per prompt",
            "output_len": f"U{{{output_len[0]}..{output_len[1]}}} x {scale} per sample",
            "scale": scale,
            "seed": seed,
        },
    )


def long_sequential(
    rounds: int = 7,
    warmup: int = 2,
    prompt_len: tuple[int, int] = (1024, 1024),
    output_len: tuple[int, int] = (65_536, 65_536),
    scale: float = 1.0,
    seed: int = 0,
    enable_prefix_caching: bool = False,
) -> Workload:
    """The GB10 report in the RFC's discussion: one request at a time (concurrency 1),
    ISL 1024, OSL 65536 (times ``scale``), 2 warmup + 5 measured requests; each
    request is a round of its own.

    Prefix caching defaults to off: with it on, vLLM appends every (hashed) freed block
    to the LRU tail, so seven requests of ~2,100 blocks never reach a recycled block of
    an 85,000-block pool and nothing scrambles (pass ``enable_prefix_caching=True`` to
    see that); with it off, vLLM prepends the reversed blocks and the next request
    allocates them in descending order.
    """
    rng = np.random.default_rng(seed)
    reqs = [
        RequestSpec(rnd, _uniform(rng, prompt_len), _scaled(_uniform(rng, output_len), scale))
        for rnd in range(rounds)
    ]
    return Workload(
        name="long-sequential",
        description=(
            f"GB10 report: {rounds} sequential requests ({warmup} warmup), "
            f"prefix caching {'on' if enable_prefix_caching else 'off'}"
        ),
        requests=reqs,
        engine=EngineSpec(
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=True,
            max_num_batched_tokens=8192,
        ),
        params={
            "rounds": rounds,
            "warmup": warmup,
            "prompt_len": f"U{{{prompt_len[0]}..{prompt_len[1]}}}",
            "output_len": f"U{{{output_len[0]}..{output_len[1]}}} x {scale}",
            "scale": scale,
            "seed": seed,
        },
    )


def pd_async(
    rounds: int = 8,
    requests_per_round: int = 48,
    arrival_interval: int = 4,
    prompt_len: tuple[int, int] = (2_048, 16_384),
    output_len: tuple[int, int] = (64, 1_024),
    scale: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Decode instance of a prefill/decode-disaggregated deployment under async
    scheduling: vLLM's ``DecodeBenchConnector`` (role ``kv_consumer``) supplies each
    prompt's KV (all but the last token) as an external load, the engine keeps two
    batches in flight, and requests end on a sampled stop token, so a request that
    stops while the next step is already scheduled has its block free deferred
    (``Scheduler.defer_block_free``) until that step's output is processed.

    Request ``i`` of a round arrives at step ``i * arrival_interval``; prompt lengths
    ~ U{prompt_len}, output lengths ~ U{output_len} * scale, each prompt distinct.
    """
    rng = np.random.default_rng(seed)
    reqs = [
        RequestSpec(
            rnd,
            _uniform(rng, prompt_len),
            _scaled(_uniform(rng, output_len), scale),
            arrival_step=i * arrival_interval,
        )
        for rnd in range(rounds)
        for i in range(requests_per_round)
    ]
    return Workload(
        name="pd-async",
        description=(
            f"P/D decode side, async scheduling (2 batches in flight), "
            f"DecodeBenchConnector kv_consumer, {rounds} rounds x {requests_per_round} "
            "staggered requests; deferred block frees"
        ),
        requests=reqs,
        engine=EngineSpec(
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=8192,
            async_scheduling=True,
            kv_connector="DecodeBenchConnector",
            kv_role="kv_consumer",
        ),
        params={
            "rounds": rounds,
            "requests_per_round": requests_per_round,
            "arrival_interval_steps": arrival_interval,
            "prompt_len": f"U{{{prompt_len[0]}..{prompt_len[1]}}}",
            "output_len": f"U{{{output_len[0]}..{output_len[1]}}} x {scale}",
            "scale": scale,
            "seed": seed,
        },
    )


#: Engine of continuous (serving) workloads: chunked prefill with vLLM's usual
#: online-serving token budget.
SERVING_BATCHED_TOKENS = 8192


def _poisson_arrivals(
    rng: np.random.Generator,
    rate: float,
    horizon: int,
    residence: Callable[[int], int],
    in_flight: tuple[int, int],
    margin: int,
) -> list[tuple[int, int]]:
    """Arrival steps of a Poisson process of ``rate`` requests per engine step over
    ``[0, horizon)``, held inside a concurrency window the way a load generator with a
    bounded number of connections does.

    The first ``(lo + hi) // 2`` requests arrive at step 0 (the run starts loaded, not
    from an empty engine). Then each arrival comes an exponential gap after the previous
    one, except that in a model of the engine (request ``k`` leaves ``residence(k)``
    steps after it arrives) an arrival that would put more than ``hi - margin`` requests
    in flight waits for a departure, and a departure that leaves fewer than
    ``lo + margin`` brings the next arrival forward to that step. The margin absorbs the
    model's error (queueing for the token budget), so the real engine stays in ``[lo, hi]``.

    Returns:
        ``[(arrival_step, k), ...]`` in arrival order, ``k`` = request index (the
        caller draws request ``k``'s shape before calling, so ``residence(k)`` knows it).
    """
    lo, hi = in_flight[0] + margin, in_flight[1] - margin
    departures: list[int] = []
    out: list[tuple[int, int]] = []
    k = 0
    for _ in range((in_flight[0] + in_flight[1]) // 2):
        out.append((0, k))
        heapq.heappush(departures, residence(k))
        k += 1
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        step = int(t)
        while departures and departures[0] <= step:
            d = heapq.heappop(departures)
            if len(departures) < lo:  # about to run low: the next client arrives now
                step, t = d, float(d)
                break
        while len(departures) >= hi:  # a full window: wait for a slot
            d = heapq.heappop(departures)
            if d > step:
                step, t = d, float(d)
        if step >= horizon:
            return out
        out.append((step, k))
        heapq.heappush(departures, step + residence(k))
        k += 1


def serving(
    rounds: int = 12,
    window_steps: int = 1000,
    in_flight: tuple[int, int] = (32, 64),
    prompt_len: tuple[int, int] = (1_024, 16_384),
    prefix_len: tuple[int, int] = (1_024, 8_192),
    output_len: tuple[int, int] = (64, 1_024),
    prefix_groups: int = 16,
    shared_fraction: float = 0.75,
    scale: float = 1.0,
    seed: int = 0,
) -> Workload:
    """An online-serving engine that never idles: requests keep arriving while others
    run, so the free queue is never empty of in-use neighbours and no reset or reorder
    can run between rounds (the case ``kvpool+reorder`` cannot help with).

    Arrivals are Poisson at a fixed seed (see :func:`_poisson_arrivals`) with a rate
    that keeps about ``mean(in_flight)`` requests in flight, clipped to ``in_flight``
    (``max_num_seqs`` = its upper end). Each request's prompt length ~ U{prompt_len};
    with probability ``shared_fraction`` it starts with one of ``prefix_groups`` shared
    system prompts (group ``g``'s length ~ U{prefix_len}, drawn once), the rest of the
    prompt being its own. Output lengths ~ U{output_len} * scale. Prefix caching and
    chunked prefill on (``max_num_batched_tokens`` 8,192).

    Round ``r`` is the window of engine steps ``[r * window_steps, (r + 1) *
    window_steps)``: its metrics cover the prompts allocated and the requests finished
    in that window; requests still running at the end of the last window are drained
    (reported separately, ``info.drain``).
    """
    if not 1 <= in_flight[0] <= in_flight[1]:
        raise ValueError(f"in_flight must be 1 <= LO <= HI, got {in_flight}")
    rng = np.random.default_rng(seed)
    group_prefix = [_uniform(rng, prefix_len) for _ in range(prefix_groups)]
    horizon = rounds * window_steps
    shapes: list[tuple[int, int, int | None]] = []  # (prompt_len, output_len, group)

    def draw() -> None:
        plen = _uniform(rng, prompt_len)
        olen = _scaled(_uniform(rng, output_len), scale)
        group = int(rng.integers(prefix_groups)) if prefix_groups and rng.random() < shared_fraction else None
        shapes.append((plen, olen, group))

    def residence(k: int) -> int:
        while len(shapes) <= k:
            draw()
        plen, olen, _ = shapes[k]
        return olen + math.ceil(plen / SERVING_BATCHED_TOKENS)

    mean_residence = (output_len[0] + output_len[1]) / 2 * scale + 1.5
    rate = (in_flight[0] + in_flight[1]) / 2 / mean_residence
    # One generator for arrivals and shapes, interleaved deterministically.
    arrivals = _poisson_arrivals(rng, rate, horizon, residence, in_flight, margin=max(1, (in_flight[1] - in_flight[0]) // 8))
    reqs = []
    for step, k in arrivals:
        plen, olen, group = shapes[k]
        reqs.append(RequestSpec(
            step // window_steps, plen, olen,
            prefix_group=None if group is None else f"s{group}",
            arrival_step=step,
            prefix_len=None if group is None else group_prefix[group],
        ))
    return Workload(
        name="serving",
        description=(
            f"online serving, never idle: Poisson arrivals, {in_flight[0]}-{in_flight[1]} requests in "
            f"flight, {rounds} windows x {window_steps} steps, {prefix_groups} shared system prompts; "
            "prefix caching on, chunked prefill on"
        ),
        requests=reqs,
        engine=EngineSpec(
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=SERVING_BATCHED_TOKENS,
            max_num_seqs=in_flight[1],
        ),
        params={
            "rounds": rounds,
            "window_steps": window_steps,
            "in_flight": list(in_flight),
            "arrival_rate_per_step": rate,
            "prompt_len": f"U{{{prompt_len[0]}..{prompt_len[1]}}}",
            "prefix_len": f"U{{{prefix_len[0]}..{prefix_len[1]}}} per group",
            "prefix_groups": prefix_groups,
            "shared_fraction": shared_fraction,
            "output_len": f"U{{{output_len[0]}..{output_len[1]}}} x {scale}",
            "scale": scale,
            "seed": seed,
        },
        continuous=True,
        window_steps=window_steps,
    )


def from_trace(
    path: str | Path,
    scale: float = 1.0,
    enable_prefix_caching: bool = True,
    window_steps: int = 1000,
) -> Workload:
    """A user's workload from a JSON-lines file, one request per line::

        {"round": 0, "prompt_len": 8000, "output_len": 512, "prefix_group": "q17"}

    ``prompt_len`` (int >= 1) and ``output_len`` (int >= 1) are required;
    ``prefix_group`` (str, int or null) is optional: requests with the same group (and
    round) share prompt token ids; ``prefix_len`` (int >= 0, optional) limits the shared
    part to that many leading tokens (a system prompt), the rest being the request's own.
    ``arrival_step`` (int >= 0, default 0) is the engine step at which it is added.

    Two kinds of trace:

    - **rounds** (every line has ``round``, int >= 0): rounds run one after another,
      each until its requests finish, ``arrival_step`` counting from the round's start
      (the batch/RL shape).
    - **continuous** (no line has ``round``, every line has ``arrival_step``): a serving
      trace; requests arrive at ``arrival_step`` after the run starts and the engine
      never drains until the end; round ``r`` is the window of steps
      ``[r * window_steps, (r + 1) * window_steps)`` and prefix groups span the run.

    Blank lines and lines starting with ``#`` are skipped; other keys are ignored.

    Raises:
        ValueError: a line is not valid JSON, a field is missing or out of range, or
            the trace mixes lines with and without ``round`` (the message names the line).
    """
    if window_steps < 1:
        raise ValueError(f"window_steps must be >= 1, got {window_steps}")
    rows = []
    path = Path(path)
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
            plen, olen = int(obj["prompt_len"]), int(obj["output_len"])
            rnd = None if obj.get("round") is None else int(obj["round"])
            group = obj.get("prefix_group")
            has_arrival = obj.get("arrival_step") is not None
            arrival = int(obj["arrival_step"]) if has_arrival else 0
            prefix = None if obj.get("prefix_len") is None else int(obj["prefix_len"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{lineno}: bad trace line ({e!r}): {line[:120]}") from e
        if (rnd is not None and rnd < 0) or plen < 1 or olen < 1 or arrival < 0 or (prefix is not None and prefix < 0):
            raise ValueError(f"{path}:{lineno}: round/arrival_step/prefix_len must be >= 0, lengths >= 1")
        if rows and (rnd is None) != (rows[0][0] is None):
            raise ValueError(
                f"{path}:{lineno}: the trace mixes lines with and without \"round\" "
                "(rounds: every line has one; continuous: none has)")
        if rnd is None and not has_arrival:
            raise ValueError(f"{path}:{lineno}: a continuous trace (no \"round\") needs \"arrival_step\"")
        rows.append((rnd, plen, olen, group, arrival, prefix))
    if not rows:
        raise ValueError(f"{path}: no requests")
    continuous = rows[0][0] is None
    reqs = [
        RequestSpec(
            arrival // window_steps if continuous else rnd,
            plen,
            _scaled(olen, scale),
            prefix_group=None if group is None else str(group),
            arrival_step=arrival,
            prefix_len=prefix,
        )
        for rnd, plen, olen, group, arrival, prefix in rows
    ]
    if continuous:
        engine = EngineSpec(
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=True,
            max_num_batched_tokens=SERVING_BATCHED_TOKENS,
        )
        kind = f"continuous, windows of {window_steps} steps"
    else:
        engine = EngineSpec(enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=False)
        kind = "rounds"
    return Workload(
        name="trace",
        description=f"trace {path.name}: {len(reqs)} requests ({kind})",
        requests=reqs,
        engine=engine,
        params={"trace": str(path), "scale": scale, **({"window_steps": window_steps} if continuous else {})},
        continuous=continuous,
        window_steps=window_steps if continuous else 0,
    )


def truncate_rounds(workload: Workload, rounds: int) -> Workload:
    """The first ``rounds`` rounds of ``workload``."""
    return replace(workload, requests=[r for r in workload.requests if r.round < rounds])


WORKLOADS = {"grpo": grpo, "long-sequential": long_sequential, "pd-async": pd_async, "serving": serving}
