#!/usr/bin/env bash
# kvpool's suite on one CPython, from scratch, against kvpool installed from its wheel
# (scripts/build-wheel.sh; not editable, --no-index) next to vLLM 0.33.0:
#
#   bash scripts/test-python.sh 3.11        # the host's python3.11
#   bash scripts/test-python.sh 3.12        # python3.12 if the host has one, else pyenv's
#   bash scripts/test-python.sh 3.13        # python3.13 if the host has one, else Debian 13's
#   bash scripts/test-python.sh 3.14        # Debian sid's 3.14 (a chroot, see below)
#   bash scripts/test-python.sh 3.13 -k hot_paths        # further arguments go to pytest
#
# An interpreter the host lacks comes from Debian: `debootstrap` builds a minimal chroot
# of the release that ships it (CHROOT_SUITES below; about 5 minutes and 0.5 GB, kept in
# $KVPOOL_CHROOT_DIR for the next run), the checkout is bind-mounted into it at the same
# path, and this script runs again inside. KVPOOL_PY_ROUTE=chroot takes that route even
# when the host has the interpreter. torch for an interpreter other than the host's
# 3.11 is PyPI's CUDA build (about 6 GB with its CUDA libraries; it runs on the CPU).
# The environment lives in .venv-py<version> (the chroot's /opt/kvpool-venv).
#
# CPython 3.12 (what vLLM's own CUDA images run) is in no Debian release (bookworm has
# 3.11, trixie 3.13), so it comes from pyenv's installed versions instead (the machine
# image has 3.12.1; `pyenv install 3.12` on a machine without it), the interpreter
# scripts/build-wheel.sh --resolve picks. KVPOOL_PY_ROUTE=pyenv takes that route for
# any version.
#
# After kvpool's suite, vLLM 0.33.0's own tests (tests/v1/core and the block-pool KV
# connector tests) run vanilla vs kvpool against the installed wheel
# (`python -m kvpool conformance`; fails on any regression). KVPOOL_PY_CONFORMANCE=0
# skips them.
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ver="${1:?usage: scripts/test-python.sh 3.11|3.12|3.13|3.14 [pytest args]}"
shift
py="python$ver"
declare -A CHROOT_SUITES=([3.11]=bookworm [3.13]=trixie [3.14]=sid)

# (Runs it, rather than `command -v`: a pyenv shim exists for versions it cannot run.)
route="${KVPOOL_PY_ROUTE:-}"
if [ -z "$route" ] && [ -z "${KVPOOL_IN_CHROOT:-}" ] && ! "$py" -c pass 2>/dev/null; then
  if [ -n "${CHROOT_SUITES[$ver]:-}" ]; then route=chroot; else route=pyenv; fi
fi
if [ "$route" = pyenv ]; then
  # The same lookup the wheel build makes; an absolute path from here on.
  py="$(bash scripts/build-wheel.sh --resolve "$py")" || {
    echo "test-python: no CPython $ver: not on PATH, not among pyenv's versions, and no Debian release ships it (pyenv install $ver)" >&2
    exit 2
  }
  echo "test-python: CPython $ver from $py ($("$py" -c 'import sys; print(sys.version.split()[0])'))"
fi
if [ -z "${KVPOOL_IN_CHROOT:-}" ] && [ "$route" = chroot ]; then
  suite="${CHROOT_SUITES[$ver]:?no Debian release with CPython $ver known}"
  root="${KVPOOL_CHROOT_DIR:-/var/tmp/kvpool-chroots}/py$ver"
  if [ ! -x "$root/usr/bin/$py" ]; then
    command -v debootstrap >/dev/null || { apt-get update -qq; apt-get install -y -qq debootstrap >/dev/null; }
    rm -rf "$root"
    debootstrap --variant=minbase --include="$py,$py-venv,$py-dev,g++,make,ca-certificates" \
      "$suite" "$root" http://deb.debian.org/debian
  fi
  chroot_mount "$root"
  in_chroot "$root" KVPOOL_IN_CHROOT=1 KVPOOL_PY_VENV=/opt/kvpool-venv \
    KVPOOL_BUILD_SUFFIX="-$suite" bash "$here/scripts/test-python.sh" "$ver" "$@"
  exit
fi

venv="${KVPOOL_PY_VENV:-$here/.venv-py$ver}"
tag="cp${ver/./}"
# This machine's architecture only (scripts/test-arch.sh runs the aarch64 wheel).
KVPOOL_WHEEL_ARCHS="${KVPOOL_WHEEL_ARCHS:-$(uname -m)}" bash scripts/build-wheel.sh "$py"
wheel="$(ls -t wheelhouse/kvpool-*-"$tag"-"$tag"-*manylinux*"$(uname -m)".whl | head -1)"
KVPOOL_VENV="$venv" PYTHON="$py" KVPOOL_WHEEL="$wheel" bash scripts/bootstrap.sh
use_cpu_platform
# Outside the checkout's python/: the suite imports the installed wheel.
"$venv/bin/python" -c 'import kvpool, sys; assert "site-packages" in kvpool.__file__, kvpool.__file__; print("kvpool from", kvpool.__file__, "on", sys.version.split()[0])'
"$venv/bin/python" -m pytest tests -q -p no:cacheprovider "$@"
if [ "${KVPOOL_PY_CONFORMANCE:-1}" != 0 ]; then
  # vLLM's own tests, vanilla vs kvpool, kvpool the installed wheel (not the checkout).
  mkdir -p .ci-out
  (cd / && "$venv/bin/python" -m kvpool conformance --json "$here/.ci-out/conformance-py$ver.json")
fi
