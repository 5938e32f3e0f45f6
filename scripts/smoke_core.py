"""A quick check of an installed kvpool extension on any architecture, without vLLM or torch.

Runs the free queue and the fenced deferred-free queue through a few thousand random
operations against a plain Python model of the same free list (a list of block ids) and
fails on the first difference. Used by ``scripts/test-arch.sh`` under qemu, where vLLM's
import alone takes minutes; prints the machine, the module it loaded and one line of counts.

    python scripts/smoke_core.py [--ops N] [--seed S]
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=int, default=3000)
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--blocks", type=int, default=512)
    args = p.parse_args(argv)

    from kvpool import _core
    from kvpool.errors import KvpoolError

    t0 = time.perf_counter()
    rng = random.Random(args.seed)
    blocks = [_core.KVCacheBlock(i) for i in range(args.blocks)]
    queue = _core.FreeKVCacheBlockQueue(blocks)
    model = list(range(args.blocks))  # the free list, head first
    held: list = []
    counts = {"popleft_n": 0, "append_n": 0, "prepend_n": 0, "remove": 0, "rebuild": 0}

    def check(where: str) -> None:
        got = queue.free_block_ids()
        if got != model or queue.num_free_blocks != len(model):
            raise SystemExit(f"smoke: free list differs from the model after {where}: "
                             f"{got[:8]}... vs {model[:8]}... ({len(got)} vs {len(model)})")

    for step in range(args.ops):
        op = rng.random()
        if op < 0.35 and model:
            n = rng.randint(1, min(64, len(model)))
            got = queue.popleft_n(n)
            want, model[:] = model[:n], model[n:]
            if [b.block_id for b in got] != want:
                raise SystemExit(f"smoke: popleft_n({n}) gave {[b.block_id for b in got][:8]}, want {want[:8]}")
            held.extend(got)
            counts["popleft_n"] += 1
        elif op < 0.6 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            back, held[:] = held[:k], held[k:]
            queue.append_n(back)
            model.extend(b.block_id for b in back)
            counts["append_n"] += 1
        elif op < 0.8 and held:
            k = rng.randint(1, len(held))
            back, held[:] = held[:k], held[k:]
            queue.prepend_n(back)
            model[:0] = [b.block_id for b in back]
            counts["prepend_n"] += 1
        elif op < 0.95 and model:
            bid = rng.choice(model)
            queue.remove(blocks[bid])
            model.remove(bid)
            held.append(blocks[bid])
            counts["remove"] += 1
        elif not held:
            queue.rebuild_canonical()
            model.sort()
            counts["rebuild"] += 1
        if step % 50 == 0:
            check(f"operation {step}")
            queue.check_invariants()
    check("the last operation")

    # Fenced deferred frees: entries drain in fence order and only once their fence is met.
    dq = _core.FencedDeferredFreeQueue()
    dq.push(3, [blocks[1], blocks[2]])
    dq.push(5, [blocks[3]])
    if dq.drain(2) != [] or len(dq) != 2:
        raise SystemExit("smoke: deferred queue drained an entry before its fence")
    if [[b.block_id for b in e] for e in dq.drain(4)] != [[1, 2]] or len(dq) != 1:
        raise SystemExit("smoke: deferred queue did not drain exactly the first entry")

    # A refused operation leaves the queue as it was.
    before = queue.free_block_ids()
    if model:
        try:
            queue.append(blocks[model[0]])  # already free
        except KvpoolError:
            pass
        else:
            raise SystemExit("smoke: appending a free block was not refused")
    if queue.free_block_ids() != before:
        raise SystemExit("smoke: a refused append changed the free list")

    print(f"smoke: kvpool core OK on {platform.machine()} (CPython {platform.python_version()}), "
          f"{_core.__file__}: {args.ops} operations {counts}, {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
