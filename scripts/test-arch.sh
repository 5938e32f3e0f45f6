#!/usr/bin/env bash
# kvpool's aarch64 wheel (Grace: GH200, GB200, GB10) tested as installed, on an x86_64
# machine, under qemu-user:
#
#   bash scripts/test-arch.sh aarch64 --smoke        # minutes: see below
#   bash scripts/test-arch.sh aarch64                # the full run (hours under emulation)
#   bash scripts/test-arch.sh aarch64 3.13 [pytest args]   # another CPython (Debian's)
#
# Steps, each printed with the elapsed time:
#  1. qemu-user-static and debootstrap from Debian (apt-get, if missing) and the kernel's
#     binfmt_misc entry for aarch64 ELF files with the F flag (qemu is opened once, so
#     arm64 programs run inside a chroot that has no qemu of its own);
#  2. the aarch64 wheel, cross-compiled here (KVPOOL_WHEEL_ARCHS=aarch64
#     scripts/build-wheel.sh, auditwheel-checked as manylinux_2_28_aarch64);
#  3. a minimal arm64 Debian chroot (`debootstrap --arch=arm64`; bookworm for 3.11,
#     trixie 3.13, sid 3.14; about 7 minutes and 0.3 GB, kept in
#     $KVPOOL_CHROOT_DIR/arm64-<release>), the checkout bind-mounted at the same path;
#  4. the C++ core's unit tests (cpp/tests/test_core.cpp) cross-compiled by the wheel's
#     Zig for aarch64-linux-gnu.2.28 and run in the chroot;
#  5. in the chroot: a venv, the wheel installed --no-index --no-deps, and
#     --smoke: scripts/smoke_core.py (the free queue and the deferred-free queue against
#            a Python model; no vLLM, no torch);
#     full:  scripts/bootstrap.sh (vLLM 0.33.0's aarch64 wheel without dependencies, the
#            CPU-side packages, torch's aarch64 wheel) with the wheel (KVPOOL_WHEEL), then
#            kvpool's suite (tests/integration/test_engine_core_plugin.py: the plugin active in an
#            engine-core process; the fault-injection sweep, its shim built by the chroot's
#            own g++; not the ASan build of the C++ tests, see step 4) and vLLM 0.33.0's
#            tests/v1/core and KV connector tests, vanilla vs kvpool
#            (`python -m kvpool conformance`, zero regressions). About 1 h 45 min on the
#            2-core machine (2026-12-03: set-up 13 min with the wheel already built, the
#            suite 68 min, vLLM's tests 13 min; 71 min with the chroot and its environment kept).
# The environment lives in the chroot (/opt/kvpool-venv, /opt/kvpool-venv-smoke).
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
usage="usage: scripts/test-arch.sh aarch64 [--smoke] [3.11|3.13|3.14] [pytest args]"
arch="${1:?$usage}"
shift
[ "$arch" = aarch64 ] || { echo "test-arch: only aarch64 is emulated here ($usage)" >&2; exit 2; }
smoke=0
if [ "${1:-}" = --smoke ]; then smoke=1; shift; fi
ver=3.11
case "${1:-}" in 3.[0-9]*) ver="$1"; shift;; esac
declare -A SUITES=([3.11]=bookworm [3.13]=trixie [3.14]=sid)
suite="${SUITES[$ver]:-}"
[ -n "$suite" ] || { echo "test-arch: no Debian release for arm64 ships CPython $ver (known: ${!SUITES[*]})" >&2; exit 2; }
py="python$ver"
tag="cp${ver/./}"
started=$SECONDS
step() { printf 'test-arch [%d:%02d] %s\n' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)) "$*"; }

if [ -n "${KVPOOL_IN_CHROOT:-}" ]; then
  # Inside the arm64 chroot (every program here runs under qemu-aarch64).
  wheel="${KVPOOL_ARCH_WHEEL:?}"
  step "in the chroot: $(uname -m), $("$py" -c 'import sys; print(sys.version.split()[0])')"
  if [ "$smoke" = 1 ]; then
    venv=/opt/kvpool-venv-smoke
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    step "installing $wheel (--no-index --no-deps)"
    "$venv/bin/python" -m pip install -q --no-index --no-deps --force-reinstall "$wheel"
    # From / so that nothing of the checkout is importable: the installed wheel is.
    (cd / && "$venv/bin/python" "$here/scripts/smoke_core.py")
    step "smoke run passed"
    exit 0
  fi
  venv=/opt/kvpool-venv
  step "environment $venv (scripts/bootstrap.sh with the wheel)"
  KVPOOL_VENV="$venv" PYTHON="$py" KVPOOL_WHEEL="$wheel" bash scripts/bootstrap.sh
  use_cpu_platform
  "$venv/bin/python" -c 'import kvpool, platform; assert "site-packages" in kvpool.__file__, kvpool.__file__; print("kvpool from", kvpool.__file__, "on", platform.machine())'
  step "kvpool's suite"
  # tests/native/test_cpp_core.py builds the C++ core tests with ASan, which qemu-user cannot
  # host (its shadow-memory mapping fails at start); step 4 ran the same tests, built for
  # aarch64 without sanitizers.
  "$venv/bin/python" -m pytest tests -q -p no:cacheprovider \
    --deselect tests/native/test_cpp_core.py::test_cpp_core_unit_tests "$@"
  step "vLLM 0.33.0's own tests, vanilla vs kvpool"
  mkdir -p .ci-out
  (cd / && "$venv/bin/python" -m kvpool conformance --json "$here/.ci-out/conformance-$arch-py$ver.json")
  step "full run passed"
  exit 0
fi

# 1. qemu-user and the binfmt_misc entry.
if ! command -v qemu-aarch64-static >/dev/null || ! command -v debootstrap >/dev/null; then
  step "installing qemu-user-static and debootstrap (apt-get)"
  apt-get update -qq
  apt-get install -y -qq qemu-user-static debootstrap >/dev/null
fi
[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
entry=/proc/sys/fs/binfmt_misc/qemu-aarch64
if [ ! -e "$entry" ]; then
  # Debian's own entry (qemu-user-static ships it, flags OCF/POF: F among them).
  cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register
fi
grep -qx enabled "$entry" || echo 1 > "$entry"
grep -q '^flags:.*F' "$entry" || { echo "test-arch: $entry lacks the F flag (qemu would not run inside the chroot): $(grep flags "$entry")" >&2; exit 1; }
step "qemu-aarch64: $(qemu-aarch64-static --version | head -1)"

# 2. The wheel: cross-compiled here.
build_py="$(bash scripts/build-wheel.sh --resolve "$py" 2>/dev/null || true)"
if [ -n "$build_py" ]; then
  step "building the aarch64 wheel with $build_py"
  KVPOOL_WHEEL_ARCHS=aarch64 bash scripts/build-wheel.sh "$build_py"
else
  step "no $py here to build with: using the newest wheelhouse/ wheel for $tag (scripts/build-wheel.sh)"
fi
wheel="$(ls -t wheelhouse/kvpool-*-"$tag"-"$tag"-*manylinux_2_28_aarch64*.whl 2>/dev/null | head -1)"
[ -n "$wheel" ] || { echo "test-arch: no $tag aarch64 wheel in wheelhouse/" >&2; exit 1; }
step "wheel: $wheel"

# 3. The arm64 chroot.
root="${KVPOOL_CHROOT_DIR:-/var/tmp/kvpool-chroots}/arm64-$suite"
# debootstrap does not resolve virtual packages: bookworm's python3.11-venv depends on
# python3.11-distutils, which only python3-distutils provides, so it is named (without
# it the venv package stays unconfigured and the chroot cannot make a venv).
declare -A EXTRA=([bookworm]=,python3-distutils)
if [ ! -e "$root/.kvpool-debootstrap-done" ]; then
  step "debootstrap --arch=arm64 $suite into $root"
  # Never delete through a bind mount (a killed run can leave the checkout mounted there).
  if grep -q " $root/" /proc/mounts; then echo "test-arch: $root still has mounts; umount them first" >&2; exit 1; fi
  rm -rf "$root"
  debootstrap --arch=arm64 --variant=minbase --include="$py,$py-venv,ca-certificates${EXTRA[$suite]:-}" \
    "$suite" "$root" http://deb.debian.org/debian
  touch "$root/.kvpool-debootstrap-done"
fi
chroot_mount "$root"
if [ "$smoke" = 0 ] && [ ! -x "$root/usr/bin/g++" ]; then
  # The suite's fault-injection tests build their malloc shim with the system compiler
  # (tests/native/test_fault_injection.py), as on x86_64: Debian's arm64 g++, under qemu.
  step "g++ in the chroot (apt-get; the fault-injection shim)"
  in_chroot "$root" PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin DEBIAN_FRONTEND=noninteractive \
    sh -c 'apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ >/dev/null'
fi

# 4. The C++ core's unit tests, for aarch64.
zig="$(ls -d build/wheel-"$tag"*/tools/lib/python*/site-packages/ziglang/zig 2>/dev/null | head -1)"
if [ -n "$zig" ]; then
  step "C++ core unit tests (cpp/tests/test_core.cpp) for aarch64-linux-gnu.2.28"
  mkdir -p build/test-arch
  "$zig" c++ -target aarch64-linux-gnu.2.28 -std=c++17 -O2 -Wall -Wextra -Werror -I cpp \
    cpp/tests/test_core.cpp cpp/free_block_list.cpp cpp/fenced_free_queue.cpp -o build/test-arch/test_core-aarch64
  out="$(in_chroot "$root" "$here/build/test-arch/test_core-aarch64")"
  echo "$out" | tail -1
  echo "$out" | grep -q "all checks passed" || { echo "test-arch: the C++ core tests did not pass" >&2; exit 1; }
else
  echo "test-arch: no Zig under build/wheel-$tag*/tools (scripts/build-wheel.sh): C++ core tests not run" >&2
  exit 1
fi

# 5. The rest inside the chroot.
args=("$arch"); [ "$smoke" = 1 ] && args+=(--smoke); args+=("$ver" "$@")
in_chroot "$root" KVPOOL_IN_CHROOT=1 KVPOOL_ARCH_WHEEL="$wheel" bash "$here/scripts/test-arch.sh" "${args[@]}"
step "done"
