"""The replay's figure (``--plot``): contiguity, scheduler CPU, transfer descriptors and,
with ``--nixl``, NIXL's posting time per transferred prompt, per round (window)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpool.tools.replay import group_report

#: Plot styles. Any two modes may draw the same curve (vanilla / kvpool: same allocation
#: order; kvpool+reorder / kvpool+contiguous: both at 1.0; any pair in the CPU panel), so
#: every mode has its own line style and marker and the widths fall strictly with the
#: drawing order: whichever two coincide, the upper line is the thinner and both show.
_PLOT = {
    "kvpool+reorder": {"color": "tab:green", "lw": 8, "alpha": 0.35, "ls": "-", "marker": "s", "ms": 11,
                       "zorder": 1},
    "vanilla": {"color": "tab:red", "lw": 5, "alpha": 0.5, "ls": "-", "marker": "o", "ms": 8, "zorder": 2},
    "kvpool+contiguous": {"color": "tab:blue", "lw": 2.5, "alpha": 0.9, "ls": ":", "marker": "^", "ms": 6,
                          "zorder": 3},
    "kvpool": {"color": "tab:orange", "lw": 1.2, "alpha": 1.0, "ls": "--", "marker": "x", "ms": 6, "zorder": 4},
}


def first_wrap_round(rounds: list[dict[str, Any]], num_blocks: int) -> int | None:
    """First round whose tables used the pool's highest block id: from then on the
    allocator hands out blocks that earlier rounds freed."""
    return next((x["round"] for x in rounds if x["max_block_id"] >= num_blocks - 1), None)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Write a PNG: prompt contiguity, whole-table contiguity, scheduler CPU and transfer
    descriptors per prompt, per round."""
    import matplotlib.pyplot as plt

    fig = figure(report)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _series(ax, modes: dict[str, Any], value) -> None:
    """One curve per mode: ``value(round dict)`` (None: a gap) over the rounds."""
    for m, r in modes.items():
        ys = [value(x) for x in r["rounds"]]
        ax.plot([x["round"] for x in r["rounds"]], [float("nan") if y is None else y for y in ys], label=m,
                **_PLOT.get(m, {}))


def _post_per_prompt(x: dict[str, Any]) -> float | None:
    if x.get("nixl_post_us_total") is None or not x.get("prompts"):
        return None
    return x["nixl_post_us_total"] / x["prompts"]


def figure(report: dict[str, Any]):
    """The matplotlib ``Figure`` :func:`plot` writes: three panels over the rounds (a
    fourth, transfer descriptors per prompt, when the report has them; a fifth, NIXL's
    posting time per transferred prompt, with ``--nixl``), one legend below them (never
    over a curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    modes = {m: r for m, r in report["modes"].items() if "rounds" in r}
    wl, cfg = report["workload"], report["config"]
    cmp_ = report.get("comparison", {})
    transfer = any(x.get("prompt_descriptors_median") is not None for r in modes.values() for x in r["rounds"])
    nixl = transfer and any(_post_per_prompt(x) is not None for r in modes.values() for x in r["rounds"])
    ncols = 3 + transfer + nixl
    fig, axes = plt.subplots(1, ncols, figsize=(5.3 * ncols, 5.4))
    panels = (
        ("contiguity", "prompt blocks (after prefill)"),
        ("table_contiguity", "whole block table (at finish)"),
    )
    for ax, (key, what) in zip(axes, panels):
        _series(ax, modes, lambda x, key=key: x[key])
        ax.set_title(f"{what}: id[i+1] == id[i] + 1", fontsize=10)
        ax.set_ylabel("fraction of adjacent logical blocks")
        ax.set_ylim(-0.05, 1.08)
    base = modes.get("vanilla")
    wrap = None if base is None else first_wrap_round(base["rounds"], cfg["num_blocks"])
    if transfer:
        _series(axes[3], modes, lambda x: x.get("prompt_descriptors_median"))
        axes[3].set_title("KV transfer descriptors per prompt (median): runs of id+1", fontsize=10)
        axes[3].set_ylabel("descriptors (one per run), log scale")
        axes[3].set_yscale("log")
    if nixl:
        _series(axes[4], modes, _post_per_prompt)
        axes[4].set_title("NIXL posting time per transferred prompt (UCX, loopback)", fontsize=10)
        axes[4].set_ylabel("microseconds (postDuration / prompts), log scale")
        axes[4].set_yscale("log")
    if wrap is not None:
        for ax in (*axes[:2], *axes[3:]):
            ax.axvline(wrap, color="grey", ls=":", lw=1, label="_wrap")
    _series(axes[2], modes, lambda x: x["sched_cpu_s_per_step"] * 1e6)
    axes[2].set_title("scheduler CPU per step (schedule + update_from_output)", fontsize=10)
    axes[2].set_ylabel("microseconds")
    axes[2].set_ylim(bottom=0)
    for ax in axes:
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles, _ = axes[0].get_legend_handles_labels()
    labels = []
    for m, r in modes.items():
        c = cmp_.get(m, {})
        if c.get("rounds_identical_to_vanilla") == len(r["rounds"]):
            m += " (tables identical to vanilla)"
        elif c.get("rounds_cache_equal_to_vanilla") == len(r["rounds"]):
            m += " (hits/evictions/preemptions = vanilla)"
        labels.append(m)
    handles = handles[:len(labels)]
    if wrap is not None:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], color="grey", ls=":", lw=1))
        labels.append(f"round {wrap}: vanilla reaches the last block id (later allocations reuse freed blocks)")
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8, frameon=False)
    fig.suptitle(
        f"kvpool replay, workload {wl['name']}: {group_report.pool_text(cfg)}, "
        f"vLLM {cfg.get('vllm_version')}, seed {cfg['seed']}",
        fontsize=11,
    )
    rows = -(-len(labels) // min(3, len(labels))) if labels else 0
    fig.tight_layout(rect=(0, 0.05 * rows + 0.02, 1, 1))
    return fig
