"""Device-side checks of decode metadata, reported without a per-call synchronisation.

:func:`cupyflash.flash_attn_with_kvcache` with ``validate=True`` (the default) checks
``cache_seqlens`` and ``block_table`` as :func:`cupyflash.core.checks.check_kvcache_values` does:
lengths ``0 <= cache_seqlens[b]``, ``cache_seqlens[b] + seqlen_new <= capacity``, and the page
ids a sequence uses inside ``[0, num_pages)``. Host data (an int, a list, NumPy arrays, CPU
tensors) is checked on the host and raises before the launch. Device arrays are not read back
(that would synchronise the GPU pipeline every call): the first kernel the call launches (the
KV-append kernel when there are new tokens, else the split kernel) checks them on the device
before its work, one warp per sequence (``kernels_cu/common/kvcache_check.cuh``, no extra
launch), and on a violation writes one error record into host memory mapped into the device's
address space.

The record surfaces as a :class:`DeviceCheckError` (a ValueError whose message is the host
check's, naming the argument and the entry, with a note that an earlier call found it):

* at the start of the next :func:`cupyflash.flash_attn_with_kvcache` call of the process (any
  arguments; the record is in host memory, so looking costs one memory read), once the checking
  kernel has run (kernels are asynchronous: a call right after the bad one, while the GPU is
  still behind, may not see it yet);
* from :func:`check_errors`, which synchronises the devices that ran checks first, so it raises
  for every check launched before it (call it after a step to know that step's metadata was
  valid; ``check_errors(synchronize=False)`` only looks).

Safety does not depend on this check: the decode kernels clamp lengths to the capacity and never
dereference a page id outside the pool (``kernels_cu/decode/split.cu``, ``decode/append.cu``:
such rows are zero-filled, such appends skipped), so a call with bad metadata gives an
unspecified result, never an out-of-bounds access. The first violation found is recorded (one
record per process until it is reported; later ones are dropped). The check is captured into
CUDA graphs with the call, so a replay with bad new lengths is reported the same way.
"""
from __future__ import annotations

import ctypes
import threading

from . import checks, deps

__all__ = ["DeviceCheckError", "check_errors", "pending", "raise_pending", "device_pointers"]


class DeviceCheckError(ValueError):
    """Bad ``cache_seqlens`` / ``block_table`` values found by the device-side check of an
    earlier :func:`cupyflash.flash_attn_with_kvcache` call (that call's output is
    unspecified). The message starts like the host check's, with the argument's name."""


# The check itself is kernels_cu/common/kvcache_check.cuh (check_kvcache_sequence), run by the
# first kernel of the call; the record's int32 fields, in the order of its KvCheckField enum:
# code, b, col, value, seqlen_new, capacity, num_pages, used pages, paged.
_RECORD_INTS = 16
#: error codes of the record's first field
_NEGATIVE, _OVER_CAPACITY, _BAD_PAGE = 1, 2, 3

_lock = threading.Lock()
_record = None        # ctypes int32 array over the mapped host record (None until first used)
_record_host_ptr = 0
_claims: dict = {}    # device -> (claim array, device address of the record)


def pending() -> bool:
    """True when a device-side check has recorded an error not yet reported (a memory read)."""
    rec = _record
    return rec is not None and rec[0] != 0


def raise_pending() -> None:
    """Raise the recorded error (:class:`DeviceCheckError`) and clear it; nothing when none."""
    rec = _record
    if rec is None or rec[0] == 0:
        return
    with _lock:
        code, b, col, value, seqlen_new, capacity, num_pages, used, paged = \
            (int(rec[i]) for i in range(9))
        if code == 0:  # another thread reported it
            return
        for i in range(_RECORD_INTS):
            rec[i] = 0
        for claim, _ in _claims.values():  # let the next violation be recorded
            try:  # (an error path: a synchronisation, so that no stream sees the old claim)
                with claim.device:
                    claim.fill(0)
                    claim.device.synchronize()
            except Exception:  # noqa: BLE001 - e.g. while a stream captures a graph
                pass
    if code == _NEGATIVE:
        msg = checks.negative_length_message(b, value)
    elif code == _OVER_CAPACITY:
        msg = checks.capacity_message(b, value, seqlen_new, capacity, bool(paged))
    else:
        msg = checks.page_id_message(b, col, value, num_pages, used)
    raise DeviceCheckError(msg + " [found on the device by the check of an earlier "
                           "flash_attn_with_kvcache call, whose output is unspecified (never "
                           "out of bounds); see cupyflash.core.guard]")


def check_errors(synchronize: bool = True) -> None:
    """Raise the first bad ``cache_seqlens`` / ``block_table`` value that the device-side checks
    of earlier :func:`cupyflash.flash_attn_with_kvcache` calls found (:class:`DeviceCheckError`,
    a ValueError naming the argument and the entry), and clear it.

    Parameters
    ----------
    synchronize : bool
        First wait for every device that ran a check (``cudaDeviceSynchronize``), so that every
        check launched before this call has finished; False only looks at what has arrived.
    """
    if synchronize and _claims:
        cupy = deps.cupy()
        for dev in list(_claims):
            with cupy.cuda.Device(dev):
                cupy.cuda.runtime.deviceSynchronize()
    raise_pending()


def device_pointers(dev: int) -> tuple:
    """``(claim, record)``: the device addresses the kernels' check writes through on device
    ``dev`` (the current device): the per-device claim word and the mapped host record. Set up
    on first use: the record once per process, the zeroed claim word once per device (which
    synchronises that device once, so the first checked call on a device must not be
    captured in a CUDA graph)."""
    hit = _claims.get(dev)
    if hit is not None:
        return hit[0].data.ptr, hit[1]
    return _setup(dev)


def _setup(dev: int) -> tuple:
    """Allocate what :func:`device_pointers` returns for device ``dev``."""
    global _record, _record_host_ptr
    cupy = deps.cupy()
    from . import launch
    rt = cupy.cuda.runtime
    with _lock:
        hit = _claims.get(dev)
        if hit is not None:
            return hit[0].data.ptr, hit[1]
        if _record is None:
            ptr = rt.hostAlloc(4 * _RECORD_INTS, rt.hostAllocPortable | rt.hostAllocMapped)
            rec = (ctypes.c_int32 * _RECORD_INTS).from_address(ptr)
            for i in range(_RECORD_INTS):
                rec[i] = 0
            _record_host_ptr, _record = ptr, rec
        lib = launch._driver()
        dptr = ctypes.c_uint64(0)
        status = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr),
                                                  ctypes.c_void_p(_record_host_ptr), 0)
        launch._check("cuMemHostGetDevicePointer", status)
        claim = cupy.zeros(1, cupy.int32)
        rt.deviceSynchronize()  # the zero is in place before any stream's check reads it
        _claims[dev] = (claim, int(dptr.value))
    return claim.data.ptr, int(dptr.value)
