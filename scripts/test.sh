#!/usr/bin/env bash
# Everything CI runs, from a fresh clone: .venv + build, kvpool's tests, the
# benchmarks (vLLM/kvpool ratios of the same run checked against the targets in
# benchmarks/ratios.py; never an absolute time), and the conformance run of vLLM's
# own test suite with and without kvpool (fails on any regression).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/bootstrap.sh"
cd "$here"
export VLLM_TARGET_DEVICE=cpu
mkdir -p .ci-out
py=.venv/bin/python

echo "== kvpool tests"
"$py" -m pytest tests -q -p no:cacheprovider

echo "== benchmarks (vLLM 0.33.0 vs kvpool, same run)"
"$py" -m pytest benchmarks -q -p no:cacheprovider --benchmark-only \
  --benchmark-json=.ci-out/benchmarks.json --benchmark-columns=median,iqr,rounds

ratios=0
"$py" benchmarks/check_ratios.py .ci-out/benchmarks.json || ratios=$?

echo "== conformance: vLLM's own tests, vanilla vs kvpool"
"$py" -m kvpool conformance --json .ci-out/conformance.json

if [ "$ratios" -ne 0 ]; then
  echo "benchmark ratios below their targets (see above)" >&2
  exit 1
fi
