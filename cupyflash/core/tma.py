"""Tensor maps of the Hopper forward kernel (``kernels_cu/forward/hopper.cu``) and its per-call
launch work (:class:`PrefillMaps`, the ``prepare`` of its :class:`cupyflash.core.launch.Launch`).

The Hopper kernel loads Q, K and V with the tensor memory accelerator. Each copy is described
by a ``CUtensorMap`` (CUDA Driver API, "Tensor Map Object Management"): 128 bytes built on the
host by ``cuTensorMapEncodeTiled`` from the base pointer, the dims and strides of the tensor and
the box one copy moves, and passed by value inside the kernel's parameter struct
(``cf::FwdTmaParams``, :class:`cupyflash.core.params.FwdTmaParams`).

A map depends on the base pointer. A launch encodes each map once, on its first use, into its
parameter struct; when a tensor's pointer differs from the previous launch's (in a model: every
call) it only replaces the map's address (``cuTensorMapReplaceAddress``, CUDA 12.0+), the other
fields being the entry's (fixed by the layouts that key the launch cache). The launch copies the
struct before ``cuLaunchKernelEx`` returns, so the next call may change it at once. Layout of
every map here: the 4-D tensor
(headdim, nheads, seqlen, batch) of 16-bit elements, innermost first (varlen: seqlen = the
packed tokens, batch = 1); box 64 x 1 x rows x 1 (64 elements = the 128-byte swizzle span; a
head dim of 128 or 256 is 2 or 4 boxes); elements outside the tensor are zero-filled on loads (rows
past a dense sequence or past the packed tensor, columns past the actual head dim).

The output of a dense problem is written the same way: each consumer warpgroup stores its
64 x headdim tile into shared memory (its O buffer at hd64 / hd128, the V ring at hd256:
``HopperFwdSmem`` in ``kernels_cu/forward/hopper.cu``) and one thread writes it with TMA stores through the O map (:func:`o_map_layout`: box
64 x 1 x 64 x 1; elements outside the tensor, rows past seqlen_q and columns past the head dim,
are not written). A varlen problem (a box would run into the next sequence's rows) or an
``out`` whose strides or base a tensor map refuses is written from registers: the launch passes
the flag ``o_map_ok = 0``.
"""
from __future__ import annotations

import ctypes
import functools
import threading

from . import launch

from .params import BwdTmaParams, FwdTmaParams, TensorMap

__all__ = ["TensorMap", "encode_tensor_map", "qkv_maps_layout", "o_map_layout", "tile_counter",
           "PrefillMaps", "backward_maps_layout", "BackwardMaps"]


# cuda.h enum values of cuTensorMapEncodeTiled
CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE_128B = 3
CU_TENSOR_MAP_L2_PROMOTION_256B = 3
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # out-of-bounds elements are zero


@functools.lru_cache(maxsize=1)
def _encode_fn():
    """``cuTensorMapEncodeTiled`` with its argument types (libcuda, loaded on first use)."""
    f = launch._driver().cuTensorMapEncodeTiled
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                  ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                  ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                  ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


@functools.lru_cache(maxsize=1)
def _replace_fn():
    """``cuTensorMapReplaceAddress(CUtensorMap*, void*)`` with its argument types."""
    f = launch._driver().cuTensorMapReplaceAddress
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f


class _MapEncoder:
    """The constant part of one tensor map (dims, strides, box as ctypes arrays): :meth:`encode`
    writes the whole map for a base address into a 64-byte aligned holder, :meth:`set_address`
    only replaces the base address of a map encoded there before."""

    __slots__ = ("dims", "strides", "box", "elem_strides", "rank")

    def __init__(self, dims, strides_bytes, box):
        rank = self.rank = len(dims)
        if not (1 <= rank <= 5 and len(strides_bytes) == rank - 1 and len(box) == rank):
            raise ValueError(f"dims, strides_bytes, box: expected rank 1-5 with rank - 1 "
                             f"strides, got {dims}, {strides_bytes}, {box}")
        if not map_strides_ok(strides_bytes):
            raise ValueError(f"strides: a TMA tensor map needs positive strides that are "
                             f"multiples of 16 bytes below 2^40, got {tuple(strides_bytes)} "
                             f"bytes")
        self.dims = (ctypes.c_uint64 * rank)(*[int(d) for d in dims])
        self.strides = (ctypes.c_uint64 * max(1, rank - 1))(*[int(s) for s in strides_bytes])
        self.box = (ctypes.c_uint32 * rank)(*[int(b) for b in box])
        self.elem_strides = (ctypes.c_uint32 * rank)(*([1] * rank))

    def encode(self, holder: int, ptr: int) -> None:
        """The map of base address ``ptr`` into the 128 bytes at ``holder`` (64-byte aligned).

        Raises
        ------
        cupyflash.core.launch.LaunchError
            The driver refused the description or the address (e.g. not 16-byte aligned)."""
        status = _encode_fn()(
            holder, CU_TENSOR_MAP_DATA_TYPE_UINT16, self.rank, ptr, self.dims,
            self.strides, self.box, self.elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if status:
            launch._check("cuTensorMapEncodeTiled", status)

    @staticmethod
    def set_address(holder: int, ptr: int) -> None:
        """The map encoded at ``holder`` moved to base address ``ptr`` (two arguments instead of
        twelve).

        Raises
        ------
        cupyflash.core.launch.LaunchError
            The driver refused the address."""
        status = _replace_fn()(holder, ptr)
        if status:
            launch._check("cuTensorMapReplaceAddress", status)


def encode_tensor_map(ptr: int, dims, strides_bytes, box) -> TensorMap:
    """A tiled tensor map of 16-bit elements at device address ``ptr``: ``dims`` (innermost
    first, elements), ``strides_bytes`` (of dims 1.., bytes, multiples of 16), ``box`` (elements
    per copy along each dim; the innermost 64 at most: the 128-byte swizzle span), zero fill
    out of bounds.

    Raises
    ------
    ValueError
        Ranks that disagree, strides that are not positive multiples of 16 bytes.
    cupyflash.core.launch.LaunchError
        The driver refused the description (the message names the CUresult)."""
    enc = _MapEncoder(dims, strides_bytes, box)
    raw = ctypes.create_string_buffer(128 + 64)  # the driver wants it 64-byte aligned
    holder = (ctypes.addressof(raw) + 63) & ~63
    enc.encode(holder, int(ptr))
    return TensorMap.from_buffer_copy(ctypes.string_at(holder, ctypes.sizeof(TensorMap)))


def qkv_maps_layout(problem, strides: tuple, block_m: int, block_n: int) -> tuple:
    """``(dims, strides_bytes, box)`` of the q, k and v maps of a prefill problem.

    ``strides``: the 12 q/k/v/o element strides of :func:`cupyflash.forward.kernels.args_template`
    (batch, row, head for each of q, k, v, o). 16-bit elements. A varlen problem's packed
    tensors (total tokens, heads, headdim) are one batch entry of ``total_q`` / ``total_k``
    rows: the kernel adds each sequence's first row (``cu_seqlens``) to its row coordinates,
    and zeroes the V rows past a sequence's end that a tile reads (they are the next
    sequence's, not zero-filled as past the tensor's end)."""
    p = problem
    batch, rows_q, rows_k = ((1, p.total_q, p.total_k) if p.varlen
                             else (p.batch, p.seqlen_q, p.seqlen_k))
    out = []
    for i, (rows, heads, box_rows) in enumerate(((rows_q, p.nheads, block_m),
                                                  (rows_k, p.nheads_k, block_n),
                                                  (rows_k, p.nheads_k, block_n))):
        b, r, h = (int(s) for s in strides[3 * i:3 * i + 3])
        # a batch of one may carry any batch stride (varlen: 0); give TMA one it accepts
        if batch == 1:
            b = max(b, r * max(rows, 1), h * heads)
        out.append(((p.headdim, heads, max(rows, 1), batch), (2 * h, 2 * r, 2 * b),
                    (64, 1, box_rows, 1)))
    return tuple(out)


def map_strides_ok(strides_bytes) -> bool:
    """Strides a tensor map accepts: positive multiples of 16 bytes below 2^40 (as
    :class:`_MapEncoder` requires)."""
    return all(s > 0 and s % 16 == 0 and s < 1 << 40 for s in strides_bytes)


def o_map_layout(problem, strides: tuple):
    """``(dims, strides_bytes, box)`` of the O map of a dense prefill problem (encoded like q's:
    (headdim, nheads, seqlen_q, batch) of 16-bit elements, box 64 x 1 x 64 x 1, one consumer
    warpgroup's rows), or None where the kernel must write O from registers: a varlen problem
    (a box's rows past a sequence's end are the next sequence's, which TMA would overwrite), or
    ``out`` strides a tensor map refuses (not positive multiples of 16 bytes, e.g. a reversed
    view). ``strides``: as for :func:`qkv_maps_layout` (out's are the 10th to 12th). The base
    address is checked per call (:class:`TmaLaunch`)."""
    p = problem
    if p.varlen:
        return None
    rows = max(p.seqlen_q, 1)
    b, r, h = (int(x) for x in strides[9:12])
    if p.batch == 1:  # (as q's) a batch of one may carry any batch stride
        b = max(b, r * rows, h * p.nheads)
    sb = (2 * h, 2 * r, 2 * b)
    if not map_strides_ok(sb):
        return None
    return ((p.headdim, p.nheads, rows, p.batch), sb, (64, 1, 64, 1))


_COUNTERS: dict = {}
_COUNTERS_LOCK = threading.Lock()
#: CuPy's per-thread default stream handle (cudaStreamPerThread): one CUDA stream per host thread.
_PER_THREAD_STREAM = 2
#: Counters come from one zeroed int32 array of this many per device (16 KiB; a new one when it
#: runs out): one per stream and one per captured causal call, so that a model's graphs (layers
#: x captured shapes) seldom use one up between eager calls.
_POOL_SLOTS = 4096
_POOLS: dict = {}
#: Counters handed to launches captured in CUDA graphs: kept for the graphs' lifetime (unknown).
_CAPTURED: list = []
#: Devices whose pool a captured call used up (or found used up or not made): the next causal
#: call outside a capture, on any stream, makes a new one (:func:`tile_counter`), so that a
#: later capture finds free slots though captured calls alone used them up.
_REFILL: set = set()


def _capturing(stream_ptr: int) -> bool:
    import cupy
    try:
        return bool(cupy.cuda.runtime.streamIsCapturing(stream_ptr))
    except cupy.cuda.runtime.CUDARuntimeError:  # the legacy stream during a global capture
        return True


def _new_counter(device_id: int, stream_ptr: int):
    """A zeroed int32 counter on the current device (``device_id``): a one-element CuPy view of
    the device's pool, and whether :func:`tile_counter` keeps it for the stream.

    Outside a capture the stream keeps it. Inside a CUDA graph capture (the pool already made,
    which needs an allocation and a synchronisation a capture forbids) the captured launch gets
    a slot of its own, kept for as long as the process runs and never given to a stream: the
    graph's replays and eager calls on the capturing stream never share a counter.

    Raises
    ------
    ValueError
        Inside a capture when this device's pool is not made yet, or is used up."""
    capturing = _capturing(stream_ptr)
    pool = _POOLS.get(device_id)
    if pool is None or pool[1] == _POOL_SLOTS:
        if capturing:
            _REFILL.add(device_id)
            raise ValueError(
                "causal: a causal prefill call on the Hopper TMA kernel needs a zeroed scheduler "
                "counter, allocated (with a synchronisation) on this device's first such call "
                f"and every {_POOL_SLOTS} streams or captured calls after it, which a CUDA graph "
                "capture forbids; make one causal call on this device outside the capture first")
        pool = _new_pool(device_id)
    arr = pool[0][pool[1]:pool[1] + 1]
    pool[1] += 1
    if capturing:
        _CAPTURED.append(arr)
        if pool[1] == _POOL_SLOTS:  # (used up outside captures: made by the next new stream)
            _REFILL.add(device_id)
    return arr, not capturing


def _new_pool(device_id: int) -> list:
    """A new zeroed pool for ``device_id`` (the current device), outside any capture: the
    device's ``[array, next free slot]``; the old pool's slots stay with their streams."""
    import cupy
    pool = _POOLS[device_id] = [cupy.zeros(_POOL_SLOTS, cupy.int32), 0]
    cupy.cuda.Device(device_id).synchronize()  # zeroed before any stream uses it
    _REFILL.discard(device_id)
    return pool


def tile_counter(device_id: int, stream_ptr: int) -> int:
    """Device address of the causal scheduler's counter for one (device, stream): an int32 that
    is 0 between launches (each launch leaves it 0: ``TileScheduler::next`` in
    ``kernels_cu/common/tile_scheduler.cuh``). One per stream, so that launches on two streams never
    share one; CuPy's per-thread default stream is one handle for a CUDA stream per host thread,
    so there it is one per host thread. Made on first use on the current device, which must be
    ``device_id`` (:func:`_new_counter`). A launch captured in a CUDA graph on a stream without
    one gets a counter of its own (its replays must not overlap each other, as with any graph's
    buffers); captured on a stream that has one, it uses that stream's, so its replays must not
    overlap eager causal calls on that stream. A stream destroyed with a causal launch still
    running, whose handle a new stream then gets, would share its counter with that launch:
    not guarded.

    Raises
    ------
    ValueError
        Inside a CUDA graph capture, the device's first causal call, or a captured call that
        finds the device's pool used up (4096 streams and captured calls per pool; the next
        causal call outside a capture, on any stream, makes a new one)."""
    key = (device_id, stream_ptr)
    if stream_ptr == _PER_THREAD_STREAM:
        key += (threading.get_ident(),)
    arr = _COUNTERS.get(key)
    if arr is None or device_id in _REFILL:
        with _COUNTERS_LOCK:
            if device_id in _REFILL and not _capturing(stream_ptr):
                _new_pool(device_id)
            arr = _COUNTERS.get(key)
            if arr is None:
                arr, keep = _new_counter(device_id, stream_ptr)
                if keep:
                    _COUNTERS[key] = arr
    return arr.data.ptr


_MAP_OFFSETS = tuple(getattr(FwdTmaParams, n).offset for n in ("tq", "tk", "tv", "to"))
_COUNTER_OFFSET = FwdTmaParams.tile_counter.offset
_O_OK_OFFSET = FwdTmaParams.o_map_ok.offset


class PrefillMaps:
    """The per-call work of a Hopper forward launch, run by its
    :class:`cupyflash.core.launch.Launch` (``prepare``) on the launch's
    :class:`cupyflash.core.params.FwdTmaParams` before each launch: the q, k, v tensor maps at
    the call's pointers (the first three of the call), the O map and its flag ``o_map_ok``, and
    the causal scheduler's counter (:func:`tile_counter` of the call's stream when ``causal``,
    else NULL). Each map is encoded on the first call and its address replaced when its pointer
    changes.

    The O map (``o_map``) is optional: without one (varlen, strides a map refuses) the
    fourth map is zeros and ``o_map_ok`` 0, and the kernel writes O from registers. With one, a
    call whose ``out`` pointer (the fourth pointer) the driver refuses (not 16-byte aligned)
    launches with ``o_map_ok`` 0 too, never with a stale map: that call's O is written from
    registers.

    Parameters
    ----------
    maps : tuple of 3 ``(dims, strides_bytes, box)``
        From :func:`qkv_maps_layout`.
    o_map : ``(dims, strides_bytes, box)`` or None
        From :func:`o_map_layout`.
    causal : bool
        The kernel schedules its tiles dynamically (needs the counter).
    device_id : int
        The kernel's device (the counters are per device and stream).
    """

    __slots__ = ("_enc", "_ptrs", "_causal", "_device", "_views")

    def __init__(self, maps, o_map=None, *, causal: bool, device_id: int):
        self._enc = tuple(_MapEncoder(*m) for m in maps) + (
            (_MapEncoder(*o_map),) if o_map is not None else ())
        self._ptrs = [None] * len(self._enc)  # the address each map of the launch's struct has
        self._causal, self._device = bool(causal), int(device_id)
        self._views = (None, None, None)  # (struct address, counter field, flag field)

    def _fields(self, addr: int) -> tuple:
        """The counter and flag fields of the struct at ``addr`` (kept for the launch's own)."""
        if self._views[0] == addr:
            return self._views[1:]
        return (ctypes.c_uint64.from_address(addr + _COUNTER_OFFSET),
                ctypes.c_int32.from_address(addr + _O_OK_OFFSET))

    def __call__(self, addr: int, pointers, stream_ptr: int, own: bool = True) -> None:
        """Fill the maps, the flag and the counter of the struct at ``addr`` for ``pointers``
        (q, k, v, out, ...) and the stream ``stream_ptr``; ``own``: the launch's own struct
        (whose maps this object tracks), else a copy (every map encoded anew).

        Raises
        ------
        cupyflash.core.launch.LaunchError
            The driver refused a q, k or v map."""
        counter_field, ok_field = self._fields(addr)
        if own and self._views[0] != addr:
            self._views = (addr, counter_field, ok_field)
        counter_field.value = tile_counter(self._device, stream_ptr) if self._causal else 0
        ok = 1
        for i, enc in enumerate(self._enc):
            x = pointers[i]
            cur = self._ptrs[i] if own else None
            if cur == x:
                continue
            if i == 3 and x % 16:  # the driver would refuse it: registers, no driver call
                ok = 0
                continue
            if own:
                self._ptrs[i] = None  # until the driver accepted the map
            try:
                if cur is None:
                    enc.encode(addr + _MAP_OFFSETS[i], x)
                else:
                    enc.set_address(addr + _MAP_OFFSETS[i], x)
            except launch.LaunchError:
                if i < 3:
                    raise
                ok = 0  # the O map refused: this call writes O from registers
                continue
            if own:
                self._ptrs[i] = x
        ok_field.value = ok if len(self._enc) == 4 else 0


def backward_maps_layout(problem, strides: dict, block_m: int = 64, block_n: int = 128):
    """``(dims, strides_bytes, box)`` of the q, k, v and dout maps of the Hopper backward
    (``kernels_cu/backward/hopper.cu``; encoded like the forward's, boxes of ``block_m`` rows for
    q and dout, ``block_n`` for k and v), or None where a tensor map refuses a stride (not a
    positive multiple of 16 bytes): that call runs the mma.sync kernels. Dense problems only.
    ``strides``: element strides (batch, row, head, ...) by name (``q``, ``k``, ``v``,
    ``dout``)."""
    p = problem
    out = []
    for name, rows, heads, box_rows in (("q", p.seqlen_q, p.nheads, block_m),
                                        ("k", p.seqlen_k, p.nheads_k, block_n),
                                        ("v", p.seqlen_k, p.nheads_k, block_n),
                                        ("dout", p.seqlen_q, p.nheads, block_m)):
        b, r, h = (int(x) for x in strides[name][:3])
        if p.batch == 1:  # (as the forward's) a batch of one may carry any batch stride
            b = max(b, r * max(rows, 1), h * heads)
        sb = (2 * h, 2 * r, 2 * b)
        if not map_strides_ok(sb):
            return None
        out.append(((p.headdim, heads, max(rows, 1), p.batch), sb, (64, 1, box_rows, 1)))
    return tuple(out)


_BWD_MAP_OFFSETS = tuple(getattr(BwdTmaParams, n).offset for n in ("tq", "tk", "tv", "tdo"))


class BackwardMaps:
    """The per-call work of a Hopper backward launch (the ``prepare`` of its
    :class:`cupyflash.core.launch.Launch`): the q, k, v and dout tensor maps of
    :class:`cupyflash.core.params.BwdTmaParams` at the call's pointers, encoded on the first call
    and moved (``cuTensorMapReplaceAddress``) when a pointer changes.

    Parameters
    ----------
    maps : tuple of 4 ``(dims, strides_bytes, box)``
        From :func:`backward_maps_layout`.
    sources : tuple of 4 ints
        The index of q, k, v and dout in a call's pointers."""

    __slots__ = ("_enc", "_src", "_ptrs", "_addr")

    def __init__(self, maps, sources):
        self._enc = tuple(_MapEncoder(*m) for m in maps)
        self._src = tuple(int(i) for i in sources)
        self._ptrs = [None] * len(self._enc)
        self._addr = None

    def __call__(self, addr: int, pointers, stream_ptr: int, own: bool = True) -> None:
        """Fill the maps of the struct at ``addr`` for ``pointers``; ``own``: the launch's own
        struct (whose maps this object tracks), else a copy (every map encoded anew).

        Raises
        ------
        cupyflash.core.launch.LaunchError
            The driver refused a map (e.g. a base address not 16-byte aligned)."""
        if own and self._addr != addr:
            self._addr, self._ptrs = addr, [None] * len(self._enc)
        for i, enc in enumerate(self._enc):
            x = pointers[self._src[i]]
            cur = self._ptrs[i] if own else None
            if cur == x:
                continue
            if own:
                self._ptrs[i] = None  # until the driver accepted the map
            if cur is None:
                enc.encode(addr + _BWD_MAP_OFFSETS[i], x)
            else:
                enc.set_address(addr + _BWD_MAP_OFFSETS[i], x)
            if own:
                self._ptrs[i] = x
