"""Workloads for ``python -m kvpool replay``: request shapes and the engine they run on.

A workload is a list of :class:`RequestSpec` grouped into rounds, plus the
:class:`EngineSpec` (scheduler and cache settings) it is meant to run with. Nothing here
imports vLLM; :mod:`kvpool.tools.replay.engine` turns specs into ``vllm.v1.request.Request``
objects one round at a time.

Lengths are drawn with ``numpy.random.default_rng(seed)``, so a workload is a pure
function of its arguments: every mode of one run, and every run with the same
arguments, sees the same requests.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

#: Model whose shipped config (kvpool/tools/hf_configs) the replay builds ModelConfig from.
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
    #: vLLM's ``--hf-overrides`` for ``model``'s config (``--model``), e.g. ``{"num_hidden_layers": 40}``.
    hf_overrides: dict[str, Any] | None = None
    #: vLLM's ``--mamba-ssm-cache-dtype`` (``--model``; docs/replay.md, "Model shapes").
    mamba_ssm_cache_dtype: str = "float32"


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
    #: A P/D workload (``pd``): the prefill side (the requests to their first token, own pool); this is the decode side.
    prefill: Workload | None = None

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
        if self.prefill is not None:
            out["prefill_engine"] = asdict(self.prefill.engine)
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


def pd(**kwargs: Any) -> Workload:
    """Both sides of a prefill/decode-disaggregated deployment: the decode side is
    :func:`pd_async` (same arguments), the prefill side (``Workload.prefill``) the same
    requests to their first token (``max_tokens=1``, as vLLM's P/D proxy sends them) on
    a scheduler and pool of its own, prefix caching and chunked prefill on, no connector.
    Each prompt's KV moves from its prefill-side table to its decode-side table: one
    descriptor per run in which both ascend together (docs/replay.md, "P/D")."""
    decode = pd_async(**kwargs)
    return with_prefill_side(decode, "pd", decode.engine)


def with_prefill_side(decode: Workload, name: str, engine: EngineSpec) -> Workload:
    """``decode`` named ``name`` on ``engine`` (the decode side), with its prefill side:
    the same requests to their first token, prefix caching and chunked prefill on."""
    max_model_len = decode.max_model_len()
    decode = replace(decode, name=name, engine=replace(engine, max_model_len=max_model_len),
                     description="P/D, both sides: " + decode.description)
    prefill_engine = EngineSpec(enable_prefix_caching=True, enable_chunked_prefill=True,
                                max_num_batched_tokens=8192, max_model_len=max_model_len)
    decode.prefill = replace(decode, name=f"{name}-prefill", engine=prefill_engine,
                             requests=[replace(r, output_len=1) for r in decode.requests],
                             description="P/D prefill side: the requests to their first token")
    return decode


def pd_serving(**kwargs: Any) -> Workload:
    """:func:`serving` (same arguments) as P/D, both sides continuous: the prefill side
    the requests to their first token, the decode side a ``DecodeBenchConnector``
    consumer under async scheduling, each prompt arriving there when its prefill is done
    (:mod:`kvpool.tools.replay.pd_stream`). Defaults: 6 windows of 500 steps."""
    return as_pd_serving(serving(**{"rounds": 6, "window_steps": 500, **kwargs}))


def as_pd_serving(stream: Workload) -> Workload:
    """A continuous workload (``serving``, a trace) as ``pd-serving``; ValueError if not."""
    if not stream.continuous:
        raise ValueError(f"{stream.name} is not continuous: pd-serving needs a stream")
    return with_prefill_side(stream, "pd-serving", replace(
        stream.engine, async_scheduling=True, kv_connector="DecodeBenchConnector", kv_role="kv_consumer"))


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


class _ServingShapes:
    """Request shapes of :func:`serving`, drawn from ``rng`` as the arrival model asks
    for them: ``(prompt_len, output_len, prefix group or None)`` per request index."""

    def __init__(self, rng: np.random.Generator, prompt_len: tuple[int, int], output_len: tuple[int, int],
                 scale: float, prefix_groups: int, shared_fraction: float) -> None:
        self.rng, self.prompt_len, self.output_len, self.scale = rng, prompt_len, output_len, scale
        self.prefix_groups, self.shared_fraction = prefix_groups, shared_fraction
        self.shapes: list[tuple[int, int, int | None]] = []

    def draw(self) -> None:
        rng = self.rng
        plen = _uniform(rng, self.prompt_len)
        olen = _scaled(_uniform(rng, self.output_len), self.scale)
        group = (int(rng.integers(self.prefix_groups))
                 if self.prefix_groups and rng.random() < self.shared_fraction else None)
        self.shapes.append((plen, olen, group))

    def residence(self, k: int) -> int:
        """Engine steps request ``k`` stays: its output plus its prefill chunks."""
        while len(self.shapes) <= k:
            self.draw()
        plen, olen, _ = self.shapes[k]
        return olen + math.ceil(plen / SERVING_BATCHED_TOKENS)


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
    mean_residence = (output_len[0] + output_len[1]) / 2 * scale + 1.5
    rate = (in_flight[0] + in_flight[1]) / 2 / mean_residence
    shapes = _ServingShapes(rng, prompt_len, output_len, scale, prefix_groups, shared_fraction)
    # One generator for arrivals and shapes, interleaved deterministically.
    arrivals = _poisson_arrivals(rng, rate, rounds * window_steps, shapes.residence, in_flight,
                                 margin=max(1, (in_flight[1] - in_flight[0]) // 8))
    reqs = []
    for step, k in arrivals:
        plen, olen, group = shapes.shapes[k]
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


WORKLOADS = {"grpo": grpo, "long-sequential": long_sequential, "pd-async": pd_async, "pd": pd, "serving": serving,
             "pd-serving": pd_serving}
