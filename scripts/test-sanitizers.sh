#!/usr/bin/env bash
# kvpool's extension built with AddressSanitizer + UndefinedBehaviorSanitizer, run
# under the ordinary interpreter with the ASan runtime preloaded: kvpool's suite (the
# differential tests against vLLM's classes included), the long differential and the
# leak-check workload (every error and rollback path).
#
#   bash scripts/test-sanitizers.sh            # full suite + long differential at 10^5 ops
#   bash scripts/test-sanitizers.sh --short    # CI: pool/hot-path/differential tests, 2*10^4-op runs
#
# .venv-asan reuses .venv's packages (same interpreter, a .pth line to .venv's
# site-packages); only kvpool is rebuilt, into .venv-asan. Run settings and what they
# do and do not catch: docs/native-checks.md.
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
short=0
[ "${1:-}" = "--short" ] && short=1
use_cpu_platform
ensure_dev_venv

base_python="$(.venv/bin/python -c 'import sys; print(sys._base_executable)')"
release_site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
[ -x .venv-asan/bin/python ] || "$base_python" -m venv --without-pip .venv-asan
asan_site="$(.venv-asan/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# A plain path line: .venv's .pth files (kvpool's editable finder) are not run, so
# `kvpool` resolves to the sanitizer build in .venv-asan, first on sys.path.
echo "$release_site" > "$asan_site/zz_kvpool_release_venv.pth"

flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
rm -rf build-native-checks/asan
.venv-asan/bin/python -m pip --disable-pip-version-check install -q --no-build-isolation --no-deps \
  --ignore-installed -C build-dir=build-native-checks/asan -C cmake.build-type=Debug \
  -C cmake.define.CMAKE_CXX_FLAGS_DEBUG="-O1 -g $flags" \
  -C cmake.define.CMAKE_MODULE_LINKER_FLAGS="$flags" . 2>&1 | grep -v "^$" || true
so="$(ls .venv-asan/lib/python3.11/site-packages/kvpool/_core.*.so)"
ldd "$so" | grep libasan >/dev/null || { echo "$so is not linked against libasan" >&2; exit 1; }

# The ASan runtime must be the first library loaded; the interpreter itself is not
# instrumented. PYTHONMALLOC=malloc: Python objects come from malloc, not from
# pymalloc's arenas, so ASan sees a freed block object or list (use after free) too.
# detect_leaks=0: CPython does not free everything at exit and pymalloc/torch hold
# memory for the process's life, so LeakSanitizer would report thousands of
# allocations that are not kvpool's; leaks of Python objects are checked exactly by
# the debug-interpreter run (scripts/test-debug-python.sh), and kvpool's native
# buffers are RAII members (the C++ core's own LSan run: tests/native/test_cpp_core.py).
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export PYTHONMALLOC=malloc
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:strict_init_order=1:check_initialization_order=1:detect_stack_use_after_return=1:allocator_may_return_null=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
py=.venv-asan/bin/python
"$py" -c 'import kvpool._core as c, sys; print("sanitizer build:", c.__file__)'
# The test files marked `sanitizer` (pyproject.toml); of those, the long random-operation
# runs are also marked `slow`.
if [ "$short" = 1 ]; then
  KVPOOL_DIFF_OPS=20000 KVPOOL_MANAGER_DIFF_OPS=6000 KVPOOL_LEAK_OPS=20000 KVPOOL_POLICY_DIFF_OPS=20000 "$py" -m pytest -q -p no:cacheprovider -s \
    -m sanitizer tests
else
  KVPOOL_DIFF_OPS=100000 KVPOOL_LEAK_OPS=100000 KVPOOL_POLICY_DIFF_OPS=100000 "$py" -m pytest -q -p no:cacheprovider -s \
    -m "sanitizer and slow" tests
  "$py" -m pytest -q -p no:cacheprovider -m "not (sanitizer and slow)" tests
fi
echo "sanitizers: no ASan/UBSan report (a report aborts the run)"
