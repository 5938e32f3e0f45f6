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

import json
import math
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
        arrival_step: engine steps after the round starts at which the request is added.
    """

    round: int
    prompt_len: int
    output_len: int
    prefix_group: str | None = None
    arrival_step: int = 0


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

    @property
    def num_rounds(self) -> int:
        return 1 + max((r.round for r in self.requests), default=-1)

    def round_requests(self, rnd: int) -> list[RequestSpec]:
        return [r for r in self.requests if r.round == rnd]

    def max_model_len(self) -> int:
        if self.engine.max_model_len is not None:
            return self.engine.max_model_len
        longest = max(r.prompt_len + r.output_len for r in self.requests)
        return 1024 * math.ceil((longest + 1) / 1024)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "num_rounds": self.num_rounds,
            "num_requests": len(self.requests),
            "params": self.params,
            "engine": asdict(self.engine),
        }


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


def from_trace(path: str | Path, scale: float = 1.0, enable_prefix_caching: bool = True) -> Workload:
    """A user's workload from a JSON-lines file, one request per line::

        {"round": 0, "prompt_len": 8000, "output_len": 512, "prefix_group": "q17"}

    ``round`` (int >= 0), ``prompt_len`` (int >= 1) and ``output_len`` (int >= 1) are
    required; ``prefix_group`` (str, int or null) is optional: requests with the same
    round and group share prompt token ids. Optional ``arrival_step`` (int >= 0, default
    0) delays a request by that many engine steps into its round. Blank lines and lines
    starting with ``#`` are skipped; other keys are ignored.

    Raises:
        ValueError: a line is not valid JSON or a field is missing or out of range
            (the message names the line).
    """
    reqs = []
    path = Path(path)
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
            rnd, plen, olen = int(obj["round"]), int(obj["prompt_len"]), int(obj["output_len"])
            group = obj.get("prefix_group")
            arrival = int(obj.get("arrival_step", 0))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: bad trace line ({e!r}): {line[:120]}") from e
        if rnd < 0 or plen < 1 or olen < 1 or arrival < 0:
            raise ValueError(f"{path}:{lineno}: round/arrival_step must be >= 0, lengths >= 1")
        reqs.append(
            RequestSpec(
                rnd,
                plen,
                _scaled(olen, scale),
                prefix_group=None if group is None else str(group),
                arrival_step=arrival,
            )
        )
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return Workload(
        name="trace",
        description=f"trace {path.name}: {len(reqs)} requests",
        requests=reqs,
        engine=EngineSpec(enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=False),
        params={"trace": str(path), "scale": scale},
    )


def truncate_rounds(workload: Workload, rounds: int) -> Workload:
    """The first ``rounds`` rounds of ``workload``."""
    return replace(workload, requests=[r for r in workload.requests if r.round < rounds])


WORKLOADS = {"grpo": grpo, "long-sequential": long_sequential, "pd-async": pd_async}
