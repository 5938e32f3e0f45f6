"""Rendering of a replay report: rich tables on the terminal, a matplotlib PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpool.tools.replay import free_order, group_report
from kvpool.tools.replay.plots import figure, first_wrap_round, plot  # noqa: F401 (the report's figure)
from kvpool.tools.replay.probe import primary_index

_RICH = {"vanilla": "red", "kvpool": "yellow", "kvpool+reorder": "green", "kvpool+contiguous": "blue"}


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _mode_head(m: str) -> str:
    # "kvpool+contiguous" over two lines ("kvpool" / "+contiguous"): narrower columns.
    return f"[{_RICH.get(m, 'white')}]{m.replace('+', chr(10) + '+')}[/]"


def _longest_word(cells) -> int:
    return max((len(w) for c in cells for w in str(c).split()), default=1)


def _count(x: int | None) -> str:
    return "-" if x is None else str(x)


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.1f}"


def _cell(r: dict[str, Any], i: int, key: str, fmt) -> str:
    rr = r["rounds"][i] if i < len(r["rounds"]) else {}
    v = rr.get(key)
    return fmt(v) if callable(fmt) else _f(v, fmt)


def _head(label: str, m: str) -> str:
    return f"{label}\n{_mode_head(m)}"


def _per_round(modes: dict[str, Any], n: int, warm: int, width: int, title: str,
               columns: list[tuple[str, str, Any]]) -> list:
    """Tables of ``columns`` (label, round key, format) per round, one column per mode.

    One table per group of metrics that fits ``width``: a metric's mode columns stay
    side by side, and no number is cut to "1409…".
    """
    from rich.table import Table

    def group_width(label: str, key: str, fmt) -> int:
        w = 0
        for m, r in modes.items():
            cells = [_cell(r, i, key, fmt) for i in range(n)]
            w += max([len(c) for c in cells] + [len(label), *map(len, m.replace("+", " +").split())]) + 3
        return w

    first = max(len(f"{n - 1} (warmup)") if warm else len(str(n - 1)), len("round")) + 4
    groups: list[list[tuple[str, str, Any]]] = [[]]
    used = first
    for col in columns:
        w = group_width(*col)
        if groups[-1] and used + w > width:
            groups.append([])
            used = first
        groups[-1].append(col)
        used += w
    tables = []
    for k, group in enumerate(groups):
        t = Table(title=title if k == 0 else f"{title} (continued)", title_justify="left")
        t.add_column("round", justify="right", no_wrap=True)
        for label, _, _ in group:
            for m in modes:
                t.add_column(_head(label, m), justify="right", no_wrap=True)
        for i in range(n):
            row = [f"{i}{' (warmup)' if i < warm else ''}"]
            for _, key, fmt in group:
                row += [_cell(r, i, key, fmt) for r in modes.values()]
            t.add_row(*row)
        tables.append(t)
    return tables


def _cache_table(modes: dict[str, Any], n: int, ref_mode: str):
    """Prefix cache and preemptions: ``ref_mode``'s numbers, and per other mode whether
    its round had exactly those (hit tokens, evicted hashes in order, preemptions)."""
    from rich.table import Table

    t = Table(title="prefix-cache hit tokens, evictions (cached blocks), preemptions; "
              "other modes: all three equal to vanilla's (evictions: same hashes, same order)",
              title_justify="left")
    ref = modes[ref_mode]["rounds"]
    t.add_column("round", justify="right", no_wrap=True)
    for label, key in (("hit tokens", "prefix_cache_hit_tokens"), ("evictions", "evictions"),
                       ("preemptions", "preemptions")):
        words = [str(x.get(key, "-")) for x in ref] + label.split() + [ref_mode]
        t.add_column(_head(label, ref_mode), justify="right", overflow="fold", min_width=_longest_word(words))
    others = [m for m in modes if m != ref_mode]
    for m in others:
        t.add_column(_head(f"= {ref_mode}", m), justify="center", overflow="fold",
                     min_width=_longest_word([ref_mode, *m.replace("+", " +").split()]))
    for i in range(n):
        rr = ref[i] if i < len(ref) else {}
        row = [str(i), str(rr.get("prefix_cache_hit_tokens", "-")), str(rr.get("evictions", "-")),
               str(rr.get("preemptions", "-"))]
        for m in others:
            xs = modes[m]["rounds"]
            if i >= len(xs) or not rr:
                row.append("-")
                continue
            same = all(xs[i].get(k) == rr.get(k) for k in
                       ("prefix_cache_hit_tokens", "evictions", "eviction_digest", "preemptions"))
            row.append("[green]yes[/]" if same else "[bold red]NO[/]")
        t.add_row(*row)
    return t


def _continuous_table(rounds: list[dict[str, Any]], ref_mode: str, window_steps):
    from rich.table import Table

    t = Table(title=f"continuous load ({ref_mode}): rounds are windows of {window_steps} engine steps",
              title_justify="left")
    for label in ("round", "arrivals", "finished", "in flight min-max (mean)", "running min-max",
                  "idle steps"):
        t.add_column(label, justify="right")
    for x in rounds:
        t.add_row(str(x["round"]), str(x["arrivals"]), str(x["finished"]),
                  f"{x['in_flight_min']}-{x['in_flight_max']} ({x['in_flight_mean']:.1f})",
                  f"{x['running_min']}-{x['running_max']}", str(x["idle_steps"]))
    return t


def _total(key: str):
    return lambda m, r, c: str(sum(x[key] for x in r["rounds"]))


def _pool_class(m, r, c) -> str:
    name = r["info"]["block_pool_class"]
    return f"{name.split('.', 1)[0]}: {name.rsplit('.', 1)[-1]}"


def _cache_equal(m, r, c) -> str:
    if c.get("rounds_cache_equal_to_vanilla") is None:
        return "-"
    return f"{c['rounds_cache_equal_to_vanilla']}/{c['rounds_compared']} rounds"


def _reorder(m, r, c) -> str:
    xs = [x["reorder_cpu_s"] for x in r["rounds"] if "reorder_cpu_s" in x]
    if not xs:
        return "-"
    ok = sum(bool(x.get("reorder_ok")) for x in r["rounds"] if "reorder_cpu_s" in x)
    return f"{ok}/{len(xs)} ok, {sum(xs) / len(xs) * 1e6:.1f} us"


def _scaled(key: str, factor: float, fmt: str):
    """``comparison[mode][key] * factor`` formatted, ``-`` when absent."""
    return lambda m, r, c: _f(None if c.get(key) is None else c[key] * factor, fmt)


def _ratio(key: str):
    """``comparison[mode][key]`` as a ratio: two decimals, or two significant digits below
    0.1 (a 430-fold drop reads 0.0023x, not 0.00x)."""
    def cell(m, r, c):
        v = c.get(key)
        return _f(v, "{:.2g}x" if isinstance(v, (int, float)) and 0 < v < 0.1 else "{:.2f}x")
    return cell


def _summary_rows(modes: dict[str, Any], comparison: dict[str, Any], deferred: bool,
                  continuous: bool, groups: list | None = None) -> list[tuple[str, Any]]:
    """(label, ``fn(mode, mode result, comparison entry) -> cell``) of the per-mode summary.
    ``groups``: the KV cache groups vLLM resolved (``config.kv_cache_geometry.groups``);
    with several, the contiguity row names the group it reads (the first full-attention
    one, as the per-round figures do) and the descriptors row says it counts them all."""
    contiguity_of = descriptors_of = ""
    if groups and len(groups) > 1:
        kinds = [g.get("kind") for g in groups]
        primary = primary_index(kinds)
        contiguity_of = f" (group {primary}, {kinds[primary]})"
        descriptors_of = f" (all {len(groups)} groups)"
    rows: list[tuple[str, Any]] = [
        ("block pool (package:class)", _pool_class),
        ("engine steps", _total("num_steps")),
        ("sched CPU us/step", lambda m, r, c: _us(c.get("sched_cpu_s_per_step"))),
        ("  vs vanilla", _ratio("sched_cpu_ratio_vs_vanilla")),
    ]
    if "kvpool" in modes:
        rows.append(("  vs kvpool", _ratio("sched_cpu_ratio_vs_kvpool")))
    rows.append(("prefill-step CPU ms/round", lambda m, r, c: _f(
        sum(x["prefill_sched_cpu_s"] for x in r["rounds"]) / len(r["rounds"]) * 1e3, "{:.2f}")))
    if deferred:
        rows += [
            ("deferred frees (blocks)", lambda m, r, c: f"{sum(x['deferred_frees'] for x in r['rounds'])} "
             f"({sum(x['deferred_blocks'] for x in r['rounds'])})"),
            ("drain CPU us/step", _scaled("drain_cpu_s_per_step", 1e6, "{:.2f}")),
            ("  vs vanilla", _ratio("drain_cpu_ratio_vs_vanilla")),
            ("push+drain ns per deferred block (median)", _scaled("deferred_free_s_per_block_median", 1e9, "{:.0f}")),
            ("  vs vanilla", _ratio("deferred_free_ratio_vs_vanilla")),
        ]
    rows += [
        ("min / mean prompt contiguity" + contiguity_of,
         lambda m, r, c: f"{_f(c.get('min_contiguity'))} / {_f(c.get('mean_contiguity'))}"),
        ("highest block id used", lambda m, r, c: str(max(x["max_block_id"] for x in r["rounds"]))),
    ]
    if "prompt_descriptors_total" in next(iter(comparison.values()), {}):
        rows += [
            ("transfer descriptors per prompt" + descriptors_of, _scaled("prompt_descriptors_per_prompt", 1, "{:.1f}")),
            ("  vs vanilla", _ratio("prompt_descriptors_ratio_vs_vanilla")),
        ]
        if any(c.get("offload_copies_total") is not None for c in comparison.values()):
            rows += [
                ("offloaded blocks per copy", _scaled("offload_blocks_per_copy", 1, "{:.2f}")),
                ("  copies vs vanilla", _ratio("offload_copies_ratio_vs_vanilla")),
            ]
    rows += [
        ("preemptions", _total("preemptions")),
        ("prefix-cache hit tokens", _total("prefix_cache_hit_tokens")),
        ("evictions (cached blocks)", _total("evictions")),
        ("hits/evictions/preemptions equal to vanilla", _cache_equal),
        ("blocks not freed after a round", lambda m, r, c: str(c.get("max_leaked_blocks", 0))),
        ("rounds with vanilla's exact tables", lambda m, r, c: "-" if c.get("rounds_identical_to_vanilla") is None
         else f"{c['rounds_identical_to_vanilla']}/{len(r['rounds'])}"),
        ("reorder between rounds", _reorder),
    ]
    if continuous:
        rows += [
            ("drain after the last window (steps)",
             lambda m, r, c: str(r["info"].get("drain", {}).get("steps", "-"))),
            ("blocks not freed after the drain",
             lambda m, r, c: str(r["info"].get("drain", {}).get("leaked_blocks", "-"))),
        ]
    return rows


def _summary_table(modes: dict[str, Any], comparison: dict[str, Any], deferred: bool, continuous: bool,
                   groups: list | None = None):
    from rich.table import Table

    cells = [[label, *[fn(m, r, comparison.get(m, {})) for m, r in modes.items()]]
             for label, fn in _summary_rows(modes, comparison, deferred, continuous, groups)]
    # Cells wrap between words when the console is narrow, never inside one: each
    # column is at least as wide as its longest word, so no value is cut to "1409…".
    s = Table(title="per mode, all rounds (terms: docs/replay.md, \"What is measured\")", title_justify="left")
    s.add_column("", overflow="fold", min_width=min(12, _longest_word(x[0] for x in cells)))
    for k, m in enumerate(modes, start=1):
        s.add_column(_mode_head(m), justify="right", overflow="fold",
                     min_width=_longest_word([x[k] for x in cells] + m.replace("+", " +").split()))
    for x in cells:
        s.add_row(*x)
    return s


def render_tables(report: dict[str, Any], console, per_round: bool = True) -> None:
    """Print to ``console`` the run's header, the per-mode summary and, with ``per_round``,
    the per-round tables (one column per mode) before it (``replay --tables``)."""
    modes = {m: r for m, r in report["modes"].items() if "rounds" in r}
    for m, r in report["modes"].items():
        if "skipped" in r:
            console.print(f"[bold red]{m}: skipped[/] - {r['skipped']}")
    if not modes:
        return
    wl, cfg = report["workload"], report["config"]
    n = max(len(r["rounds"]) for r in modes.values())
    warm = int(wl.get("params", {}).get("warmup", 0) or 0)
    deferred = any(x["deferred_frees"] for r in modes.values() for x in r["rounds"])
    console.print(
        f"[bold]{wl['name']}[/]: {wl['description']}\n"
        f"{group_report.pool_text(cfg)}, max_model_len {cfg['max_model_len']}, seed {cfg['seed']}, "
        f"vLLM {cfg.get('vllm_version')}"
    )
    group_report.render(report, modes, console)
    if per_round:
        _render_rounds(wl, modes, console, n, warm, deferred)
    groups = (report.get("config", {}).get("kv_cache_geometry") or {}).get("groups")
    console.print(_summary_table(modes, report.get("comparison", {}), deferred, bool(wl.get("continuous")),
                                 groups))
    if not per_round:
        console.print("per-round tables: --tables; every figure per round: the JSON", highlight=False)


def _render_rounds(wl: dict[str, Any], modes: dict[str, Any], console, n: int, warm: int,
                   deferred: bool) -> None:
    """The per-round tables of :func:`render_tables` (``wl``: the report's workload)."""
    from rich.markup import escape

    console.print(*_per_round(
        modes, n, warm, console.width,
        escape("block-table contiguity: fraction of adjacent logical blocks with id[i+1] == id[i]+1"),
        [("prompt", "contiguity", "{:.3f}"), ("whole table", "table_contiguity", "{:.3f}")],
    ))
    cols = [
        ("mean run", "mean_run_length", "{:.1f}"),
        ("descending", "prompt_descending", "{:.3f}"),
        ("sched us/step", "sched_cpu_s_per_step", _us),
    ]
    if deferred:
        cols.append(("drain us/step", "drain_cpu_s_per_step", lambda v: "-" if v is None else f"{v * 1e6:.2f}"))
    console.print(*_per_round(modes, n, warm, console.width,
                              "runs (blocks), descending pairs, scheduler CPU per step", cols))
    if any("prompt_descriptors_total" in x for r in modes.values() for x in r["rounds"]):
        cols = [("descriptors median", "prompt_descriptors_median", _count),
                ("sorted median", "prompt_descriptors_sorted_median", _count),
                ("descriptors p90", "prompt_descriptors_p90", _count),
                ("descriptors max", "prompt_descriptors_max", _count)]
        if any(x.get("offload_copies_total") is not None for r in modes.values() for x in r["rounds"]):
            cols += [("copies/step p90", "offload_copies_per_step_p90", _count),
                     ("copies/step max", "offload_copies_per_step_max", _count)]
        console.print(*_per_round(
            modes, n, warm, console.width,
            "KV transfer: descriptors per prompt (runs of id+1, what NIXL posts; vLLM PR #55841; "
            "sorted: the same blocks in ascending order, the fewest any placement can post), "
            "offloading copies per step (PR #35990)", cols))
    if any("pd_descriptors_total" in x for r in modes.values() for x in r["rounds"]):
        console.print(*_per_round(
            modes, n, warm, console.width,
            "P/D: descriptors per prompt moved prefill side -> decode side (runs where both ascend by 1), "
            "and the prefill side's own", [("P/D median", "pd_descriptors_median", _count),
                                           ("P/D total", "pd_descriptors_total", _count),
                                           ("prefill total", "prefill_prompt_descriptors_total", _count)]))
    if any(x.get("nixl_descriptors_total") is not None for r in modes.values() for x in r["rounds"]):
        console.print(*_per_round(
            modes, n, warm, console.width,
            "P/D through the real NIXL (every KV region; posting and completion in microseconds, "
            "UCX over loopback TCP, not RDMA)",
            [("NIXL desc. median", "nixl_descriptors_median", _count),
             ("NIXL desc. p90", "nixl_descriptors_p90", _count),
             ("NIXL desc. total", "nixl_descriptors_total", _count),
             ("post us median", "nixl_post_us_median", _count),
             ("post us total", "nixl_post_us_total", _count),
             ("xfer us median", "nixl_xfer_us_median", _count)]))
    ref_mode = "vanilla" if "vanilla" in modes else next(iter(modes))
    console.print(_cache_table(modes, n, ref_mode))
    if wl.get("continuous"):
        console.print(_continuous_table(modes[ref_mode]["rounds"], ref_mode, wl.get("window_steps")))


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    """Write ``report`` (the ``--json`` layout of docs/replay.md) to ``path``, creating
    its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


#: Prompt contiguity at or above this in every round counts as "held" in the verdict.
HELD_CONTIGUITY = 0.99
#: A mode below HELD_CONTIGUITY has "collapsed" when its lowest round is at least this
#: much below its first; otherwise it stayed where it started ("no collapse").
DROP_CONTIGUITY = 0.01


def verdict(report: dict[str, Any]) -> list[str]:
    """One or two lines saying what the run showed: which modes' prompt-block contiguity
    collapsed (from what to what, from which round; 0-based, as the tables number
    rounds), which stayed below ``HELD_CONTIGUITY`` from the first round without falling
    by ``DROP_CONTIGUITY`` (their range) and which held (their minimum), then
    whether prefix-cache hits, evictions and preemptions were vanilla's and the
    scheduler CPU per step relative to vanilla's.

    Returns:
        ``list[str]`` of 1-2 plain-text lines (no markup); ``[]`` when no mode ran.
    """
    modes = {m: r for m, r in report["modes"].items() if "rounds" in r}
    if not modes:
        return []
    cmp_ = report.get("comparison", {})
    held: list[str] = []
    collapsed: dict[str, list[str]] = {}
    stayed: dict[str, list[str]] = {}
    for m, r in modes.items():
        series = [(x["round"], x["contiguity"]) for x in r["rounds"] if x.get("contiguity") is not None]
        if not series:
            continue
        low = min(c for _, c in series)
        if low >= HELD_CONTIGUITY:
            held.append(f"{m} (min {low:.3f})")
            continue
        if series[0][1] - low < DROP_CONTIGUITY:
            # below HELD_CONTIGUITY from the first round without falling (a pool that
            # never wrapped in a short run, a workload whose prompts start mid-block)
            stayed.setdefault(f"{low:.3f}-{max(c for _, c in series):.3f}", []).append(m)
            continue
        first_low = next(i for i, c in series if c < HELD_CONTIGUITY)
        what = (f"{series[0][1]:.3f} -> {low:.3f}, below {HELD_CONTIGUITY} from round {first_low} "
                f"of {len(r['rounds'])}")
        collapsed.setdefault(what, []).append(m)
    # "kvpool" is kvpool's default policy: vLLM's allocation order, by design.
    parts = [f"collapsed: {', '.join('kvpool (vLLM order, by design)' if m == 'kvpool' else m for m in ms)} "
             f"(prompt contiguity {what})" for what, ms in collapsed.items()]
    parts += [f"no collapse: {', '.join(ms)} (prompt contiguity {span} in every round, below "
              f"{HELD_CONTIGUITY} from the first; did the pool wrap?)" for span, ms in stayed.items()]
    if held:
        n = max(len(r["rounds"]) for r in modes.values())
        parts.append(f"held: {', '.join(held)} over {n} rounds")
    lines = ["verdict: " + "; ".join(parts) + "."] if parts else []
    same, differ, ratios = [], [], []
    for m, c in cmp_.items():
        if m not in modes or c.get("rounds_compared") is None:
            continue
        k, n = c.get("rounds_cache_equal_to_vanilla"), c["rounds_compared"]
        (same if k == n else differ).append(m if k == n else f"{m} {k}/{n} rounds")
        if c.get("sched_cpu_ratio_vs_vanilla"):
            ratios.append(c["sched_cpu_ratio_vs_vanilla"])
    second = []
    if same:
        second.append(f"hits/evictions/preemptions = vanilla's in every round for {', '.join(same)}")
    if differ:
        second.append(f"differ from vanilla's: {', '.join(differ)}")
    if ratios:
        span = f"{min(ratios):.2f}x" if f"{min(ratios):.2f}" == f"{max(ratios):.2f}" else \
            f"{min(ratios):.2f}-{max(ratios):.2f}x"
        second.append(f"scheduler CPU per step {span} vanilla's")
    if second:
        lines.append("         " + "; ".join(second) + ".")
    return lines + free_order.summary_lines(cmp_)
