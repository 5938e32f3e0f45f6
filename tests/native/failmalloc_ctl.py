"""The control side of tests/native/failmalloc.cpp, for the child interpreters of the
fault-injection tests (fault_sweep.py, deferred_fault.py).

``lib.kvpool_fault_arm(k)`` makes the k-th allocation from then on fail once;
``disarm()`` turns it off and returns how many allocations failed since the arm (0 or 1).
"""
import ctypes
import os

lib = ctypes.CDLL(os.environ["KVPOOL_FAILMALLOC"])
lib.kvpool_fault_arm.argtypes = [ctypes.c_long]
# void: with ctypes' default int result, whatever the return register holds (aarch64:
# often not a small int) becomes a Python int, an allocation the armed shim fails.
lib.kvpool_fault_arm.restype = None
lib.kvpool_fault_disarm.restype = ctypes.c_long


def disarm() -> int:
    """Turn the shim off; the number of failed allocations since the arm (0 or 1).

    The call itself goes through ctypes, which on CPython 3.14 allocates while the shim
    is still armed: when the operation under test made fewer allocations than the armed
    k, that allocation is the one that fails, and the MemoryError is the harness's, not
    the pool's (the operation had returned). The shim fails once only, so the second
    call goes through; it reports the failure, which the caller then finds absorbed
    (no error from the operation) and checks the pool's consistency as for any other.
    """
    try:
        return lib.kvpool_fault_disarm()
    except MemoryError:
        return lib.kvpool_fault_disarm()
