"""The backward kernels compile (NVRTC, no GPU), their plan and launch geometry, and the
backward call's argument checks (before any launch).

* Every backward kernel a call can run (``kernels.all_kernels()``: each dtype, compiled head dim
  and causal flag) compiles for ``sm_90a``; the tensor-core ones (fp16/bf16) have zero spill
  bytes, the CUDA-core ones spill at most 64 bytes (float64 hd > 128 dK/dV: 64, printed), and the
  shared memory of each fits 227 KiB and equals its traits' constant.
* Plans: mma.sync for 16-bit dtypes with dK/dV in one launch up to hd128 and two above;
  CUDA cores for float32/float64; names are unique.
* The Hopper plan (``hopper=True``): dsum, the TMA kernel (one CTA of 384 threads per 128 keys),
  the dq conversion; its shared memory, parameter struct and tensor maps; on unless
  ``CUPYFLASH_BWD_HOPPER=0``.
"""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cupyflash.backward import kernels
from cupyflash.core import checks, jit

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


@pytest.fixture(scope="module")
def reports():
    ks = kernels.all_kernels()
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        return dict(zip(ks, pool.map(lambda k: jit.compile_report(k.spec, "sm_90a"), ks)))


def test_every_backward_kernel_compiles_without_spills(reports):
    assert len(reports) == len(kernels.all_kernels()) > 60
    for k, r in reports.items():
        assert r.ptxas.registers > 0, k.name
        if k.isa in ("mma", "tma") or k.role == "dsum":
            assert r.ptxas.spill_bytes == 0, (k.name, r.ptxas)
        else:
            assert r.ptxas.spill_bytes <= 64, (k.name, r.ptxas)
            if r.ptxas.spill_bytes:
                print(k.name, "spills", r.ptxas.spill_bytes, "bytes")
        assert k.smem_bytes <= 227 * 1024, k.name


def test_shared_memory_is_the_traits_constant():
    k = kernels.plan_backward("bfloat16", 128, False).dkdv[0]
    # BwdMmaTraits<bf16, 128, ROWS = 128 keys, COLS = 32 query rows>: K and V, Q and dO twice
    # (double-buffered), rows of 136 elements, and two float rows (LSE, D) per stage
    assert (k.block_m, k.block_n) == (32, 128)
    assert k.smem_bytes == (2 * 128 + 2 * 2 * 32) * 136 * 2 + 2 * 2 * 4 * 32
    s = kernels.plan_backward("float64", 64, True).dq
    assert s.smem_bytes == (2 * 32 * 66 + 2 * 32 * 66 + 32 * 34 + 64) * 8


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("d", [8, 40, 64, 72, 128, 136, 200, 256])
def test_plans(dtype, d):
    plan = kernels.plan_backward(dtype, d, True)
    hd = plan.dq.headdim
    assert hd == min(h for h in (32, 64, 128, 256) if h >= d)
    assert [k.role for k in plan.kernels] == ["dsum"] + ["dkdv"] * len(plan.dkdv) + ["dq"]
    if dtype in ("float16", "bfloat16"):
        assert {k.isa for k in plan.kernels} == {"mma"}
        assert [k.part for k in plan.dkdv] == ([0] if hd <= 128 else [1, 2])
    else:
        assert {k.isa for k in plan.kernels} == {"simt"}
    assert all(k.causal for k in plan.dkdv + (plan.dq,))
    names = [k.name for k in kernels.all_kernels()]
    assert len(names) == len(set(names))


def test_launch_geometry_dense_and_gqa():
    q = np.empty((3, 1000, 8, 128), np.float16)
    k = np.empty((3, 700, 2, 128), np.float16)
    p = checks.check_attention(q, k, k, causal=True)
    plan = kernels.plan_backward("float16", 128, True)
    assert kernels.launch_geometry(plan.dsum, p) == ((63, 8, 3), (128, 1, 1))
    assert kernels.launch_geometry(plan.dkdv[0], p) == ((6, 2, 3), (256, 1, 1))  # KV heads
    assert kernels.launch_geometry(plan.dq, p) == ((8, 8, 3), (256, 1, 1))


def test_params_fields_and_pointer_block():
    q = np.empty((2, 10, 4, 64), np.float32)
    k = np.empty((2, 12, 2, 64), np.float32)
    p = checks.check_attention(q, k, k, window_size=(3, 2))
    st = {n: (2560, 256, 64, 1) for n in ("q", "out", "dout", "dq")}
    st.update({n: (1536, 128, 64, 1) for n in ("k", "v", "dk", "dv")})
    st["lse"], st["dsum"] = (40, 10, 1), (40, 10, 1)
    prm = kernels.params_of(kernels.bwd_fields(p, st, False))
    assert (prm.fwd.h_per_kv, prm.fwd.window_left, prm.fwd.window_right) == (2, 3, 2)
    assert (prm.dk_batch_stride, prm.dk_row_stride, prm.dsum_head_stride) == (1536, 128, 10)
    assert kernels.pointer_block() == (0, 13)


def test_check_backward_names_the_argument():
    q = np.zeros((2, 10, 4, 64), np.float32)
    k = np.zeros((2, 12, 2, 64), np.float32)
    p = checks.check_attention(q, k, k)
    lse = np.zeros((2, 4, 10), np.float32)
    checks.check_backward(p, q, k, q, q, lse)
    with pytest.raises(ValueError, match="dout: expected shape"):
        checks.check_backward(p, q, k, q[:, :9], q, lse)
    with pytest.raises(TypeError, match="dout: dtype float64"):
        checks.check_backward(p, q, k, q.astype(np.float64), q, lse)
    with pytest.raises(ValueError, match="lse: expected shape"):
        checks.check_backward(p, q, k, q, q, lse[:, :3])
    with pytest.raises(TypeError, match="lse: expected dtype float32"):
        checks.check_backward(p, q, k, q, q, lse.astype(np.float64))
    with pytest.raises(ValueError, match="dk: expected shape"):
        checks.check_backward(p, q, k, q, q, lse, dk=q)
    with pytest.raises(TypeError, match="lse: required"):
        checks.check_backward(p, q, k, q, q, None)
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    p64 = checks.check_attention(q64, k64, k64)
    checks.check_backward(p64, q64, k64, q64, q64, lse.astype(np.float64))  # float64 LSE


def test_backward_refuses_host_arrays_before_any_launch():
    import cupyflash
    q = np.zeros((1, 4, 1, 8))
    with pytest.raises(TypeError, match="dout: expected a CUDA array"):
        cupyflash.flash_attn_backward(q, q, q, q, q, np.zeros((1, 1, 4)))
    with pytest.raises(TypeError, match="deterministic: expected a bool"):
        cupyflash.flash_attn_backward(q, q, q, q, q, np.zeros((1, 1, 4)), deterministic="yes")


def test_torch_callers_that_need_grad_go_through_the_operator():
    """requires_grad routes the call to the custom operator (whose backward is registered):
    CPU tensors then fail inside it with the device error, ``out=`` is refused, and under
    no_grad the plain path runs (the same device error, from the eager call)."""
    torch = pytest.importorskip("torch")
    import cupyflash
    from cupyflash import api, torch_ops
    q = torch.zeros(1, 4, 1, 8, requires_grad=True)
    assert api._grad_wanted(q, q, q, None) is True
    with torch.no_grad():
        assert api._grad_wanted(q, q, q, None) is False
    assert api._grad_wanted(q.detach(), q.detach(), q.detach(), None) is False
    with pytest.raises(ValueError, match="out: not allowed when q, k or v requires grad"):
        cupyflash.flash_attn_func(q, q, q, out=torch.zeros(1, 4, 1, 8))
    with pytest.raises(TypeError, match="q: expected a CUDA array"):
        cupyflash.flash_attn_func(q, q, q)
    # the fake (meta) implementations give the gradients' shapes and the LSE's dtype
    k = torch.zeros(1, 6, 1, 8, dtype=torch.float64)
    dq, dk, dv = torch_ops._flash_attn_backward_fake(None, q, k, k, None, None, None, False, -1,
                                                     -1, False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    _, lse = torch_ops._flash_attn_fake(k, k, k, None, False, -1, -1)
    assert lse.dtype == torch.float64 and lse.shape == (1, 1, 6)
    assert torch_ops._grad_out(None, k).shape == k.shape
    g = torch.ones(1, 1, 1, 1).expand(1, 6, 1, 8)  # the expanded gradient of out.sum()
    assert torch_ops._grad_out(g, k).stride(-1) == 1


def test_tensor_core_layout_check_names_the_array():
    """The backward's mma.sync kernels read 16-byte chunks: a base off a 16-byte boundary or a
    row stride that is no multiple of 8 elements is refused before any launch, naming it."""
    from cupyflash.core.interop import ArrayDesc
    from cupyflash.forward import kernels as fwd
    ok = ArrayDesc(0x1000, (2, 10, 4, 64), (2560, 256, 64, 1), "bfloat16", 0)
    fwd.check_tensor_core_layout({"q": ok, "dq": None})
    off = ArrayDesc(0x1002, (2, 10, 4, 64), (2560, 256, 64, 1), "bfloat16", 0)
    with pytest.raises(ValueError, match="^dout: .*16-byte aligned base"):
        fwd.check_tensor_core_layout({"q": ok, "dout": off})
    odd = ArrayDesc(0x1000, (2, 10, 4, 60), (2400, 240, 60, 1), "bfloat16", 0)
    with pytest.raises(ValueError, match="^dk: .*multiples of 8"):
        fwd.check_tensor_core_layout({"dk": odd})


def test_hopper_plan_geometry_and_shared_memory():
    q = np.empty((3, 1000, 8, 72), np.float16)
    k = np.empty((3, 700, 2, 72), np.float16)
    p = checks.check_attention(q, k, k, causal=True)
    plan = kernels.plan_backward("float16", 72, True, hopper=True)
    assert [x.role for x in plan.kernels] == ["dsum", "dkdv", "dq"]
    main, conv = plan.dkdv[0], plan.dq
    assert (main.isa, main.headdim, main.block_m, main.block_n, main.causal) == ("tma", 128, 64, 128, True)
    assert main.spec.arch == conv.spec.arch == "sm_90a"
    assert main.takes_maps and not conv.takes_maps and not plan.dsum.takes_maps
    assert kernels.launch_geometry(main, p) == ((6, 2, 3), (384, 1, 1))   # key blocks, KV heads
    assert kernels.launch_geometry(conv, p) == ((16, 8, 3), (256, 1, 1))  # a 64-row dQ tile per CTA
    # the pre-pass: one CTA of 4 warps per 64-row query block, into (batch, heads, blocks, 128),
    # padded to a multiple of 128 rows (1000 -> 1024)
    prep = plan.dsum
    assert (prep.name, prep.entry, prep.spec.arch) == (
        "bwdtma_prep_f16", "cf::bwd_hopper_prep_entry<__half, 128>", "sm_90a")
    assert kernels.launch_geometry(prep, p) == ((16, 8, 3), (128, 1, 1))
    assert kernels.stats_shape(p) == (3, 8, 16, 128)
    # K, V (128 x 128), three Q and dO slots (64 x 128), two dS^T buffers (128 x 64), three
    # slots of row statistics (64 LSE, 64 D floats), the fp32 dQ tile (64 x 128), seven
    # mbarriers (K / V, and full and empty per slot), 1024 bytes of alignment: 456 bytes below
    # the 227 KiB a CTA may have
    assert main.smem_bytes == ((2 * 128 * 128 + 3 * 2 * 64 * 128 + 2 * 128 * 64) * 2
                               + 3 * 2 * 64 * 4 + 64 * 128 * 4 + 8 * 7 + 1024) == 227 * 1024 - 456
    assert conv.smem_bytes == 0
    # hd64: 128-row steps (its dq conversion too), two Q / dO slots
    p64 = checks.check_attention(q[..., :64], k[..., :64], k[..., :64])
    plan64 = kernels.plan_backward("bfloat16", 64, False, hopper=True)
    m64, c64 = plan64.dkdv[0], plan64.dq
    assert (m64.headdim, m64.block_m, m64.block_n, c64.block_m) == (64, 128, 128, 128)
    assert kernels.launch_geometry(c64, p64) == ((8, 8, 3), (256, 1, 1))
    assert kernels.launch_geometry(m64, p64) == ((6, 2, 3), (384, 1, 1))
    # K, V (128 x 64), two Q and dO slots (128 x 64), two dS^T buffers (128 x 128), two slots
    # of statistics (128 LSE, 128 D), the fp32 dQ tile (128 x 64), five mbarriers, alignment
    assert m64.smem_bytes == ((2 * 128 * 64 + 2 * 2 * 128 * 64 + 2 * 128 * 128) * 2
                              + 2 * 2 * 128 * 4 + 128 * 64 * 4 + 8 * 5 + 1024)
    # the padded statistics: 300 rows -> 384 (three 128-row steps), blocks of 64
    p300 = checks.check_attention(np.empty((1, 300, 2, 64), np.float16),
                                  np.empty((1, 300, 2, 64), np.float16),
                                  np.empty((1, 300, 2, 64), np.float16))
    assert kernels.stats_shape(p300) == (1, 2, 6, 128)
    assert kernels.launch_geometry(plan64.dsum, p300) == ((6, 2, 1), (128, 1, 1))
    det = kernels.plan_backward("float16", 72, True, hopper=True, deterministic=True).dkdv[0]
    assert det.name == main.name + "_det" and det.entry.endswith(", 128, true, true>")
    assert det.smem_bytes == main.smem_bytes
    with pytest.raises(ValueError, match="hopper"):
        kernels.plan_backward("float32", 64, False, hopper=True)
    # hd256 (every head dim above 128): 64 keys per CTA shared by both consumer warpgroups,
    # 64-row steps, its own pre-pass (256 columns)
    p256 = checks.check_attention(np.empty((3, 1000, 8, 136), np.float16),
                                  np.empty((3, 700, 2, 136), np.float16),
                                  np.empty((3, 700, 2, 136), np.float16))
    plan256 = kernels.plan_backward("bfloat16", 136, False, hopper=True)
    m256, c256, prep256 = plan256.dkdv[0], plan256.dq, plan256.dsum
    assert (m256.headdim, m256.block_m, m256.block_n, c256.block_m) == (256, 64, 64, 64)
    assert (prep256.name, prep256.entry) == ("bwdtma_prep_bf16_hd256",
                                             "cf::bwd_hopper_prep_entry<__nv_bfloat16, 256>")
    assert kernels.launch_geometry(m256, p256) == ((11, 2, 3), (384, 1, 1))
    assert kernels.launch_geometry(c256, p256) == ((16, 8, 3), (256, 1, 1))
    # K, V (64 x 256), two Q and dO slots (64 x 256), two buffers of P^T and dS^T (64 x 64
    # each), two slots of statistics, no dQ tile (added from registers), five mbarriers
    assert m256.smem_bytes == ((2 * 64 * 256 + 2 * 2 * 64 * 256 + 2 * 2 * 64 * 64) * 2
                               + 2 * 2 * 64 * 4 + 8 * 5 + 1024) <= 227 * 1024
    det256 = kernels.plan_backward("bfloat16", 256, True, hopper=True, deterministic=True).dkdv[0]
    assert det256.name == "bwdtma_bf16_hd256_m64_n64_causal_det"


def test_hopper_tiles_are_the_kernels():
    """HOPPER_TILES and STATS_ROWS against hopper.cu's traits (NVRTC probe, no GPU)."""
    for hd, (bm, bn) in kernels.HOPPER_TILES.items():
        got = [kernels.layout(kernels.HOPPER_SOURCE, f"cf::HopperBwdTraits<__half, {hd}>::{n}")
               for n in ("kBlockM", "kBlockN")]
        assert got == [bm, bn]
        threads = kernels.layout(kernels.HOPPER_SOURCE, f"cf::HopperBwdTraits<__half, {hd}>::kThreads")
        plan = kernels.plan_backward("float16", hd, False, hopper=True)
        assert plan.dkdv[0].threads == threads == 32 * kernels.HOPPER_WARPS == 384
    assert kernels.layout(kernels.HOPPER_SOURCE, "cf::kStatsRows") == kernels.STATS_ROWS
    # the deterministic turn counters per dQ tile, which the host allocates after the tiles
    for hd in (64, 72, 128, 200, 256):
        got = kernels.layout(kernels.HOPPER_SOURCE, "cf::DqTurns<cf::HopperBwdTraits<__half, "
                             f"{kernels.hopper_headdim(hd)}>, true>::kPerTile")
        assert got == kernels.turns_per_tile(hd) == (2 if hd > 128 else 1)
    with pytest.raises(ValueError, match="headdim"):
        kernels.hopper_headdim(264)
    assert max(bm for bm, _ in kernels.HOPPER_TILES.values()) == kernels.STATS_PAD


def test_hopper_params_and_tensor_maps(monkeypatch):
    from cupyflash.core import tma
    from cupyflash.core.params import BwdTmaParams
    q = np.empty((2, 300, 4, 64), np.float16)
    k = np.empty((2, 500, 2, 64), np.float16)
    p = checks.check_attention(q, k, k)
    st = {"q": (300 * 256, 256, 64, 1), "k": (500 * 128, 128, 64, 1), "v": (500 * 128, 128, 64, 1),
          "out": (300 * 256, 256, 64, 1), "dout": (300 * 256, 256, 64, 1), "dq": (300 * 256, 256, 64, 1),
          "dk": (500 * 128, 128, 64, 1), "dv": (500 * 128, 128, 64, 1),
          "lse": (1200, 300, 1), "dsum": (1200, 300, 1)}
    prm = kernels.params_of(kernels.bwd_fields(p, st, False), tma=True)
    assert isinstance(prm, BwdTmaParams) and prm.bwd.fwd.seqlen_k == 500
    assert kernels.pointer_block(tma=True) == (BwdTmaParams.bwd.offset, 13)
    assert BwdTmaParams.bwd.offset == 4 * 128
    maps = tma.backward_maps_layout(p, st)
    # (headdim, heads, rows, batch), byte strides, boxes of 64 query rows / 128 keys
    assert maps[0] == ((64, 4, 300, 2), (128, 512, 153600), (64, 1, 64, 1))
    assert maps[1] == ((64, 2, 500, 2), (128, 256, 128000), (64, 1, 128, 1))
    assert maps[3][2] == (64, 1, 64, 1)
    assert tma.backward_maps_layout(p, dict(st, k=(500 * 128, 128, 67, 1))) is None  # 134 B
    assert [kernels.POINTERS[i] for i in __import__("cupyflash.backward.run", fromlist=["x"])
            ._MAP_SOURCES] == ["q", "k", "v", "dout"]
    monkeypatch.delenv("CUPYFLASH_BWD_HOPPER", raising=False)
    assert kernels.hopper_enabled()  # the default where it applies
    monkeypatch.setenv("CUPYFLASH_BWD_HOPPER", "0")
    assert not kernels.hopper_enabled()
    monkeypatch.setenv("CUPYFLASH_BWD_HOPPER", "1")
    assert kernels.hopper_enabled()
