"""Rendering of a replay report: rich tables on the terminal, a matplotlib PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Line colours per mode, shared by the table header and the plot.
MODE_STYLE = {"vanilla": "tab:red", "kvpool": "tab:orange", "kvpool+reorder": "tab:green"}
_RICH = {"vanilla": "red", "kvpool": "yellow", "kvpool+reorder": "green"}


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.1f}"


def render_tables(report: dict[str, Any], console) -> None:
    from rich.table import Table

    modes = {m: r for m, r in report["modes"].items() if "rounds" in r}
    for m, r in report["modes"].items():
        if "skipped" in r:
            console.print(f"[bold red]{m}: skipped[/] - {r['skipped']}")
    if not modes:
        return
    wl = report["workload"]
    cfg = report["config"]
    title = (
        f"{wl['name']}: {wl['description']}\n"
        f"pool {cfg['num_blocks']} blocks x {cfg['block_size']} tokens, "
        f"max_model_len {cfg['max_model_len']}, seed {cfg['seed']}"
    )
    t = Table(title=title, title_justify="left")
    t.add_column("round", justify="right")
    for label in ("contiguity", "table contig.", "mean run"):
        for m in modes:
            t.add_column(f"{label}\n[{_RICH.get(m, 'white')}]{m}[/]", justify="right")
    for m in modes:
        t.add_column(f"sched us/step\n[{_RICH.get(m, 'white')}]{m}[/]", justify="right")
    n = max(len(r["rounds"]) for r in modes.values())
    warm = int(wl.get("params", {}).get("warmup", 0) or 0)
    for i in range(n):
        row = [f"{i}{' (warmup)' if i < warm else ''}"]
        for key, fmt in (("contiguity", "{:.3f}"), ("table_contiguity", "{:.3f}"), ("mean_run_length", "{:.1f}")):
            for r in modes.values():
                rr = r["rounds"][i] if i < len(r["rounds"]) else {}
                row.append(_f(rr.get(key), fmt))
        for r in modes.values():
            rr = r["rounds"][i] if i < len(r["rounds"]) else {}
            row.append(_us(rr.get("sched_cpu_s_per_step")))
        t.add_row(*row)
    console.print(t)

    s = Table(title="per mode (all rounds)", title_justify="left")
    for col in (
        "mode",
        "steps",
        "sched us/step",
        "vs vanilla",
        "drain us/step",
        "drain vs vanilla",
        "deferred frees",
        "min contig.",
        "max block id",
        "preempt.",
        "leaked",
        "tables == vanilla",
        "reorder us",
        "wall s",
    ):
        s.add_column(col, justify="right" if col != "mode" else "left")
    cmp_ = report.get("comparison", {})
    for m, r in modes.items():
        rounds = r["rounds"]
        c = cmp_.get(m, {})
        reorder = [x["reorder_cpu_s"] for x in rounds if "reorder_cpu_s" in x]
        ident = c.get("rounds_identical_to_vanilla")
        s.add_row(
            f"[{_RICH.get(m, 'white')}]{m}[/]",
            str(sum(x["num_steps"] for x in rounds)),
            _us(c.get("sched_cpu_s_per_step")),
            _f(c.get("sched_cpu_ratio_vs_vanilla"), "{:.2f}x"),
            _us(c.get("drain_cpu_s_per_step")),
            _f(c.get("drain_cpu_ratio_vs_vanilla"), "{:.2f}x"),
            str(sum(x["deferred_frees"] for x in rounds)),
            _f(c.get("min_contiguity")),
            str(max(x["max_block_id"] for x in rounds)),
            str(sum(x["preemptions"] for x in rounds)),
            str(c.get("max_leaked_blocks", 0)),
            "-" if ident is None else f"{ident}/{len(rounds)}",
            _us(sum(reorder) / len(reorder)) if reorder else "-",
            f"{r['info']['wall_s']:.1f}",
        )
    console.print(s)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Write a PNG: prompt and whole-table contiguity per round, and scheduler CPU per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = {m: r for m, r in report["modes"].items() if "rounds" in r}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for m, r in modes.items():
        color = MODE_STYLE.get(m)
        xs = [x["round"] for x in r["rounds"]]
        ax1.plot(xs, [x["contiguity"] for x in r["rounds"]], "o-", color=color, label=f"{m}: prompt blocks", lw=2)
        ax1.plot(
            xs, [x["table_contiguity"] for x in r["rounds"]], "s--", color=color, alpha=0.6,
            label=f"{m}: whole table at finish", lw=1,
        )
        ax2.plot(xs, [x["sched_cpu_s_per_step"] * 1e6 for x in r["rounds"]], "o-", color=color, label=m)
    wl, cfg = report["workload"], report["config"]
    ax1.set_title(
        f"{wl['name']}: block-table contiguity per round\n"
        f"({cfg['num_blocks']} blocks x {cfg['block_size']} tokens, vLLM {cfg.get('vllm_version')})",
        fontsize=10,
    )
    ax1.set_xlabel("round")
    ax1.set_ylabel("fraction of adjacent blocks with id[i+1] == id[i] + 1")
    ax1.set_ylim(-0.03, 1.05)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="lower left")
    ax2.set_title("scheduler CPU per step (schedule + update_from_output)", fontsize=10)
    ax2.set_xlabel("round")
    ax2.set_ylabel("microseconds")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
