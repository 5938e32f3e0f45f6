#!/usr/bin/env bash
# Create .venv at the repo root with vLLM 0.34.0, the newest release kvpool supports (no CUDA dependency tree), plus the
# packages vllm.v1.core and the scheduler import on a CPU machine, then build kvpool
# into it. Idempotent: a second run only rebuilds kvpool.
#
# Another vLLM release of the matrix (kvpool.vllm_compat.SUPPORTED_VLLM_VERSIONS) goes
# into its own environment beside .venv; `python -m kvpool conformance --vllm-version X`
# runs this for it:
#   KVPOOL_VLLM_VERSION=0.31.0 KVPOOL_VENV=.venv-vllm-0.31.0 bash scripts/bootstrap.sh
# KVPOOL_WHEEL=wheelhouse/kvpool-....whl installs that wheel (--no-index) instead of the
# editable build; PYTHON picks the interpreter of a new environment.
# requirements/vllm-X.txt holds that release's own pins (constraints on the lists below).
#
# Why --no-deps for vLLM: the wheel's full dependency set pulls a CUDA torch and
# several GB of GPU libraries. The block pool and scheduler need only the small set
# below (see docs/development.md). On a GPU host, install kvpool into the vLLM that
# is already there instead (`pip install .`): it needs neither torch nor vLLM to build.
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
use_cpu_platform
PY="${PYTHON:-python3}"
VLLM_VERSION="${KVPOOL_VLLM_VERSION:-0.34.0}"
TORCH_VERSION="${KVPOOL_TORCH_VERSION:-2.13.0}"
VENV="${KVPOOL_VENV:-.venv}"
PINS="requirements/vllm-$VLLM_VERSION.txt"
if [ ! -f "$PINS" ]; then
  echo "bootstrap: no $PINS: vLLM $VLLM_VERSION is not in kvpool's matrix" >&2
  exit 2
fi

# One line per step, with the time since the start, so the first run (about 2-5 minutes
# on 2 cores, depending on load) is never silent.
started=$SECONDS
step() { printf 'bootstrap [%d:%02d] %s\n' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)) "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV with $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  "$PY" -m venv "$VENV"
fi
VPY="$(cd "$VENV" && pwd)/bin/python"
# pip, without the resolver's complaint that vLLM's CUDA-only requirements are
# missing (they are left out on purpose, see above) and find-links noise.
pip() {
  "$VPY" -m pip --disable-pip-version-check "$@" 2>&1 \
    | grep -v -E "requires .*which is not installed|but you have .* which is incompatible|dependency resolver does not currently|WARNING: Location '" || true
  return "${PIPESTATUS[0]}"
}

# Re-run the dependency step when the requirement lists change, not only on a new venv.
req_hash="$(cat requirements/dev.txt requirements/vllm-cpu-runtime.txt requirements/nixl.txt "$PINS" | sha1sum | cut -c1-12)"
stamp="$VENV/.kvpool-deps-$VLLM_VERSION-$req_hash"
if [ ! -f "$stamp" ]; then
  step "upgrading pip"
  pip install -q --upgrade pip
  # torch: on the CI-class machine this resolves to the CPU wheel that lies on disk.
  step "installing torch $TORCH_VERSION (the CPU wheel)"
  pip install -q "torch==$TORCH_VERSION"
  step "installing vLLM $VLLM_VERSION without its CUDA dependency tree"
  pip install -q --no-deps "vllm==$VLLM_VERSION"
  step "installing the packages vLLM's scheduler imports on CPU (requirements/vllm-cpu-runtime.txt)"
  pip install -q -r requirements/vllm-cpu-runtime.txt -c "$PINS"
  # xgrammar depends on triton (about 1 GB); the scheduler only imports xgrammar.
  step "installing xgrammar without triton"
  pip install -q --no-deps "$(grep -E '^xgrammar==' "$PINS")"
  step "installing the test and benchmark tools (requirements/dev.txt)"
  pip install -q -r requirements/dev.txt -c "$PINS"
  # NIXL for `replay --nixl`, without the CUDA torch plain `pip install nixl` pulls.
  step "installing NIXL's slim set (requirements/nixl.txt)"
  pip install -q --no-deps -r requirements/nixl.txt
  touch "$stamp"
else
  step "dependencies of $VENV up to date (vLLM $VLLM_VERSION)"
fi

if [ -n "${KVPOOL_WHEEL:-}" ]; then
  # A built wheel (scripts/build-wheel.sh), as a user installs it: no compiler, no index.
  step "installing $KVPOOL_WHEEL"
  pip install -q --no-index --no-deps --force-reinstall "$KVPOOL_WHEEL"
else
  # kvpool itself: build isolation off so the already installed Cython/scikit-build-core
  # are used and a rebuild takes seconds.
  step "installing kvpool's build tools (scikit-build-core, Cython, CMake, Ninja)"
  pip install -q "scikit-build-core>=0.10" "cython>=3.0" ninja cmake
  # Each environment builds in its own folder, so environments can be rebuilt side by side.
  build_dir="build/{wheel_tag}"
  [ "$VENV" = ".venv" ] || build_dir="build/$(basename "$VENV")/{wheel_tag}"
  step "building kvpool into $VENV (editable: C++ and Cython)"
  pip install -q --no-build-isolation --no-deps --config-settings=build-dir="$build_dir" -e .
fi
step "$("$VPY" -c 'import kvpool, kvpool._core, vllm; print("'"$VENV"' ready: vLLM", vllm.__version__, "kvpool", kvpool.__version__)')"
