"""The prefill kernels compile (NVRTC, no GPU) and the supported table is consistent.

* Every specialisation in ``prefill.all_specs()`` compiles for ``sm_90a`` (the H100/H200 target);
  for ``sm_80`` one specialisation per kernel file is compiled by default, because all of them
  for both architectures take over 2 minutes on 2 cores. ``CUPYFLASH_COMPILE_ALL_ARCHS=1``
  compiles every specialisation for ``sm_80`` too (all had zero spills when the table was set).
  The Hopper TMA kernel (``KernelSpec.arch == "sm_90a"``) is built for sm_90a only.
* Tensor-core specialisations of the supported table have zero spill bytes (the ptxas report),
  and the Hopper kernel never has its wgmma pipeline serialised by ptxas (warnings C7510 / C7513 /
  C7515 / C7520, "serialized");
  every report has a register count; the CUDA-core (float32/float64) reports' spills are
  printed, not asserted.
* The table: names unique, shared memory within 227 KiB and equal to the kernel traits' formula,
  every compiled head dim offered for every dtype, padded head dims, argument packing.
"""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cupyflash.core import jit
from cupyflash.forward import kernels as prefill
from cupyflash.forward import heuristics


def _compile_all(specs, arch):
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        return dict(zip((s.name for s in specs), pool.map(lambda s: jit.compile_report(s, arch), specs)))


@pytest.fixture(scope="module")
def reports():
    specs = prefill.all_specs()
    out = {"sm_90a": _compile_all(specs, "sm_90a")}
    specs80 = [s for s in specs if not s.arch]
    if os.environ.get("CUPYFLASH_COMPILE_ALL_ARCHS") == "1":
        out["sm_80"] = _compile_all(specs80, "sm_80")
    else:
        one_per_file = {}
        for s in specs80:  # the largest-smem causal tile of each file: the hardest to fit
            if s.name.endswith("_causal"):
                cur = one_per_file.get(s.source)
                if cur is None or s.smem_bytes > cur.smem_bytes:
                    one_per_file[s.source] = s
        out["sm_80"] = _compile_all(list(one_per_file.values()), "sm_80")
    return out


def test_every_spec_compiles(reports):
    names = {s.name for s in prefill.all_specs()}
    assert set(reports["sm_90a"]) == names
    assert {s.source for s in prefill.all_specs()} == {prefill.TC_SOURCE, prefill.SIMT_SOURCE,
                                                       prefill.TMA_SOURCE}
    assert len(reports["sm_80"]) >= 2
    assert all(s.arch == "sm_90a" for s in prefill.all_specs() if s.source == prefill.TMA_SOURCE)


def test_wgmma_pipeline_is_not_serialised(reports):
    wg = {n: r for n, r in reports["sm_90a"].items() if n.startswith("fwdtma_")}
    assert wg
    for name, r in wg.items():
        bad = [c for c in ("C7510", "C7513", "C7515", "C7520", "serialized") if c in r.log]
        assert not bad, f"{name}: ptxas serialised the wgmma pipeline ({bad}):\n{r.log}"


# Spills accepted, each with its bound (stores, loads in bytes) and why: none. (The TMA kernel at
# hd128 causal spilled 16/28 bytes until its masked softmax step derived the rows' key bounds
# from an opaque row0 instead of keeping them hoisted across the key loop: forward/hopper.cu.)
KNOWN_SPILLS: dict = {}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_tensor_core_specs_do_not_spill(reports, arch):
    supported = {s.name for s in prefill.all_specs()}
    lines, spilled = [], []
    for name, r in sorted(reports[arch].items()):
        p = r.ptxas
        assert 0 < p.registers <= 255, name
        lines.append(f"{arch} {name:44s} regs={p.registers:3d} spill={p.spill_stores}/{p.spill_loads}"
                     f" stack={p.stack_bytes}")
        if name in KNOWN_SPILLS:
            stores, loads = KNOWN_SPILLS[name]
            assert p.spill_stores <= stores and p.spill_loads <= loads, lines[-1]
        elif name.startswith("fwd") and not name.startswith("fwdsimt") and p.spill_bytes \
                and name in supported:
            spilled.append(lines[-1])
    print("\n".join(lines))
    assert not spilled, "tensor-core specialisations spill:\n" + "\n".join(spilled)


def test_tma_kernels_get_exactly_the_registers_setmaxnreg_moves(reports):
    """forward/hopper.cu's setmaxnreg split assumes the launch gives each thread the register
    file over the CTA's threads in steps of 8 (168 at 384 threads, 128 at 512): with fewer, the
    consumers' setmaxnreg.inc waits forever (an H200 hang on 2026-12-01,
    run 5 at b144eb7: experiments/notes/2026-12-01_1819_87feb9d.md)."""
    tma = [s for s in prefill.all_specs() if s.name.startswith("fwdtma_")]
    assert {prefill.config_of(s)[0].threads for s in tma} == {384, 512}
    for s in tma:
        threads = prefill.config_of(s)[0].threads
        assert reports["sm_90a"][s.name].ptxas.registers == 65536 // threads // 8 * 8, s.name


def test_table_is_consistent():
    specs = prefill.all_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) == 2 * len(prefill.SUPPORTED)
    keys = [(c.dtype, c.headdim, c.block_m, c.block_n, c.nwarps, c.isa) for c in prefill.SUPPORTED]
    assert len(keys) == len(set(keys))
    for c in prefill.SUPPORTED:
        assert c.smem_bytes <= prefill.MAX_SMEM_BYTES, c
        assert c.headdim in prefill.HEADDIMS
        if c.isa == "tma":  # a producer warpgroup and block_m / 64 consumer warpgroups
            assert c.source == prefill.TMA_SOURCE and c.dtype in prefill.TC_DTYPES
            assert c.nwarps == 4 * (c.block_m // 64 + 1) and c.headdim in (64, 128, 256)
            assert c.arch == "sm_90a"
        elif c.dtype in prefill.TC_DTYPES:
            assert c.isa == "mma" and c.arch == ""
            assert c.source == prefill.TC_SOURCE
            assert c.block_m % (16 * c.nwarps) == 0 and c.block_m // (16 * c.nwarps) in (1, 2)
            assert c.block_n % 16 == 0
        else:
            assert c.source == prefill.SIMT_SOURCE and c.nwarps == 4
            assert c.block_m % 16 == 0 and c.block_n % 8 == 0
    # every compiled head dim has a row per dtype (float64 hd160-224 one: the others were never
    # chosen, tests/test_dispatch.py test_table_has_no_unreachable_row)
    for dtype in prefill.TC_DTYPES + prefill.SIMT_DTYPES:
        for hd in prefill.HEADDIMS:
            assert any(c.dtype == dtype and c.headdim == hd for c in prefill.SUPPORTED), (dtype, hd)


def test_table_names_and_options_are_consistent():
    rows = prefill.SUPPORTED
    names = [s.name for s in prefill.all_specs()]
    assert len(names) == len(set(names)) == 2 * len(rows)
    for c in rows:
        tile = (c.headdim, c.block_m, c.block_n, c.nwarps)
        assert c.prefetch == (c.isa == "mma" and tile in prefill._TC_PREFETCH), c
        assert c.stages == 2, c  # tma: 3 measured slower (v52)
        for causal in (False, True):
            spec = prefill.kernel_spec(c.dtype, c.headdim, c.block_m, c.block_n, c.nwarps, causal,
                                       isa=c.isa)
            assert prefill.config_of(spec) == (c, causal)
            assert spec.name.endswith("_pf" + ("_causal" if causal else "")) == c.prefetch


def test_hd96_hd128_default_is_the_measured_fastest_v1_tile():
    # v1 H200 sweep (experiments/NOTES.md): hd128 128x64x4 315-321 TFLOP/s vs 295-299 for
    # 128x32x4; hd96 128x64x4 297-304 vs 234-242 for 128x64x8
    # (the mma.sync rows; on sm_90a the TMA rows come first, see test_tma_rows_lead_on_sm90a)
    from cupyflash.forward import heuristics
    for hd in (96, 128):
        for dtype in ("bfloat16", "float16"):
            tiles = heuristics.prefill_tiles(dtype, hd, "sm_80")
            assert tiles[0] == (128, 64, 4, "mma")
            for causal in (False, True):
                assert heuristics.choose_prefill_tile(dtype, hd, 4096, 4096, causal,
                                                      batch_nheads=64, tiles=tiles) == tiles[0]


def test_tma_rows_lead_on_sm90a():
    from cupyflash.forward import heuristics
    for hd, tile in ((128, (128, 128, 12, "tma")), (64, (192, 128, 16, "tma")),
                     (256, (128, 80, 12, "tma"))):
        for dtype in ("bfloat16", "float16"):
            assert heuristics.prefill_tiles(dtype, hd)[0] == tile
            for causal in (False, True):
                assert heuristics.choose_prefill_tile(dtype, hd, 4096, 4096, causal,
                                                      batch_nheads=64) == tile
    # rule 3b: hd64 causal with keys up to 1024 takes the 128-row tile; non-causal keeps 192
    for sk, causal, rows in ((1024, True, 128), (1025, True, 192), (1024, False, 192)):
        assert heuristics.choose_prefill_tile("bfloat16", 64, 4096, sk, causal,
                                              batch_nheads=64)[:1] == (rows,), (sk, causal)


def test_layout_constants_come_from_the_kernels():
    """Shared memory and the O-store flag of every row are the kernels' own layout constants
    (HopperFwdSmem, FwdTraits, SimtTraits), read by an NVRTC probe: within sm_90's limit, the
    same numbers in every spec, and the TMA rows' epilogues as designed (O buffers at hd64 and
    hd128, the V ring at hd256: there kOStore is false and kOInV true)."""
    for c in prefill.SUPPORTED:
        assert 0 < c.smem_bytes <= prefill.MAX_SMEM_BYTES, c
        assert prefill.layout(c) == (c.smem_bytes, int(c.o_store))
        for causal in (False, True):
            assert prefill.spec_of(c, causal).smem_bytes == c.smem_bytes
    assert [(c.headdim, c.block_m, c.o_store) for c in prefill.SUPPORTED
            if c.isa == "tma" and c.dtype == "float16"] == [(64, 192, True), (64, 128, True),
                                                             (128, 128, True), (256, 128, True)]
    assert not any(c.o_store for c in prefill.SUPPORTED if c.isa != "tma")
    smem = "cf::HopperFwdSmem<cf::HopperFwdTraits<__half, {}, 128, {}>>"
    assert jit.constants(prefill.TMA_SOURCE, tuple(
        f"{smem.format(hd, bn)}::{k}" for hd, bn in ((128, 128), (256, 80))
        for k in ("kOStore", "kOInV"))) == (1, 0, 0, 1)
    # a tile outside the table gets its own probe (the tile benchmark's)
    extra = prefill.PrefillConfig("float16", 128, 128, 64, 8, prefill.TC_SOURCE)
    assert extra not in prefill.SUPPORTED and prefill.layout(extra)[0] > 0


def test_names_and_entries():
    s = prefill.kernel_spec("bfloat16", 160, 128, 64, 8, True)
    assert s.name == "fwd_bf16_hd160_m128_n64_w8_causal"
    assert s.entry == "cf::flash_fwd_entry<cf::FlashFwd<__nv_bfloat16, 160, 128, 64, 8, true>, __nv_bfloat16>"
    s = prefill.kernel_spec("float16", 128, 128, 64, 4, False)
    assert s.name == "fwd_f16_hd128_m128_n64_w4_pf"
    assert s.entry == "cf::flash_fwd_entry<cf::FlashFwd<__half, 128, 128, 64, 4, false, true>, __half>"
    assert s.smem_bytes == prefill.config_of(s)[0].smem_bytes > 0
    with pytest.raises(ValueError, match="not compiled"):
        prefill.kernel_spec("bfloat16", 128, 128, 48, 4, False)
    s = prefill.kernel_spec("float64", 64, 32, 32, 4, False)
    assert s.name == "fwdsimt_f64_hd64_m32_n32"
    assert s.entry == "cf::flash_fwd_entry<cf::FlashFwdSimt<double, 64, 32, 32, false>, double>"
    assert prefill.config_of(s) == (prefill.SUPPORTED[[c.dtype == "float64" and c.headdim == 64
                                                       and c.block_m == 32 for c in prefill.SUPPORTED]
                                                      .index(True)], False)
    with pytest.raises(ValueError, match="not compiled"):
        prefill.kernel_spec("bfloat16", 128, 256, 64, 4, False)


@pytest.mark.parametrize("d,hp", [(8, 32), (32, 32), (40, 64), (64, 64), (72, 96), (128, 128),
                                  (136, 160), (200, 224), (248, 256), (256, 256)])
def test_padded_headdim(d, hp):
    assert prefill.padded_headdim(d) == hp == prefill.padded_headdim(d, "mma") \
        == prefill.padded_headdim(d, "simt")


@pytest.mark.parametrize("d,hp", [(8, 64), (40, 64), (64, 64), (72, 128), (96, 128), (128, 128),
                                  (136, 256), (192, 256), (256, 256)])
def test_padded_headdim_of_the_tma_kernel(d, hp):
    """Issue 23, item 1: every multiple of 8 up to 256 runs on the Hopper kernel, padded onto
    FlashAttention-3's head dims 64, 128, 256."""
    assert prefill.padded_headdim(d, "tma") == hp


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("d", range(8, 257, 8))
def test_configs_for_every_head_dim(dtype, d):
    """Each instruction set's rows at its own padded head dim, the TMA rows first (the sm_90a
    default) above hd32; the tile heuristic's candidates are these rows."""
    rows = prefill.configs_for(dtype, d)
    assert rows and all(c.dtype == dtype and c.headdim == prefill.padded_headdim(d, c.isa)
                        for c in rows)
    order = prefill.ISAS if d > prefill.TMA_FIRST_ABOVE else ("mma", "tma", "simt")
    want = [c for isa in order for c in prefill.SUPPORTED if c.dtype == dtype
            and c.isa == isa and c.headdim == prefill.padded_headdim(d, isa)]
    assert list(rows) == want
    isas = [c.isa for c in rows]
    assert isas == sorted(isas, key=order.index)
    assert ("tma" in isas) == (dtype in prefill.TC_DTYPES)
    if dtype in prefill.TC_DTYPES:  # hd <= 32: the mma.sync hd32 rows first (measured faster)
        assert isas[0] == ("tma" if d > 32 else "mma")
    assert heuristics.prefill_tiles(dtype, d)[0] == (
        (rows[0].block_m, rows[0].block_n, rows[0].nwarps, rows[0].isa))
    assert all(t[3] != "tma" for t in heuristics.prefill_tiles(dtype, d, "sm_80"))


@pytest.mark.parametrize("d", [0, 4, 12, 257, 264, -8, 64.0, True])
def test_padded_headdim_rejects(d):
    with pytest.raises(ValueError, match="^headdim"):
        prefill.padded_headdim(d)
    with pytest.raises(ValueError, match="^headdim"):
        prefill.padded_headdim(d, "tma")
    with pytest.raises(ValueError, match="^headdim"):
        prefill.configs_for("bfloat16", d)


@pytest.mark.parametrize("d,first,rest", [(72, "fwdtma_bf16_hd128_", "fwd_bf16_hd96_"),
                                          (200, "fwdtma_bf16_hd256_", "fwd_bf16_hd224_"),
                                          (120, "fwdtma_bf16_hd128_", "fwd_bf16_hd128_"),
                                          (24, "fwd_bf16_hd32_", None)])
def test_configs_for_names_the_kernels_that_run_a_head_dim(d, first, rest):
    """Spelled out: hd72 runs TMA hd128 then mma.sync hd96; hd200 TMA hd256 then mma.sync hd224;
    hd24 mma.sync hd32 first (TMA hd64's two tiles after them, 192 rows first)."""
    names = [prefill.spec_of(c, False).name for c in prefill.configs_for("bfloat16", d)]
    tma = [n for n in names if n.startswith("fwdtma")]
    if rest is not None:
        assert names[0].startswith(first) and len(tma) == 1
        assert all(n.startswith(rest) for n in names[1:]), names
    else:
        assert names[0].startswith(first)
        assert tma == names[-2:] == ["fwdtma_bf16_hd64_m192_n128_s2", "fwdtma_bf16_hd64_m128_n128_s2"]
        assert all(n.startswith(first) for n in names[:-2]), names


def test_padded_headdim_rejects_an_unknown_isa():
    with pytest.raises(ValueError, match="^isa"):
        prefill.padded_headdim(64, "wgmma")


class _Fake:
    """Shape/strides/dtype/pointer of a device array, enough for kernel_params (no GPU)."""

    class _Data:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, shape, dtype, strides=None, ptr=0x10000):
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.ndim = len(shape)
        if strides is None:
            strides, acc = [], self.dtype.itemsize
            for n in reversed(shape):
                strides.append(acc)
                acc *= n
            strides = tuple(reversed(strides))
        self.strides = tuple(strides)
        self.data = self._Data(ptr)


def _problem(**kw):
    from cupyflash.core.checks import AttnProblem
    base = dict(batch=2, seqlen_q=100, seqlen_k=300, nheads=8, nheads_k=2, headdim=120,
                dtype="float16", softmax_scale=0.125, causal=True, window_size=(16, 0))
    base.update(kw)
    return AttnProblem(**base)


def test_kernel_params_dense():
    p = _problem()
    spec = prefill.kernel_spec("float16", 128, 128, 64, 4, True)
    q = _Fake((2, 100, 8, 120), np.float16, ptr=0x10000)
    k = _Fake((2, 300, 2, 120), np.float16, ptr=0x20000)
    # v: a strided view (rows padded to 2 * 136 elements)
    v = _Fake((2, 300, 2, 120), np.float16, strides=(300 * 272 * 2, 272 * 2, 136 * 2, 2),
              ptr=0x30000)
    out = _Fake((2, 100, 8, 120), np.float16, ptr=0x40000)
    lse = _Fake((2, 8, 100), np.float32, ptr=0x50000)
    a = prefill.kernel_params(spec, q, k, v, out, lse, problem=p)
    assert [getattr(a, n) for n in prefill.POINTERS] == [0x10000, 0x20000, 0x30000, 0x40000,
                                                         0x50000, 0, 0]  # NULL cu_seqlens
    strides = [a.q_batch_stride, a.q_row_stride, a.q_head_stride, a.k_batch_stride,
               a.k_row_stride, a.k_head_stride, a.v_batch_stride, a.v_row_stride,
               a.v_head_stride, a.o_batch_stride, a.o_row_stride, a.o_head_stride,
               a.lse_batch_stride, a.lse_head_stride]
    assert strides == [100 * 960, 960, 120, 300 * 240, 240, 120, 300 * 272, 272, 136,
                       100 * 960, 960, 120, 800, 100]
    assert [a.batch, a.nheads, a.nheads_k, a.h_per_kv, a.seqlen_q, a.seqlen_k, a.headdim] == \
        [2, 8, 2, 4, 100, 300, 120]
    assert abs(a.scale_log2 - 0.125 * np.log2(np.e)) < 1e-7 and a.softmax_scale_d == 0.125
    assert [a.window_left, a.window_right] == [16, 0]
    grid, block, smem = prefill.launch_config(spec, p)
    assert grid == (1, 8, 2) and block == (128, 1, 1) and smem == spec.smem_bytes


def test_kernel_params_varlen_and_checks():
    p = _problem(varlen=True, batch=3, total_q=50, total_k=90, causal=False, window_size=(-1, -1),
                 dtype="float64", seqlen_q=30, seqlen_k=40)
    spec = prefill.kernel_spec("float64", 128, 32, 32, 4, False)
    q = _Fake((50, 8, 120), np.float64)
    k = _Fake((90, 2, 120), np.float64)
    v = _Fake((90, 2, 120), np.float64)
    out = _Fake((50, 8, 120), np.float64)
    lse = _Fake((8, 50), np.float64)  # the float64 forward's LSE is float64
    cu_q, cu_k = _Fake((4,), np.int32, ptr=0x60000), _Fake((4,), np.int32, ptr=0x70000)
    a = prefill.kernel_params(spec, q, k, v, out, lse, problem=p, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k)
    assert [a.q_batch_stride, a.q_row_stride, a.q_head_stride, a.k_batch_stride,
            a.v_batch_stride, a.o_batch_stride, a.lse_batch_stride, a.lse_head_stride] == \
        [0, 960, 120, 0, 0, 0, 0, 50]
    assert (a.cu_seqlens_q, a.cu_seqlens_k) == (0x60000, 0x70000)
    assert prefill.launch_config(spec, p)[0] == (1, 8, 3)
    # spec / problem disagreement and misalignment are refused
    with pytest.raises(ValueError, match="causal"):
        prefill.kernel_params(prefill.kernel_spec("float64", 128, 32, 32, 4, True), q, k, v, out,
                              lse, problem=p, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_q, cu_seqlens_k"):
        prefill.kernel_params(spec, q, k, v, out, lse, problem=p, cu_seqlens_q=cu_q)
    with pytest.raises(ValueError, match="lse: a float64 forward writes a float64 LSE"):
        prefill.kernel_params(spec, q, k, v, out, _Fake((8, 50), np.float32), problem=p,
                              cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    p16 = _problem()
    spec16 = prefill.kernel_spec("float16", 128, 128, 64, 4, True)
    qd = _Fake((2, 100, 8, 120), np.float16, ptr=0x10002)
    with pytest.raises(ValueError, match="^q: .*16-byte"):
        prefill.kernel_params(spec16, qd, _Fake((2, 300, 2, 120), np.float16),
                              _Fake((2, 300, 2, 120), np.float16),
                              _Fake((2, 100, 8, 120), np.float16),
                              _Fake((2, 8, 100), np.float32), problem=p16)


def test_tma_maps_of_dense_and_varlen_problems():
    """The TMA kernel's q, k, v tensor maps (cupyflash.core.tma.qkv_maps_layout from args_template's
    strides): dense, 4-D (headdim, heads, seqlen, batch) in bytes; varlen, the packed tokens as
    one batch entry (rows = total_q / total_k; the kernel's row coordinates start at
    cu_seqlens), whose batch stride (0 in the kernel's arguments) is replaced by one TMA
    accepts. Boxes: 64 columns x 1 head x block_m (q) or block_n (k, v) rows."""
    from cupyflash.core import tma
    spec = prefill.kernel_spec("float16", 128, 128, 128, 12, False, isa="tma")
    p = _problem(causal=False, window_size=(-1, -1))  # batch 2, sq 100, sk 300, heads 8 / 2, d 120
    arrays = [_Fake((2, n, h, 120), np.float16) for n, h in ((100, 8), (300, 2), (300, 2), (100, 8))]
    strides, _ = prefill.args_template(spec, *arrays, (800, 100, 1), problem=p, varlen=False)
    assert tma.qkv_maps_layout(p, strides, 128, 128) == (
        ((120, 8, 100, 2), (240, 1920, 192000), (64, 1, 128, 1)),
        ((120, 2, 300, 2), (240, 480, 144000), (64, 1, 128, 1)),
        ((120, 2, 300, 2), (240, 480, 144000), (64, 1, 128, 1)))
    pv = _problem(varlen=True, batch=3, total_q=50, total_k=90, causal=False,
                  window_size=(-1, -1), seqlen_q=30, seqlen_k=40)
    arrays = [_Fake((n, h, 120), np.float16) for n, h in ((50, 8), (90, 2), (90, 2), (50, 8))]
    strides, _ = prefill.args_template(spec, *arrays, (50, 1), problem=pv, varlen=True)
    assert tma.qkv_maps_layout(pv, strides, 128, 128) == (
        ((120, 8, 50, 1), (240, 1920, 50 * 1920), (64, 1, 128, 1)),
        ((120, 2, 90, 1), (240, 480, 90 * 480), (64, 1, 128, 1)),
        ((120, 2, 90, 1), (240, 480, 90 * 480), (64, 1, 128, 1)))
    assert prefill.launch_config(spec, pv)[0] == (3 * 8 * 1, 1, 1)  # work tiles: m-blocks of 30


def test_tma_o_map_of_dense_problems_and_its_fallbacks():
    """The O map of the TMA epilogue (cupyflash.core.tma.o_map_layout): encoded like q's, with
    out's strides and a box of 64 columns x 1 head x 64 rows (one consumer warpgroup) x 1;
    None, i.e. O written from registers, for varlen problems and for out strides a tensor map
    refuses (negative, zero, not multiples of 16 bytes), never a map that would write elsewhere."""
    from cupyflash.core import tma
    spec = prefill.kernel_spec("float16", 128, 128, 128, 12, False, isa="tma")
    p = _problem(causal=False, window_size=(-1, -1))  # batch 2, sq 100, sk 300, heads 8 / 2, d 120
    qkv = [_Fake((2, n, h, 120), np.float16) for n, h in ((100, 8), (300, 2), (300, 2))]

    def o_map(out, problem=p):
        strides, _ = prefill.args_template(spec, *qkv, out, (800, 100, 1), problem=problem,
                                           varlen=False)
        return tma.o_map_layout(problem, strides)
    assert o_map(_Fake((2, 100, 8, 120), np.float16)) == \
        ((120, 8, 100, 2), (240, 1920, 192000), (64, 1, 64, 1))
    # out inside a larger buffer (heads 9, head dim 136): its strides, the view's dims (TMA
    # writes no column past 120 and no row past 100 of the view)
    big = _Fake((2, 100, 8, 120), np.float16, strides=(100 * 9 * 136 * 2, 9 * 136 * 2, 136 * 2, 2))
    assert o_map(big) == ((120, 8, 100, 2), (272, 9 * 272, 100 * 9 * 272), (64, 1, 64, 1))
    # reversed rows (a negative stride): refused, registers
    rev = _Fake((2, 100, 8, 120), np.float16, strides=(192000, -1920, 240, 2))
    assert o_map(rev) is None
    # a batch of one takes a batch stride TMA accepts (as q's); a zero row stride does not
    p1 = _problem(batch=1, seqlen_q=1, causal=False, window_size=(-1, -1))
    qkv = [_Fake((1, n, h, 120), np.float16) for n, h in ((1, 8), (300, 2), (300, 2))]
    assert o_map(_Fake((1, 1, 8, 120), np.float16, strides=(0, 1920, 240, 2)), p1) == \
        ((120, 8, 1, 1), (240, 1920, 1920), (64, 1, 64, 1))
    assert o_map(_Fake((1, 1, 8, 120), np.float16, strides=(0, 0, 240, 2)), p1) is None
    pv = _problem(varlen=True, batch=3, total_q=50, total_k=90, causal=False,
                  window_size=(-1, -1), seqlen_q=30, seqlen_k=40)
    arrays = [_Fake((n, h, 120), np.float16) for n, h in ((50, 8), (90, 2), (90, 2), (50, 8))]
    strides, _ = prefill.args_template(spec, *arrays, (50, 1), problem=pv, varlen=True)
    assert tma.o_map_layout(pv, strides) is None


@pytest.mark.parametrize("hd,varlen,reversed_out,want", [
    (128, False, False, True), (64, False, False, True), (256, False, False, True),
    (128, True, False, False), (128, False, True, False)])
def test_tma_prepared_launch_passes_an_o_map_where_the_kernel_may_use_it(
        monkeypatch, hd, varlen, reversed_out, want):
    """prefill.prepared_launch gives the launch's PrefillMaps an O map for dense problems (every
    TMA row: O buffers at hd64 / hd128, the V ring at hd256) whose out strides a map accepts;
    else none (o_map_ok = 0)."""
    from cupyflash.core import launch, tma
    got = {}

    class _Maps:
        def __init__(self, maps, o_map=None, **kw):
            got.update(o_map=o_map, **kw)

    class _Launch:
        def __init__(self, kernel, params, grid, block, **kw):
            got.update(params=params, **kw)
    monkeypatch.setattr(tma, "PrefillMaps", _Maps)
    monkeypatch.setattr(launch, "Launch", _Launch)
    bn = 80 if hd == 256 else 128
    spec = prefill.kernel_spec("float16", hd, 128, bn, 12, False, isa="tma")
    if varlen:
        p = _problem(varlen=True, batch=3, total_q=50, total_k=90, causal=False,
                     window_size=(-1, -1), seqlen_q=30, seqlen_k=40, headdim=hd)
        arrays = [_Fake((n, h, hd), np.float16) for n, h in ((50, 8), (90, 2), (90, 2), (50, 8))]
        ls = (50, 1)
    else:
        p = _problem(causal=False, window_size=(-1, -1), headdim=hd)
        arrays = [_Fake((2, n, h, hd), np.float16) for n, h in
                  ((100, 8), (300, 2), (300, 2), (100, 8))]
        if reversed_out:
            arrays[3] = _Fake((2, 100, 8, hd), np.float16,
                              strides=(100 * 8 * hd * 2, -8 * hd * 2, hd * 2, 2))
        ls = (800, 100, 1)
    strides, sizes = prefill.args_template(spec, *arrays, ls, problem=p, varlen=varlen)
    prefill.prepared_launch(spec, None, (1, 1, 1), (384, 1, 1), 1024, p, strides, sizes, 0)
    assert (got["o_map"] is not None) == want
    if want:
        assert got["o_map"][2] == (64, 1, 64, 1) and got["o_map"][0] == (hd, 8, 100, 2)
    # the struct: FwdTmaParams with the forward's constant fields; the pointer block is its q..
    assert got["params"].fwd.headdim == hd and got["params"].fwd.nheads == 8
    from cupyflash.core.params import FwdTmaParams
    assert got["pointers"] == (FwdTmaParams.fwd.offset, 7)
    assert isinstance(got["prepare"], _Maps)


