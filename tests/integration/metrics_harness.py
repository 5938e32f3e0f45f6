"""Engine core -> frontend -> ``/metrics`` for kvpool's pool metrics, without a model.

Run as a script by tests/integration/test_metrics.py (a fresh process: msgspec caches a type's
layout when its first decoder is built, as in a real API server, where kvpool's plugin
installs before that). Prints one JSON object:

- ``snapshot``: what ``Scheduler.make_stats()`` attached in the engine core;
- ``decoded``: the same after vLLM's ``MsgpackEncoder`` / ``MsgpackDecoder(EngineCoreOutputs)``;
- ``reference``: free runs recomputed here from the pool's free list;
- ``exposition``: ``prometheus_client.generate_latest()`` after vLLM's
  ``StatLoggerManager.record()`` was given the decoded stats (what ``/metrics`` serves);
- ``after_uninstall``: whether vLLM's classes are back.

Usage: ``python tests/integration/metrics_harness.py {kvpool|fake} [--contiguous]``. ``kvpool``:
``kvpool.install()`` (``kvpool.patches.metrics`` applied by it when listed in ``PATCH_MODULES``,
else here). ``fake``: vLLM's own pool, given a ``fragmentation_stats`` computed in
Python, and only ``kvpool.patches.metrics.apply`` (needs no native build).
"""

from __future__ import annotations

import json
import os
import sys

from kvpool.cpu_platform import cpu_environment

cpu_environment(os.environ)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# One read at the first step, then none until the harness's own make_stats() (which
# clears the deadline): that read's table window covers the whole round.
os.environ["KVPOOL_METRICS_INTERVAL_S"] = "3600"


def free_runs(ids: list[int]) -> tuple[int, int]:
    """(maximal runs of consecutive ids, longest run) of a set of block ids."""
    ids = sorted(ids)
    runs = longest = cur = 0
    prev = None
    for b in ids:
        cur = cur + 1 if prev is not None and b == prev + 1 else 1
        runs += cur == 1
        longest = max(longest, cur)
        prev = b
    return runs, longest


def fake_fragmentation_stats(pool):
    def fragmentation_stats(reset: bool = True) -> dict[str, float]:
        ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        runs, longest = free_runs(ids)
        return {"free_blocks": len(ids), "free_runs": runs, "largest_free_run": longest,
                "table_pairs": 10, "table_contiguity": 0.7, "descending_fraction": 0.2,
                "mean_run_length": 3.5, "table_descriptors": 7, "tables_freed": 4,
                "mean_descriptors_per_table": 1.75}
    return fragmentation_stats


def scrape_vllm_metrics_route() -> dict[str, object]:
    """GET ``/metrics`` from vLLM's own metrics route (``attach_router`` of
    ``vllm.entrypoints.serve.instrumentator.metrics``, what ``vllm serve`` mounts) served
    by uvicorn on 127.0.0.1 in a thread. Returns ``{"status", "content_type", "body"}``
    or ``{"error"}`` when the route cannot be built here."""
    import socket
    import threading
    import time

    try:
        import httpx
        import uvicorn
        from fastapi import FastAPI
    except ImportError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    app = FastAPI()
    try:
        from vllm.entrypoints.serve.instrumentator.metrics import attach_router

        attach_router(app)
        route = "vllm.entrypoints.serve.instrumentator.metrics.attach_router"
    except ImportError as e:
        # The .venv installs vLLM without its dependency tree; the route's /metrics
        # part is this Mount (the instrumentator only adds HTTP request metrics).
        from prometheus_client import make_asgi_app
        from starlette.routing import Mount
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        app.routes.append(Mount("/metrics", make_asgi_app(registry=get_prometheus_registry())))
        route = f"Mount('/metrics', make_asgi_app(get_prometheus_registry())) ({e})"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.get(f"http://127.0.0.1:{port}/metrics/", timeout=10)
        return {"route": route, "status": r.status_code, "content_type": r.headers.get("content-type"),
                "body": r.text}
    finally:
        server.should_exit = True
        thread.join(10)


def main() -> int:
    kind = sys.argv[1]
    contiguous = "--contiguous" in sys.argv
    from kvpool.tools.hf_offline import offline_hf_cache
    from kvpool.tools.replay import workloads

    wl = workloads.grpo(rounds=1, prompts_per_round=2, samples_per_prompt=2,
                        prompt_len=(300, 500), output_len=(20, 40))
    with offline_hf_cache([wl.engine.model]):
        from kvpool import patching
        from kvpool.tools.replay import engine, loop, probe

        state = None
        if kind == "kvpool":
            import kvpool

            kvpool.install(**({"allocation": "contiguous"} if contiguous else {}))
            if "kvpool.patches.metrics" not in patching.PATCH_MODULES:
                from kvpool.patches import metrics

                metrics.apply(patching.Patcher(patching._state))
        else:
            from kvpool.patches import metrics

            state = patching._InstallState(vllm_version="harness", vanilla={})
            metrics.apply(patching.Patcher(state))

        pool_spec = engine.PoolSpec(num_blocks=256, block_size=16)
        scheduler = engine.build_scheduler(wl, pool_spec, log_stats=True)
        pool = scheduler.kv_cache_manager.block_pool
        if kind == "fake":
            pool.fragmentation_stats = fake_fragmentation_stats(pool)
        loop.run_round(scheduler, probe.RoundProbe(scheduler), wl, 0, 0, pool_spec)

        from prometheus_client import REGISTRY, generate_latest
        from vllm.v1.engine import EngineCoreOutputs
        from vllm.v1.metrics.loggers import StatLoggerManager
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        from kvpool.patches.metrics import STATS_FIELD

        scheduler.__dict__.pop("_kvpool_metrics_due", None)
        stats = scheduler.make_stats()
        snapshot = getattr(stats, STATS_FIELD, None)
        frames = MsgpackEncoder().encode(EngineCoreOutputs(engine_index=0, scheduler_stats=stats))
        decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames).scheduler_stats
        ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        manager = StatLoggerManager(scheduler.vllm_config, engine_idxs=[0], enable_default_loggers=False)
        manager.record(scheduler_stats=decoded, iteration_stats=None, engine_idx=0)
        exposition = generate_latest(REGISTRY).decode()
        scraped = scrape_vllm_metrics_route()

        if kind == "kvpool":
            import kvpool

            kvpool.uninstall()
        else:
            patching._undo(state)
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.metrics.loggers import PrometheusStatLogger
        from vllm.v1.metrics.stats import SchedulerStats

        after = {
            "field_gone": STATS_FIELD not in SchedulerStats.__dataclass_fields__,
            "make_stats_vanilla": not hasattr(Scheduler.make_stats, "__wrapped__"),
            "prom_vanilla": not hasattr(PrometheusStatLogger.record, "__wrapped__"),
        }
    print(json.dumps({
        "pool_class": f"{type(pool).__module__}.{type(pool).__qualname__}",
        "allocation": getattr(pool, "allocation", None),
        "model_name": scheduler.vllm_config.model_config.served_model_name,
        "snapshot": snapshot,
        "decoded": getattr(decoded, STATS_FIELD, None),
        "reference": dict(zip(("free_runs", "largest_free_run"), free_runs(ids)), free_blocks=len(ids)),
        "exposition": exposition,
        "scraped": scraped,
        "after_uninstall": after,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
