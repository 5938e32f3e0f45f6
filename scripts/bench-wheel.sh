#!/usr/bin/env bash
# The benchmark suite against kvpool as users install it: the x86_64 wheel
# (scripts/build-wheel.sh: Zig's clang, libc++ linked in) installed --no-index into a
# fresh environment (.venv-wheel), beside the source build in .venv (scripts/bootstrap.sh:
# the host's GCC, editable), measured alternately on the same machine:
#
#   bash scripts/bench-wheel.sh [ROUNDS] [BENCHMARK FILES / pytest args]
#       ROUNDS: default 3: source, wheel, source, wheel, ...; files: default benchmarks/
#       (e.g. `bash scripts/bench-wheel.sh 10 benchmarks/test_block_pool_bench.py`: the
#       native pool operations, 40 s a run, where the compiler shows most)
#
# Writes .ci-out/bench-{source,wheel}-N.json and prints both builds' ratios side by side
# (benchmarks/compare_builds.py; exit 1 if, in a targeted group, the median over the
# rounds of the wheel's ratio / the same round's source ratio is below 0.90).
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
rounds="${1:-3}"
shift || true
selection=("$@"); [ ${#selection[@]} -gt 0 ] || selection=(benchmarks)
py="${PYTHON:-python3}"
bash scripts/bootstrap.sh
tag="$(.venv/bin/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
KVPOOL_WHEEL_ARCHS=x86_64 bash scripts/build-wheel.sh "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')"
wheel="$(ls -t wheelhouse/kvpool-*-"$tag"-"$tag"-*manylinux_2_28_x86_64.whl | head -1)"
KVPOOL_VENV=.venv-wheel KVPOOL_WHEEL="$wheel" bash scripts/bootstrap.sh
use_cpu_platform
mkdir -p .ci-out
for venv in .venv .venv-wheel; do
  "$venv/bin/python" -c 'import kvpool._core as c, sys; print(sys.argv[1], "->", c.__file__)' "$venv"
done
a=(); b=()
for i in $(seq 1 "$rounds"); do
  for build in source wheel; do
    venv=.venv; [ "$build" = wheel ] && venv=.venv-wheel
    out=".ci-out/bench-$build-$i.json"
    echo "== round $i: $build ($venv), load $(cut -d' ' -f1-3 /proc/loadavg)"
    "$venv/bin/python" -m pytest "${selection[@]}" -q -p no:cacheprovider --benchmark-only \
      --benchmark-json="$out" --benchmark-columns=median,iqr,rounds >/dev/null
    if [ "$build" = source ]; then a+=("$out"); else b+=("$out"); fi
  done
done
.venv/bin/python benchmarks/compare_builds.py --a source "${a[@]}" --b wheel "${b[@]}"
