"""``--trace FILE.jsonl``: a user's workload, one request per line (docs/replay.md).

A trace is either **rounds** (every line has ``round``) or **continuous** (no line has
``round``, every line has ``arrival_step``), replayed like the ``serving`` workload.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvpool.tools.replay.workloads import SERVING_BATCHED_TOKENS, EngineSpec, RequestSpec, Workload, _scaled

#: One parsed line: (round or None, prompt_len, output_len, prefix_group, arrival_step,
#: whether arrival_step was given, prefix_len or None).
_Row = tuple


def _parse_line(path: Path, lineno: int, line: str) -> _Row:
    """One trace line's fields, checked; ``ValueError`` naming ``path:lineno`` if bad."""
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
    return rnd, plen, olen, group, arrival, has_arrival, prefix


def _read_rows(path: Path) -> list[_Row]:
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        row = _parse_line(path, lineno, line)
        rnd, has_arrival = row[0], row[5]
        if rows and (rnd is None) != (rows[0][0] is None):
            raise ValueError(
                f"{path}:{lineno}: the trace mixes lines with and without \"round\" "
                "(rounds: every line has one; continuous: none has)")
        if rnd is None and not has_arrival:
            raise ValueError(f"{path}:{lineno}: a continuous trace (no \"round\") needs \"arrival_step\"")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


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
    path = Path(path)
    rows = _read_rows(path)
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
        for rnd, plen, olen, group, arrival, _, prefix in rows
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
    return dataclasses.replace(workload, requests=[r for r in workload.requests if r.round < rounds])


