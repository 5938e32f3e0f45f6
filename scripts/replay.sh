#!/usr/bin/env bash
# The main job: replay a workload through vLLM 0.34.0's real scheduler, vanilla vs
# kvpool vs kvpool+reorder side by side. Creates .venv first if needed.
# Arguments go to `python -m kvpool replay` (default: the RFC's GRPO workload).
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bash scripts/bootstrap.sh
use_cpu_platform
exec .venv/bin/python -m kvpool replay "$@"
