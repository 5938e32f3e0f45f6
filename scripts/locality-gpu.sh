#!/usr/bin/env bash
# The GPU measurement of `python -m kvpool locality` in one command, from a copy of the
# working tree: no build, no install, no network. Needs python3 with torch (CUDA) and the
# Triton it ships with; vLLM, numpy and kvpool's C++ extension are not needed (kvpool is
# imported from python/). The replay tables it uses ship in
# python/kvpool/tools/locality/data/replay_grpo.json.
#
# Default run (H200-sized: 85,000 blocks x 32 tokens, 8 KV heads x 128, bf16, one layer;
# prefill 8 x 8192 and 1 x 1024, decode 256 x 4096; FlexAttention kernel, checked against
# the gather + SDPA reference first) takes about 3-5 minutes, most of it compiling one
# kernel per batch shape; the timeout keeps it under 8. Extra arguments go to the command.
# Then the transfer phase (python -m kvpool.tools.locality.transfer: the serving replay's prompt
# tables after the pool wraps, copied device -> pinned host one descriptor at a time,
# vanilla's tables against the contiguous policy's), under 4 more minutes.
#
#   bash scripts/locality-gpu.sh                 # JSON, table and PNG under $OUT (or /tmp/kvpool-locality)
#   bash scripts/locality-gpu.sh --layers 4      # any `python -m kvpool locality` flag
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PY=${PYTHON:-python3}
DEST=${OUT:-/tmp/kvpool-locality}
mkdir -p "$DEST"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
# Compiled kernels go to a local scratch directory, not the home directory.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/kvpool-locality-inductor}

"$PY" - <<'PYEOF'
import platform, sys
try:
    import torch
except ImportError:
    sys.exit("locality-gpu.sh: torch is not importable by this python")
if not torch.cuda.is_available():
    sys.exit("locality-gpu.sh: torch sees no CUDA device")
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "missing (FlexAttention needs it)"
print(f"python {platform.python_version()}, torch {torch.__version__}, triton {tv}, "
      f"{torch.cuda.get_device_name()}", flush=True)
PYEOF

plot=()
if "$PY" -c "import matplotlib" 2>/dev/null; then plot=(--plot "$DEST/locality-gpu.png"); fi
timeout --signal=INT 450 "$PY" -m kvpool locality --device cuda --kernel flex --check \
    --json "$DEST/locality-gpu.json" "${plot[@]}" "$@" 2>&1 | tee "$DEST/locality-gpu.txt"
rc=${PIPESTATUS[0]}
# The transfer phase: the serving replay's post-wrap prompt tables moved device -> pinned
# host, one copy per descriptor, per layer and K/V (about a minute; docs/locality.md).
timeout --signal=INT 240 "$PY" -m kvpool.tools.locality.transfer --device cuda \
    --json "$DEST/transfer-gpu.json" 2>&1 | tee "$DEST/transfer-gpu.txt"
trc=${PIPESTATUS[0]}
exit $(( rc != 0 ? rc : trc ))
