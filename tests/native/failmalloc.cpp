// Fault injection for kvpool's tests (docs/native-checks.md, "Fault injection"):
// preloaded (LD_PRELOAD, first in the list), it makes the k-th allocation after
// kvpool_fault_arm(k) fail once: malloc/calloc/realloc/aligned allocations return
// NULL and operator new throws std::bad_alloc. Everything else is forwarded to the
// next definition (libc, or the ASan runtime when that is preloaded after this).
// Single-threaded use: the tests arm it around one pool operation at a time.
#include <dlfcn.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <new>

namespace {
using malloc_fn = void* (*)(size_t);
using calloc_fn = void* (*)(size_t, size_t);
using realloc_fn = void* (*)(void*, size_t);
using free_fn = void (*)(void*);
using memalign_fn = int (*)(void**, size_t, size_t);
using aligned_fn = void* (*)(size_t, size_t);
using new_fn = void* (*)(size_t);
using new_aligned_fn = void* (*)(size_t, std::align_val_t);

malloc_fn real_malloc;
calloc_fn real_calloc;
realloc_fn real_realloc;
free_fn real_free;
memalign_fn real_posix_memalign;
aligned_fn real_aligned_alloc;
aligned_fn real_memalign;
new_fn real_new, real_new_array;
new_aligned_fn real_new_aligned, real_new_array_aligned;

// dlsym itself may allocate before the real functions are known: serve that from here.
alignas(16) char boot[1 << 16];
size_t boot_used;
bool resolving;

void* boot_alloc(size_t n) {
  n = (n + 15) & ~static_cast<size_t>(15);
  if (boot_used + n > sizeof boot) return nullptr;
  void* p = boot + boot_used;
  boot_used += n;
  return p;
}
bool in_boot(const void* p) {
  return static_cast<const char*>(p) >= boot && static_cast<const char*>(p) < boot + sizeof boot;
}

template <typename T>
void load(T& fn, const char* name) {
  fn = reinterpret_cast<T>(dlsym(RTLD_NEXT, name));
}

void resolve() {
  if (real_free || resolving) return;
  resolving = true;
  load(real_calloc, "calloc");
  load(real_malloc, "malloc");
  load(real_realloc, "realloc");
  load(real_posix_memalign, "posix_memalign");
  load(real_aligned_alloc, "aligned_alloc");
  load(real_memalign, "memalign");
  load(real_new, "_Znwm");
  load(real_new_array, "_Znam");
  load(real_new_aligned, "_ZnwmSt11align_val_t");
  load(real_new_array_aligned, "_ZnamSt11align_val_t");
  load(real_free, "free");
  resolving = false;
}

long countdown = -1;  // allocations to let through before the failure; -1: off
long failures = 0;
thread_local int inside_new = 0;  // a malloc made by the real operator new is not counted again

bool fail_now() {
  if (countdown < 0 || inside_new) return false;
  if (countdown-- == 0) {
    countdown = -1;
    ++failures;
    return true;
  }
  return false;
}

void* counted_new(new_fn real, size_t n) {
  resolve();
  if (fail_now()) throw std::bad_alloc();
  ++inside_new;
  void* p = real(n);  // may throw bad_alloc itself
  --inside_new;
  return p;
}
void* counted_new_aligned(new_aligned_fn real, size_t n, std::align_val_t a) {
  resolve();
  if (fail_now()) throw std::bad_alloc();
  ++inside_new;
  void* p = real(n, a);
  --inside_new;
  return p;
}
}  // namespace

extern "C" {
// kvpool_fault_arm(k): the k-th allocation from now (0: the next one) fails, once.
void kvpool_fault_arm(long k) {
  resolve();
  failures = 0;
  countdown = k;
}
// Turn it off; returns how many allocations failed since the last arm (0 or 1).
long kvpool_fault_disarm(void) {
  countdown = -1;
  return failures;
}

void* malloc(size_t n) {
  if (!real_malloc) {
    resolve();
    if (!real_malloc) return boot_alloc(n);
  }
  if (fail_now()) {
    errno = ENOMEM;
    return nullptr;
  }
  return real_malloc(n);
}
void* calloc(size_t n, size_t size) {
  if (!real_calloc) {
    if (resolving) {
      void* p = boot_alloc(n * size);
      if (p) std::memset(p, 0, n * size);
      return p;
    }
    resolve();
  }
  if (fail_now()) {
    errno = ENOMEM;
    return nullptr;
  }
  return real_calloc(n, size);
}
void* realloc(void* p, size_t n) {
  resolve();
  if (in_boot(p)) {
    void* q = real_malloc(n);
    if (q) std::memcpy(q, p, n < static_cast<size_t>(boot + sizeof boot - static_cast<char*>(p)) ? n : static_cast<size_t>(boot + sizeof boot - static_cast<char*>(p)));
    return q;
  }
  if (fail_now()) {
    errno = ENOMEM;
    return nullptr;
  }
  return real_realloc(p, n);
}
void free(void* p) {
  if (p == nullptr || in_boot(p)) return;
  resolve();
  real_free(p);
}
int posix_memalign(void** out, size_t alignment, size_t n) {
  resolve();
  if (fail_now()) return ENOMEM;
  return real_posix_memalign(out, alignment, n);
}
void* aligned_alloc(size_t alignment, size_t n) {
  resolve();
  if (fail_now()) {
    errno = ENOMEM;
    return nullptr;
  }
  return real_aligned_alloc(alignment, n);
}
void* memalign(size_t alignment, size_t n) {
  resolve();
  if (fail_now()) {
    errno = ENOMEM;
    return nullptr;
  }
  return real_memalign(alignment, n);
}
}  // extern "C"

void* operator new(size_t n) { return counted_new(real_new, n); }
void* operator new[](size_t n) { return counted_new(real_new_array, n); }
void* operator new(size_t n, std::align_val_t a) { return counted_new_aligned(real_new_aligned, n, a); }
void* operator new[](size_t n, std::align_val_t a) { return counted_new_aligned(real_new_array_aligned, n, a); }
