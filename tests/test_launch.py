"""cupyflash.core.launch and the tensor maps of cupyflash.core.tma on the CPU: the ctypes mirrors
of cuda.h's launch structures, what the driver receives (a fake driver), and the checks that run
before the driver is touched."""
import ctypes
from pathlib import Path
import re

import pytest

from cupyflash.core import launch


def test_structures_match_cuda_h_layout():
    # CUlaunchAttribute: 4-byte id, 4 bytes of padding, 64-byte value union
    assert ctypes.sizeof(launch._AttrValue) == 64
    assert ctypes.sizeof(launch._Attr) == 72 and launch._Attr.value.offset == 8
    # CUlaunchConfig: 7 unsigned ints, then the stream handle aligned to 8 bytes
    assert launch._Config.stream.offset == 32 and launch._Config.attrs.offset == 40
    assert launch._Config.num_attrs.offset == 48 and ctypes.sizeof(launch._Config) == 56


def _cuda_h_text() -> str:
    """The installed cuda.h (the toolkit's, else pip's CUDA 13 headers); skips if none."""
    heads = [Path("/usr/local/cuda/include/cuda.h")]
    try:
        import nvidia.cu13  # noqa: F401  (pip's CUDA 13 headers)
        heads += list(Path(nvidia.cu13.__path__[0]).glob("include/cuda.h"))
    except Exception:  # noqa: BLE001
        pass
    heads = [h for h in heads if h.is_file()]
    if not heads:
        pytest.skip("no cuda.h installed")
    return heads[0].read_text(errors="replace")


def test_enum_values_match_the_header_when_present():
    """The enum values used are those of cuda.h (checked against the installed header)."""
    text = _cuda_h_text()
    name = "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION"
    m = re.search(rf"\b{name}\s*=\s*(\d+)", text)
    assert m and int(m.group(1)) == launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def test_pdl_attribute():
    attrs = launch._pdl_attrs()
    assert len(attrs) == 1
    assert attrs[0].id == launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    # programmaticStreamSerializationAllowed: the union's first int
    assert launch._AttrValue.programmatic.offset == 0 and attrs[0].value.programmatic == 1


class _FakeKernel:
    class kernel:  # noqa: N801 - stands in for cupy's Function (only .ptr is read)
        ptr = 0x1234


class _Small(ctypes.Structure):
    _fields_ = [("a", ctypes.c_uint64), ("b", ctypes.c_uint64), ("n", ctypes.c_int32),
                ("x", ctypes.c_double)]


def _struct_of(params, struct):
    """The struct a launch passes: its argument array holds one pointer, to the struct."""
    addr = params[0]
    assert addr % 64 == 0  # (tensor maps inside must be 64-byte aligned)
    return struct.from_buffer_copy(ctypes.string_at(addr, ctypes.sizeof(struct)))


def test_launch_checks_its_arguments():
    prm = _Small(n=7, x=0.25)
    with pytest.raises(ValueError, match="grid, block"):
        launch.Launch(_FakeKernel(), prm, (32, 1), (32, 1, 1), pointers=(0, 2))
    with pytest.raises(ValueError, match="pointers: 3 pointers at byte 16 lie outside the "
                                         "32-byte _Small"):
        launch.Launch(_FakeKernel(), prm, (1, 1, 1), (32, 1, 1), pointers=(16, 3))


@pytest.mark.parametrize("pdl", [True, False])
def test_launch_passes_the_struct_with_the_call_pointers_stream_and_attribute(monkeypatch, pdl):
    """What the driver sees at each call: the function, the configuration (grid, block, shared
    memory, the stream given, the PDL attribute or none) and one argument, the parameter struct
    (read during the call), whose pointer block holds this call's pointers and whose other
    fields are the constants given."""
    seen = []

    def launch_ex(cfg_ref, func, params, extra):
        cfg = ctypes.cast(cfg_ref, ctypes.POINTER(launch._Config)).contents
        s = _struct_of(params, _Small)
        seen.append((func.value, tuple(cfg.grid), tuple(cfg.block), cfg.shared_mem_bytes,
                     cfg.stream, cfg.num_attrs, [s.a, s.b, s.n, s.x]))
        return 0
    monkeypatch.setattr(launch, "_LAUNCH_EX", launch_ex)
    prm = _Small(n=7, x=0.125)
    pl = launch.Launch(_FakeKernel(), prm, (4, 2, 1), (256, 1, 1), pointers=(0, 2),
                       shared_mem=64, pdl=pdl)
    prm.n = 99  # copied at construction
    pl((0xA0, 0xB0), 0x77)
    pl((0xC0, 0), 0)
    assert pl._lock.acquire(False)  # as if another thread were launching it: a copy of its own
    pl((0xD0, 0xE0), 0x78)
    pl._lock.release()
    want = (0x1234, (4, 2, 1), (256, 1, 1), 64)
    assert seen == [want + (0x77, int(pdl), [0xA0, 0xB0, 7, 0.125]),
                    want + (None, int(pdl), [0xC0, 0, 7, 0.125]),  # a NULL stream reads as None
                    want + (0x78, int(pdl), [0xD0, 0xE0, 7, 0.125])]
    for bad in ((1,), (1, 2, 3)):
        with pytest.raises(ValueError, match="pointers: expected 2"):
            pl(bad, 0)
        assert pl._lock.acquire(False)  # released after the error
        with pytest.raises(ValueError, match="pointers: expected 2"):
            pl(bad, 0)
        pl._lock.release()
    monkeypatch.setattr(launch, "_LAUNCH_EX", lambda *a: 1)
    monkeypatch.setattr(launch, "_driver", lambda: type("D", (), {
        "cuGetErrorName": staticmethod(lambda status, out: 0)})())
    with pytest.raises(launch.LaunchError, match="cuLaunchKernelEx failed"):
        pl((1, 2), 0)


def _tma_launch(causal, o_map=None):
    """A Launch of an FwdTmaParams with PrefillMaps (q, k, v maps; ``o_map``), fwd.headdim 5."""
    from cupyflash.core import params, tma
    prm = params.FwdTmaParams()
    prm.fwd.headdim = 5
    maps = tuple(((64, 2, 100, 1), (128, 256, 25600), (64, 1, 128, 1)) for _ in range(3))
    off, n = params.pointer_fields(params.FwdParams, ("q", "k", "v", "o"))
    return launch.Launch(_FakeKernel(), prm, (3, 1, 1), (384, 1, 1),
                         pointers=(params.FwdTmaParams.fwd.offset + off, n), shared_mem=4096,
                         prepare=tma.PrefillMaps(maps, o_map, causal=causal, device_id=0))


def _map_word(s, name):
    """The first word of map ``name`` (the fakes below write the map's address there)."""
    return getattr(s, name).words[0]


@pytest.mark.parametrize("causal", [False, True])
def test_tma_launch_passes_maps_counter_pointers_and_stream(monkeypatch, causal):
    """cupyflash.core.tma.PrefillMaps through Launch: the struct's q/k/v tensor maps (encoded on
    the first call; afterwards only a changed pointer's address is replaced), the o map (zeros
    without one), the causal counter of the call's stream (NULL when non-causal), o_map_ok (0
    without an o map), then the forward's fields with this call's pointers; the function handle
    reaches the driver as a ctypes pointer (a bare int would be cut to 32 bits). A refused
    address raises before any launch and the map is encoded again on the next call."""
    from cupyflash.core import params, tma
    encoded, replaced = [], []

    def encode(holder, dtype, rank, ptr, dims, strides, box, elem, il, sw, l2, oob):
        ctypes.memmove(holder, ctypes.byref(ctypes.c_uint64(ptr)), 8)  # a recognisable map
        encoded.append((ptr, list(dims), list(strides), list(box)))
        return 0

    def replace(holder, ptr):
        if ptr % 16:
            return 1  # CUDA_ERROR_INVALID_VALUE
        ctypes.memmove(holder, ctypes.byref(ctypes.c_uint64(ptr)), 8)
        replaced.append(ptr)
        return 0
    monkeypatch.setattr(tma, "_encode_fn", lambda: encode)
    monkeypatch.setattr(tma, "_replace_fn", lambda: replace)
    monkeypatch.setattr(tma, "tile_counter", lambda dev, stream: 0xC000 + stream)
    seen = []

    def launch_ex(cfg_ref, func, prm, extra):
        cfg = ctypes.cast(cfg_ref, ctypes.POINTER(launch._Config)).contents
        s = _struct_of(prm, params.FwdTmaParams)
        assert bytes(s.to) == bytes(128) and s.o_map_ok == 0  # no o map: zeros, flag 0
        seen.append((func.value, tuple(cfg.grid), cfg.shared_mem_bytes, cfg.stream,
                     [_map_word(s, n) for n in ("tq", "tk", "tv")],
                     [s.tile_counter, s.fwd.q, s.fwd.k, s.fwd.v, s.fwd.headdim]))
        return 0
    monkeypatch.setattr(launch, "_LAUNCH_EX", launch_ex)
    run = _tma_launch(causal)
    run((0xA00, 0xB00, 0xD00, 0x100), 0x77)
    run((0xA00, 0xB00, 0xE00, 0x100), 0x78)
    run((0xF00, 0x1000, 0x1100, 0x100), 0x78)
    c = (lambda s: 0xC000 + s) if causal else (lambda s: 0)
    assert seen == [
        (0x1234, (3, 1, 1), 4096, 0x77, [0xA00, 0xB00, 0xD00], [c(0x77), 0xA00, 0xB00, 0xD00, 5]),
        (0x1234, (3, 1, 1), 4096, 0x78, [0xA00, 0xB00, 0xE00], [c(0x78), 0xA00, 0xB00, 0xE00, 5]),
        (0x1234, (3, 1, 1), 4096, 0x78, [0xF00, 0x1000, 0x1100],
         [c(0x78), 0xF00, 0x1000, 0x1100, 5])]
    assert [e[0] for e in encoded] == [0xA00, 0xB00, 0xD00]  # each map encoded once
    assert encoded[0][1:] == ([64, 2, 100, 1], [128, 256, 25600], [64, 1, 128, 1])
    assert replaced == [0xE00, 0xF00, 0x1000, 0x1100]  # then only new addresses, only changed
    # another thread launching at the same time: a copy of the struct, its maps encoded anew
    assert run._lock.acquire(False)
    run((0x2000, 0x1000, 0x1100, 0x100), 0x79)
    run._lock.release()
    assert seen[-1][4] == [0x2000, 0x1000, 0x1100] and len(encoded) == 6
    run((0xF00, 0x1000, 0x1100, 0x100), 0x78)  # the launch's own maps did not move
    assert replaced == [0xE00, 0xF00, 0x1000, 0x1100] and seen[-1][4] == [0xF00, 0x1000, 0x1100]
    monkeypatch.setattr(launch, "_driver", lambda: type("D", (), {
        "cuGetErrorName": staticmethod(lambda status, out: 0)})())
    n = len(seen)
    with pytest.raises(launch.LaunchError, match="cuTensorMapReplaceAddress failed"):
        run((0xF08, 0x1000, 0x1100, 0x100), 0x78)  # not 16-byte aligned
    assert len(seen) == n  # no launch
    run((0xF00, 0x1000, 0x1100, 0x100), 0x78)
    assert encoded[-1][0] == 0xF00  # the refused map re-encoded
    assert seen[-1][4] == [0xF00, 0x1000, 0x1100]
    with pytest.raises(ValueError, match="pointers: expected 4"):
        run((1,), 0)


def test_tma_launch_o_map_and_its_flag(monkeypatch):
    """With an o map (dense problems of the TMA rows), PrefillMaps fills the struct's o map and
    o_map_ok = 1 when this call's out (the fourth pointer) is in it: encoded on the first call,
    its address replaced when out moves. An out address the driver refuses (or one not 16-byte
    aligned, not even asked) launches with o_map_ok = 0 (the kernel then writes O from
    registers), never with the previous call's map: no error, no stale address; the next
    aligned out is encoded again and the flag is 1 again."""
    from cupyflash.core import params, tma
    encoded, replaced = [], []

    def encode(holder, dtype, rank, ptr, dims, strides, box, elem, il, sw, l2, oob):
        if ptr == 0xBAD0:
            return 1  # refused
        ctypes.memmove(holder, ctypes.byref(ctypes.c_uint64(ptr)), 8)
        encoded.append((ptr, list(dims), list(strides), list(box)))
        return 0

    def replace(holder, ptr):
        if ptr == 0xBAD0:
            return 1
        ctypes.memmove(holder, ctypes.byref(ctypes.c_uint64(ptr)), 8)
        replaced.append(ptr)
        return 0
    monkeypatch.setattr(tma, "_encode_fn", lambda: encode)
    monkeypatch.setattr(tma, "_replace_fn", lambda: replace)
    monkeypatch.setattr(launch, "_driver", lambda: type("D", (), {
        "cuGetErrorName": staticmethod(lambda status, out: 0)})())
    seen = []

    def launch_ex(cfg_ref, func, prm, extra):
        s = _struct_of(prm, params.FwdTmaParams)
        seen.append((_map_word(s, "to"), s.o_map_ok, s.fwd.o))
        return 0
    monkeypatch.setattr(launch, "_LAUNCH_EX", launch_ex)
    o_map = ((64, 2, 100, 1), (128, 256, 25600), (64, 1, 64, 1))
    run = _tma_launch(False, o_map)
    for out in (0x2000, 0x2000, 0x3000, 0x3008, 0xBAD0, 0x3000, 0xBAD0, 0x4000):
        run((0xA00, 0xB00, 0xD00, out), 0x77)
    # (where the flag is 0 the map still holds an older address: the kernel does not read it)
    assert seen == [(0x2000, 1, 0x2000), (0x2000, 1, 0x2000), (0x3000, 1, 0x3000),
                    (0x3000, 0, 0x3008), (0x3000, 0, 0xBAD0), (0x3000, 1, 0x3000),
                    (0x3000, 0, 0xBAD0), (0x4000, 1, 0x4000)]
    assert encoded[3] == (0x2000, [64, 2, 100, 1], [128, 256, 25600], [64, 1, 64, 1])
    # out 0x3000 after a refused address: the map is encoded again, not assumed
    assert [e[0] for e in encoded[3:]] == [0x2000, 0x3000, 0x4000]
    assert replaced == [0x3000]


def test_tma_map_layout_and_stride_checks():
    from cupyflash.core import tma
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        tma._MapEncoder((64, 2, 100, 1), (128, 250, 25600), (64, 1, 128, 1))
    with pytest.raises(ValueError, match="rank"):
        tma._MapEncoder((64, 2), (128, 250), (64, 1))


def test_tma_tile_counters_one_per_stream_and_per_thread_on_the_per_thread_stream(monkeypatch):
    """The causal scheduler's counters (cupyflash.core.tma.tile_counter): one per (device, stream),
    made once; on CuPy's per-thread default stream (one handle, a CUDA stream per host thread)
    one per host thread, so that two threads never share one."""
    import threading as th
    from cupyflash.core import tma
    made = []

    class _Arr:
        def __init__(self, ptr):
            self.data = type("P", (), {"ptr": ptr})()

    def new_counter(dev, stream):
        made.append((dev, stream))
        return _Arr(0x1000 + 16 * len(made)), stream != 0x99  # 0x99 plays a capturing stream
    monkeypatch.setattr(tma, "_new_counter", new_counter)
    monkeypatch.setattr(tma, "_COUNTERS", {})
    a, b = tma.tile_counter(0, 0x77), tma.tile_counter(0, 0x78)
    assert a != b and tma.tile_counter(0, 0x77) == a and tma.tile_counter(1, 0x77) not in (a, b)
    here = tma.tile_counter(0, tma._PER_THREAD_STREAM)
    assert tma.tile_counter(0, tma._PER_THREAD_STREAM) == here
    other = []
    t = th.Thread(target=lambda: other.append(tma.tile_counter(0, tma._PER_THREAD_STREAM)))
    t.start()
    t.join()
    assert other[0] != here
    assert made == [(0, 0x77), (0, 0x78), (1, 0x77), (0, 2), (0, 2)]
    # a capturing stream: each captured call gets its own counter, none kept for the stream
    c1, c2 = tma.tile_counter(0, 0x99), tma.tile_counter(0, 0x99)
    assert c1 != c2 and (0, 0x99) not in tma._COUNTERS
    assert made[-2:] == [(0, 0x99), (0, 0x99)]


class _FakeCupy:
    """Just enough of CuPy for cupyflash.core.tma's counter pool: zeros (int32 arrays whose slices
    know their device address), streamIsCapturing (the streams in ``capturing``) and
    Device.synchronize."""

    class _Array:
        def __init__(self, ptr, n):
            self.ptr, self.n = ptr, n
            self.data = type("P", (), {"ptr": ptr})()

        def __getitem__(self, s):
            assert 0 <= s.start < s.stop <= self.n
            return _FakeCupy._Array(self.ptr + 4 * s.start, s.stop - s.start)

    def __init__(self):
        self.capturing, self.pools = set(), []
        fake = self

        class _Runtime:
            class CUDARuntimeError(Exception):
                pass

            @staticmethod
            def streamIsCapturing(s):
                return int(s in fake.capturing)

        class _Device:
            def __init__(self, dev):
                pass

            def synchronize(self):
                pass
        self.cuda = type("cuda", (), {"runtime": _Runtime, "Device": _Device})
        self.int32 = "int32"

    def zeros(self, n, dtype):
        assert dtype == "int32"
        self.pools.append(self._Array(0x10000 * (len(self.pools) + 1), n))
        return self.pools[-1]


def test_tma_counter_pool_slots_and_captures(monkeypatch):
    """cupyflash.core.tma's counter pool with a stand-in CuPy: every slot is handed out once; a
    captured call gets a slot of its own, not kept for its stream; a capture that finds no pool
    raises; and a pool that captured calls used up is made again by the next causal call outside
    a capture, on any stream (what the error message asks for), not only on a new stream."""
    import sys
    from cupyflash.core import tma
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for name, value in (("_COUNTERS", {}), ("_POOLS", {}), ("_CAPTURED", []), ("_REFILL", set())):
        monkeypatch.setattr(tma, name, value, raising=False)
    eager, cap = 0x77, 0x99
    fake.capturing.add(cap)
    with pytest.raises(ValueError, match="outside the capture first"):
        tma.tile_counter(0, cap)  # no pool yet
    seen = [tma.tile_counter(0, eager)]
    assert len(fake.pools) == 1 and tma.tile_counter(0, eager) == seen[0]
    seen += [tma.tile_counter(0, cap) for _ in range(tma._POOL_SLOTS - 1)]
    assert len(set(seen)) == tma._POOL_SLOTS and len(fake.pools) == 1  # each slot once
    assert (0, cap) not in tma._COUNTERS and len(tma._CAPTURED) == tma._POOL_SLOTS - 1
    with pytest.raises(ValueError, match="outside the capture first"):
        tma.tile_counter(0, cap)  # used up
    # the remedy the message gives: one causal call on this device outside the capture
    assert tma.tile_counter(0, eager) == seen[0]
    again = tma.tile_counter(0, cap)
    assert len(fake.pools) == 2 and again not in seen
    # another device's pool is its own
    fake.capturing.discard(cap)
    assert tma.tile_counter(1, eager) not in seen and len(fake.pools) == 3
