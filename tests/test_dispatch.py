"""CPU tests of the prefill heuristics, the dispatcher, ``explain()`` and the API's input order
(validation -> plan -> launch). No GPU: device arrays are stand-ins exposing
``__cuda_array_interface__`` (shape, dtype and strides only), and the launch is replaced by a
function that fails the test if it is ever called."""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from cupyflash import api, io_model
from cupyflash.forward import run
from cupyflash.core import checks, interop, jit, launch
from cupyflash.forward import kernels as prefill
from cupyflash.forward import dispatch
from cupyflash.core import cache
from cupyflash.core import planning
from cupyflash.forward import heuristics
from cupyflash.testing import np_dtype

DTYPES = ("float16", "bfloat16", "float32", "float64")


# ----------------------------------------------------------------------------------------------
# Heuristics (pure)
# ----------------------------------------------------------------------------------------------
def test_chosen_tile_is_always_a_compiled_row():
    for dtype in DTYPES:
        for d in range(8, 257, 8):
            tiles = heuristics.prefill_tiles(dtype, d)
            assert tiles, (dtype, d)
            for sq in (0, 1, 63, 64, 65, 300, 4096):
                for sk in (0, 1, 20, 33, 300, 4096):
                    for bh in (1, 16, 4096):
                        t = heuristics.choose_prefill_tile(dtype, d, sq, sk, False,
                                                           batch_nheads=bh)
                        assert t in tiles
                        tc = heuristics.choose_prefill_tile(dtype, d, sq, sk, True,
                                                            batch_nheads=bh)
                        # causal changes the choice only by rule 1b (hd <= 32, 256 < sk <= 1024)
                        # and rule 3b (TMA hd64's 192-row tile -> its 128-row one, sk <= 1024;
                        # rule 4 may then narrow it for keys <= 64)
                        rule_1b = (d <= 32 and dtype in ("float16", "bfloat16")
                                   and 256 < sk <= 1024)
                        rule_3b = t == (192, 128, 16, "tma") and sk <= 1024
                        assert tc == t or (rule_1b and tc == (64, 64, 4, "mma")) or \
                            (rule_3b and tc[0] == 128 and tc in tiles), (dtype, d, sq, sk)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rule_1b_short_sequences_at_head_dims_up_to_32(dtype):
    """hd <= 32: 64 x 64 x 4 warps for keys up to 256, or up to 1024 when causal (measured:
    heuristics.py rule 1b); the table's first row otherwise; other head dims never."""
    short, first = (64, 64, 4, "mma"), heuristics.prefill_tiles(dtype, 32)[0]
    assert first == (128, 128, 4, "mma")
    for d in (8, 16, 24, 32):
        for sk, causal, want in ((128, False, short), (256, False, short), (257, False, first),
                                 (1024, False, first), (512, True, short), (1024, True, short),
                                 (1025, True, first), (4096, True, first)):
            assert heuristics.choose_prefill_tile(dtype, d, 4096, sk, causal,
                                                  batch_nheads=288) == want, (d, sk, causal)
    for d in (40, 64, 128):
        assert heuristics.choose_prefill_tile(dtype, d, 256, 256, True, batch_nheads=288)[:3] \
            != short[:3]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rule_1b_survives_rule_2_for_short_queries(dtype):
    """Rule 2 (short queries -> the smallest block_m) must not undo rule 1b: its 64 x 64 tile
    already has the smallest block_m, and 64 x 64 beat 64 x 128 at every measured length
    (the short-tile sweep of experiments/notes/2026-12-01_2204_ea8be9b.md, its records at tag
    results-archive-2026-12-02). The choice may not depend on whether seqlen_q is 64 or 65."""
    short = (64, 64, 4, "mma")
    for d in (8, 32):
        for sk, causal in ((128, False), (256, False), (200, True), (1024, True)):
            for sq in (1, 63, 64, 65, 128):
                assert heuristics.choose_prefill_tile(dtype, d, sq, sk, causal,
                                                      batch_nheads=288) == short, \
                    (d, sq, sk, causal)


def test_prefill_tiles_follow_the_table():
    for cfg in prefill.SUPPORTED:
        tile = (cfg.block_m, cfg.block_n, cfg.nwarps, cfg.isa)
        assert tile in heuristics.prefill_tiles(cfg.dtype, cfg.headdim)
        # TMA rows are offered for sm_90a only
        assert (tile in heuristics.prefill_tiles(cfg.dtype, cfg.headdim, "sm_80")) == \
            (cfg.isa != "tma")
    first = next(c for c in prefill.SUPPORTED if c.dtype == "bfloat16" and c.headdim == 128)
    assert first.isa == "tma"
    assert heuristics.prefill_tiles("bfloat16", 120)[0] == (first.block_m, first.block_n,
                                                            first.nwarps, "tma")
    first80 = next(c for c in prefill.SUPPORTED if c.dtype == "bfloat16" and c.headdim == 128
                   and c.isa == "mma")
    assert heuristics.prefill_tiles("bfloat16", 120, "sm_80")[0] == (
        first80.block_m, first80.block_n, first80.nwarps, "mma")
    assert heuristics.prefill_tiles("int8", 64) == ()


def test_rules():
    default = heuristics.prefill_tiles("bfloat16", 128)[0]
    # 1. long sequences on a full GPU: the table's default
    assert heuristics.choose_prefill_tile("bfloat16", 128, 4096, 4096, False,
                                          batch_nheads=64) == default
    # 2. short queries: the smallest block_m
    smallest = min(t[0] for t in heuristics.prefill_tiles("bfloat16", 128))
    assert heuristics.choose_prefill_tile("bfloat16", 128, smallest, 4096, False,
                                          batch_nheads=4096)[0] == smallest
    # 3. fewer CTAs than SMs: the next smaller block_m; enough CTAs: the default
    assert heuristics.choose_prefill_tile("bfloat16", 128, 1000, 1000, False, num_sms=132,
                                          batch_nheads=4)[0] < default[0]
    assert heuristics.choose_prefill_tile("bfloat16", 128, 1000, 1000, False, num_sms=132,
                                          batch_nheads=17) == default  # 17 * 8 = 136 CTAs
    assert heuristics.choose_prefill_tile("bfloat16", 128, 1000, 1000, False, num_sms=8,
                                          batch_nheads=1) == default
    # 4. keys fit a narrower compiled tile of the same block_m: the narrowest that holds them
    t = heuristics.choose_prefill_tile("bfloat16", 128, 4096, 20, False, batch_nheads=64)
    assert t[0] == default[0]
    narrower = [x for x in heuristics.prefill_tiles("bfloat16", 128)
                if x[0] == default[0] and 20 <= x[1] < default[1]]
    if narrower:
        assert t[1] == min(x[1] for x in narrower)


def test_tiles_argument_restricts_the_choice():
    tiles = heuristics.prefill_tiles("float16", 64)
    only = (tiles[-1],)
    assert heuristics.choose_prefill_tile("float16", 64, 4096, 4096, False, batch_nheads=64,
                                          tiles=only) == only[0]


@pytest.mark.parametrize("args,match", [
    (("float16", 12, 10, 10, False), "headdim"),
    (("float16", 264, 10, 10, False), "headdim"),
    (("int8", 64, 10, 10, False), "dtype"),
    (("float16", 64, -1, 10, False), "sizes"),
])
def test_heuristic_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        heuristics.choose_prefill_tile(*args)


# ----------------------------------------------------------------------------------------------
# The supported table holds only rows the dispatcher can choose
# ----------------------------------------------------------------------------------------------
def _decision_inputs():
    """``(seqlen_q, seqlen_k, causal, batch_nheads, num_sms)`` covering every outcome of every
    test in heuristics.choose_prefill_tile. seqlen_q meets it in ``seqlen_q <= block_m`` (rule
    2) and ``ceil(seqlen_q / block_m)`` (rules 3, 3c), block_m a compiled one: each multiple of
    one up to 4 of it, and the next length. seqlen_k in ``seqlen_k <= block_n`` (rule 4) and
    256 / 1024 (rules 1b, 3b): each, and the next length. Rule 3's ``batch_nheads * m-blocks <
    num_sms``, compared once, is true at every length with (1, 2**30), false with (2**30, 1)."""
    rows = prefill.SUPPORTED
    sq = {0, 1, 1 << 20} | {c.block_m * j + e for c in rows for j in (1, 2, 3, 4) for e in (0, 1)}
    sk = {0, 1, 1 << 20} | {n + e for n in {c.block_n for c in rows} | {256, 1024} for e in (0, 1)}
    return [(a, b, causal, bh, sms) for a in sorted(sq) for b in sorted(sk)
            for causal in (False, True) for bh, sms in ((1, 1 << 30), (1 << 30, 1))]


def test_table_has_no_unreachable_row():
    """Issue 34: every row of prefill.SUPPORTED is one the dispatcher chooses for some problem
    on some GPU the library runs on, so the CPU suite compiles no dead specialisation.

    Enumerated: dtypes, head dims 8..256, each architecture's shared-memory limit
    (core.planning._SMEM_BY_ARCH: sm_80 / sm_87 163 KiB, sm_86 / sm_89 / sm_120 99 KiB,
    sm_90 / sm_100 227 KiB, the TMA rows on sm_90a only) and every decision input of
    choose_prefill_tile (_decision_inputs), on the candidates dispatch._plan_prefill hands it
    (kernels.configs_for, within the shared memory and the architecture). Candidate lists with
    the same rows are enumerated once (the heuristic reads the actual head dim only as
    ``<= 32``, rule 1b). Each row's first witness problem is then planned by the dispatcher
    itself (the launch path's _plan_prefill), which must choose that row."""
    from cupyflash.core.checks import AttnProblem
    groups = {}  # (candidate rows, hd <= 32) -> a (dtype, head dim, arch, shared memory)
    for dtype in DTYPES:
        for d in range(8, 257, 8):
            for arch, smem in sorted(planning._SMEM_BY_ARCH.items()):
                rows = tuple(c for c in prefill.configs_for(dtype, d)
                             if c.smem_bytes <= smem and c.arch in ("", arch))
                if rows:  # else the dispatcher raises (float64 hd136-224 at 99 KiB)
                    groups.setdefault((rows, d <= 32), (dtype, d, arch, smem))
    inputs = _decision_inputs()
    witness = {}
    for (rows, _), (dtype, d, arch, smem) in groups.items():
        tiles = tuple((c.block_m, c.block_n, c.nwarps, c.isa) for c in rows)
        for sq, sk, causal, bh, sms in inputs:
            row = rows[tiles.index(heuristics.choose_prefill_tile(
                dtype, d, sq, sk, causal, sms, batch_nheads=bh, tiles=tiles))]
            witness.setdefault(row, (dtype, d, arch, smem, sq, sk, causal, bh, sms))
    dead = [prefill.spec_of(c, False).name for c in prefill.SUPPORTED if c not in witness]
    assert not dead, f"rows the dispatcher never chooses (remove them from the table): {dead}"
    assert set(witness) == set(prefill.SUPPORTED)
    for row, (dtype, d, arch, smem, sq, sk, causal, bh, sms) in witness.items():
        p = AttnProblem(batch=1, seqlen_q=sq, seqlen_k=sk, nheads=bh, nheads_k=1, headdim=d,
                        dtype=dtype, softmax_scale=0.125, causal=causal,
                        window_size=(-1, 0) if causal else (-1, -1))
        plan = dispatch._plan_prefill(p, arch, False, False, sms, smem, None, reasons=False)
        assert plan.name == prefill.spec_of(row, causal).name, (row, arch, smem, sq, sk, bh, sms)


# ----------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------
def _problem(dtype="bfloat16", b=2, sq=300, sk=500, h=8, hk=2, d=120, causal=False,
             window=(-1, -1), scale=None):
    q = np.empty((b, sq, h, d), np_dtype(dtype))
    k = np.empty((b, sk, hk, d), np_dtype(dtype))
    return checks.check_attention(q, k, k, causal=causal, window_size=window,
                                  softmax_scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (30, 7))])
def test_plan_fields(dtype, causal, window):
    p = _problem(dtype, causal=causal, window=window)
    plan = dispatch.plan_prefill(p, report=False, arch="sm_90a", num_sms=132,
                                 max_smem_bytes=227 * 1024)
    t = plan.kernel.template
    tile = heuristics.choose_prefill_tile(dtype, p.headdim, p.seqlen_q, p.seqlen_k, p.causal,
                                          132, batch_nheads=p.batch * p.nheads)
    assert (t["block_m"], t["block_n"], t["nwarps"], t["isa"]) == tile
    assert t == {"dtype": dtype, "headdim": prefill.padded_headdim(120, tile[3]),
                 "block_m": tile[0],
                 "block_n": tile[1], "nwarps": tile[2], "causal": p.causal, "isa": tile[3]}
    spec = prefill.kernel_spec(dtype, t["headdim"], *tile[:3], p.causal, isa=tile[3])
    assert plan.kernel.spec == spec and plan.name == spec.name and plan.kernel.entry == spec.entry
    grid, block, smem = prefill.launch_config(spec, p)
    assert (plan.grid, plan.block, plan.smem_bytes) == (tuple(grid), tuple(block), smem)
    assert plan.grid == (-(-p.seqlen_q // tile[0]), p.nheads, p.batch)
    assert plan.num_splits is None and plan.extra_kernels == () and plan.num_sms == 132
    assert plan.registers is None and plan.spill_bytes is None and plan.kernel.arch is None
    assert plan.flops == io_model.prefill_flops(p.batch, p.nheads, p.seqlen_q, p.seqlen_k,
                                                p.headdim, p.causal, p.window_size)
    assert plan.hbm_bytes == io_model.prefill_hbm_bytes(
        p.batch, p.nheads, p.nheads_k, p.seqlen_q, p.seqlen_k, p.headdim, dtype, p.causal,
        p.window_size, tile[0], tile[1])
    # every other specialisation is listed once, with a reason
    names = [n for n, _ in plan.rejected]
    assert len(names) == len(set(names)) and plan.name not in names
    assert set(names) | {plan.name} == {s.name for s in prefill.all_specs()}
    assert all(isinstance(r, str) and r for _, r in plan.rejected)
    # nearest first: other tiles, then the other causal flag, then head dims, then dtypes
    kinds = ["tile" if "heuristic chose" in r else "causal" if "causal" in r else
             "headdim" if r.startswith("compiled for headdim") else
             "dtype" if r.startswith("dtype") else "other" for _, r in plan.rejected]
    order = {"tile": 0, "causal": 1, "headdim": 2, "dtype": 3}
    assert "other" not in kinds
    assert [order[x] for x in kinds] == sorted(order[x] for x in kinds)
    json.dumps(plan.as_dict())
    assert plan.name in str(plan)


def test_tma_plan_counts_kv_once_per_head_and_predicts_the_roofline():
    """The Hopper TMA kernel's plan counts K and V once per head (its scheduler's L2 groups:
    Nsight Compute measured 0.87-1.03x of that, NOTES v57), so its roofline time at long S is
    the tensor-core roof, flops / 805 TFLOP/s; the mma.sync plan keeps the per-query-tile count
    (an upper bound)."""
    p = _problem("bfloat16", b=2, sq=8192, sk=8192, h=16, hk=16, d=128)
    plan = dispatch.plan_prefill(p, report=False, arch="sm_90a", num_sms=132,
                                 max_smem_bytes=227 * 1024)
    assert plan.template["isa"] == "tma"
    args = (2, 16, 16, 8192, 8192, 128, "bfloat16", False, (-1, -1), 128, plan.template["block_n"])
    assert plan.hbm_bytes == io_model.prefill_hbm_bytes(*args, kv_reuse=True)
    assert plan.hbm_bytes < io_model.prefill_hbm_bytes(*args) / 10
    assert plan.roofline_ms == pytest.approx(1e3 * plan.flops / (planning.H200_MATMUL_TFLOPS * 1e12))
    plan80 = dispatch.plan_prefill(p, report=False, arch="sm_80", num_sms=108)
    t = plan80.template
    assert t["isa"] == "mma" and plan80.hbm_bytes == io_model.prefill_hbm_bytes(
        2, 16, 16, 8192, 8192, 128, "bfloat16", False, (-1, -1), t["block_m"], t["block_n"])


def test_plan_reasons_name_the_difference():
    plan = dispatch.plan_prefill(_problem("float16", d=64, causal=True), report=False,
                                 predict=False, arch="sm_90a", num_sms=132,
                                 max_smem_bytes=227 * 1024)
    reasons = dict(plan.rejected)
    assert "dtype" in reasons[plan.name.replace("f16", "bf16")]
    assert "non-causal" in reasons[plan.name.replace("_causal", "")]
    other_hd = next(n for n in reasons if "_hd128_" in n and n.startswith("fwd_f16"))
    assert "headdim" in reasons[other_hd]
    assert plan.flops is None and plan.hbm_bytes is None


def test_shared_memory_limit_rejects_tiles_and_never_falls_back():
    p = _problem("bfloat16", d=128, sq=4096, sk=4096, b=4, h=16, hk=16)
    limit = 120 * 1024
    plan = dispatch.plan_prefill(p, report=False, arch="sm_90a", num_sms=132,
                                 max_smem_bytes=limit)
    assert plan.smem_bytes <= limit
    too_big = [c for c in prefill.SUPPORTED if c.dtype == "bfloat16" and c.headdim == 128
               and c.smem_bytes > limit]
    reasons = dict(plan.rejected)
    for c in too_big:
        name = prefill.spec_of(c, False).name
        assert "shared memory" in reasons[name]
    # nothing fits: ValueError listing every candidate, no fallback to another dtype / path
    p64 = _problem("float64", d=256)
    with pytest.raises(ValueError, match="shared memory") as e:
        dispatch.plan_prefill(p64, report=False, arch="sm_86", num_sms=84,
                              max_smem_bytes=16 * 1024)
    msg = str(e.value)
    assert all(s.name in msg for s in prefill.all_specs())


@pytest.mark.parametrize("field,value,match", [("headdim", 264, "headdim 264 is not compiled"),
                                               ("dtype", "float8_e4m3fn", "dtype float16")])
def test_unsupported_problem_lists_every_rejection(field, value, match):
    p = dataclasses.replace(_problem("float16", d=64), **{field: value})
    with pytest.raises(ValueError, match=match) as e:
        dispatch.plan_prefill(p, report=False, arch="sm_90a", num_sms=132,
                              max_smem_bytes=227 * 1024)
    msg = str(e.value)
    assert msg.startswith("problem: no prefill kernel")
    assert all(s.name in msg for s in prefill.all_specs())


@pytest.mark.parametrize("dtype", DTYPES)
def test_launch_path_decides_like_explain(dtype):
    """The launch path's plan (no rejection list) picks the same kernel and geometry."""
    for sq, sk, b, causal in ((1, 1, 1, False), (77, 300, 2, True), (4096, 4096, 8, False)):
        p = _problem(dtype, b=b, sq=sq, sk=sk, causal=causal)
        fast = dispatch._plan_prefill(p, "sm_90a", False, False, 132, 227 * 1024, None,
                                      reasons=False)
        full = dispatch.plan_prefill(p, report=False, arch="sm_90a", num_sms=132,
                                     max_smem_bytes=227 * 1024)
        assert fast.kernel == full.kernel and fast.rejected == [] and full.rejected
    bad = dataclasses.replace(_problem(dtype), headdim=264)
    with pytest.raises(ValueError, match="every candidate was rejected"):
        dispatch._plan_prefill(bad, "sm_90a", False, False, 132, 227 * 1024, None,
                               reasons=False)


def test_plan_prefill_wants_an_attn_problem():
    with pytest.raises(TypeError, match="problem"):
        dispatch.plan_prefill({"headdim": 64})


def test_max_smem_by_arch():
    assert planning.max_smem_bytes_for_arch("sm_90a") == 227 * 1024
    assert planning.max_smem_bytes_for_arch("sm_80") == 163 * 1024
    assert planning.max_smem_bytes_for_arch("sm_89") == 99 * 1024


# ----------------------------------------------------------------------------------------------
# explain() on NumPy arrays: no GPU, registers from an NVRTC compile
# ----------------------------------------------------------------------------------------------
def test_explain_numpy_arrays_without_gpu():
    bf16 = np_dtype("bfloat16")
    q = np.zeros((2, 1000, 16, 128), bf16)
    k = np.zeros((2, 1500, 4, 128), bf16)
    plan = api.explain(q, k, k, causal=True, arch="sm_90a")
    assert isinstance(plan, planning.Plan)
    # Hopper: the TMA kernel; an sm_80 target gets the mma.sync one and says why not TMA
    assert plan.name.startswith("fwdtma_bf16_hd128_") and plan.name.endswith("_causal")
    assert plan.template["isa"] == "tma" and plan.kernel.spec.arch == "sm_90a"
    assert plan.grid == (132, 1, 1)  # persistent: one CTA per SM (2 * 16 * 8 = 256 tiles)
    plan80 = api.explain(q, k, k, causal=True, arch="sm_80")
    assert plan80.name.startswith("fwd_bf16_hd128_") and plan80.template["isa"] == "mma"
    assert plan80.kernel.arch == "sm_80"
    assert any(n == plan.name and "sm_90a (Hopper) only" in r for n, r in plan80.rejected)
    rep = jit.compile_report(plan.kernel.spec, "sm_90a").ptxas
    assert plan.registers == rep.registers > 0
    # explain() reports ptxas' spills as they are: none for the hd128 TMA specs, causal or not
    assert plan.spill_bytes == rep.spill_bytes == 0
    assert api.explain(q, k, k, causal=False, arch="sm_90a").spill_bytes == 0
    assert plan.kernel.arch == "sm_90a"
    assert plan.flops == io_model.prefill_flops(2, 16, 1000, 1500, 128, True, (-1, 0))
    assert plan.hbm_bytes > 0 and plan.num_splits is None
    d = plan.as_dict()
    assert d["kernel"]["registers"] == plan.registers and json.dumps(d)
    # same arguments as flash_attn_func, out and return_lse included
    plan2 = api.explain(q, k, k, softmax_scale=None, causal=True, window_size=(-1, -1),
                        return_lse=True, out=np.zeros_like(q), arch="sm_90a")
    assert plan2.name == plan.name


def test_explain_varlen_counts_flops_per_sequence():
    lens_q, lens_k = [5, 0, 40], [7, 3, 40]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = np.zeros((cq[-1], 4, 64), np.float32)
    k = np.zeros((ck[-1], 2, 64), np.float32)
    plan = api.explain_varlen(q, k, k, cq, ck, 40, 40, causal=True, arch="sm_90a")
    want = sum(io_model.prefill_flops(1, 4, a, b, 64, True, (-1, 0))
               for a, b in zip(lens_q, lens_k))
    assert plan.flops == want
    assert plan.grid == (-(-40 // plan.template["block_m"]), 4, 3)
    lazy = api.explain_varlen(q, k, k, cq, ck, 40, 40, causal=True, validate=False,
                              arch="sm_90a")
    assert lazy.flops is None and lazy.name == plan.name


def test_varlen_runs_the_tma_kernel_on_hopper():
    """Packed sequences run the Hopper TMA kernel on sm_90a, as dense problems do (float16 /
    bfloat16, padded head dims included): the same specialisation as the dense problem of the
    longest sequence, a persistent grid over (m-blocks of max_seqlen_q) x heads x sequences
    (enough work tiles for every SM: the heuristic takes smaller tiles otherwise, for both);
    sm_80 gets the mma.sync kernel."""
    lens_q, lens_k = [300, 0, 1, 77], [290, 5, 0, 128]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    for dtype, d, causal in (("bfloat16", 120, True), ("float16", 64, False)):
        q = np.zeros((cq[-1], 16, d), np_dtype(dtype))
        k = np.zeros((ck[-1], 4, d), np_dtype(dtype))
        plan = api.explain_varlen(q, k, k, cq, ck, 300, 290, causal=causal, arch="sm_90a")
        assert plan.template["isa"] == "tma" and plan.kernel.spec.arch == "sm_90a"
        dense = api.explain(np.zeros((4, 300, 16, d), q.dtype), np.zeros((4, 290, 4, d), q.dtype),
                            np.zeros((4, 290, 4, d), q.dtype), causal=causal, arch="sm_90a")
        # persistent: min(132 SMs, 3 m-blocks x 16 heads x 4 sequences) CTAs
        assert plan.name == dense.name and plan.grid == dense.grid == (132, 1, 1)
        assert plan.flops == sum(io_model.prefill_flops(1, 16, a, b, d, causal,
                                                        (-1, 0) if causal else (-1, -1))
                                 for a, b in zip(lens_q, lens_k))
        assert not any("varlen" in r or "dense" in r for _, r in plan.rejected)
        plan80 = api.explain_varlen(q, k, k, cq, ck, 300, 290, causal=causal, arch="sm_80")
        assert plan80.template["isa"] == "mma"


def test_explain_rejects_what_flash_attn_func_rejects():
    q = np.zeros((1, 10, 2, 12), np.float16)
    with pytest.raises(ValueError, match="^q: headdim 12"):
        api.explain(q, q, q)
    q = np.zeros((1, 10, 2, 16), np.int8)
    with pytest.raises(TypeError, match="^q: dtype int8"):
        api.explain(q, q, q)


# ----------------------------------------------------------------------------------------------
# flash_attn_func / flash_attn_varlen_func: every bad input raises before any launch
# ----------------------------------------------------------------------------------------------
class FakeCuda:
    """Shape, dtype and strides of a CUDA array, without memory (``__cuda_array_interface__``)."""

    def __init__(self, shape, dtype="float16", strides=None):
        self.shape = tuple(shape)
        self.dtype = np_dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.ndim = len(self.shape)
        self.strides = interop.c_strides(self.shape, self.itemsize) if strides is None \
            else tuple(strides)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (0, False),
                "strides": self.strides, "version": 3}

    class device:  # stands in for cupy.cuda.Device(0) as a context manager
        id = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    device = device()


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything gets as far as a kernel, an allocation or a compile."""
    calls = []

    def forbidden(*a, **k):
        calls.append(a)
        raise AssertionError("reached the launch path with bad input")

    monkeypatch.setattr(prefill, "launch", forbidden)
    monkeypatch.setattr(jit, "get_kernel", forbidden)
    monkeypatch.setattr(run, "_run", forbidden)
    return calls


def F(shape, dtype="float16", strides=None):
    return FakeCuda(shape, dtype, strides)


Q, K = (2, 33, 8, 64), (2, 45, 2, 64)

BAD_DENSE = [
    # (args, kwargs, exception, message start)
    ((np.zeros(Q, np.float16), F(K), F(K)), {}, TypeError, "q: expected a CUDA array"),
    ((F(Q), np.zeros(K, np.float16), F(K)), {}, TypeError, "k: expected a CUDA array"),
    ((F(Q), F(K), [[1.0]]), {}, TypeError, "v: expected a CUDA array"),
    ((F(Q), F(K), F(K)), {"out": np.zeros(Q, np.float16)}, TypeError, "out: expected a CUDA"),
    ((F(Q[:3]), F(K), F(K)), {}, ValueError, "q: expected 4 dims"),
    ((F(Q), F(K, "bfloat16"), F(K)), {}, TypeError, "k: dtype bfloat16 must match"),
    ((F(Q, "int8"), F(K, "int8"), F(K, "int8")), {}, TypeError, "q: dtype int8"),
    ((F((2, 33, 8, 12)), F((2, 45, 2, 12)), F((2, 45, 2, 12))), {}, ValueError, "q: headdim 12"),
    ((F((2, 33, 8, 264)), F((2, 45, 2, 264)), F((2, 45, 2, 264))), {}, ValueError,
     "q: headdim 264"),
    ((F((2, 33, 6, 64)), F((2, 45, 4, 64)), F((2, 45, 4, 64))), {}, ValueError, "k: nheads_k 4"),
    ((F(Q), F((3, 45, 2, 64)), F((3, 45, 2, 64))), {}, ValueError, "k: batch 3"),
    ((F(Q), F(K), F((2, 44, 2, 64))), {}, ValueError, "v: shape"),
    ((F(Q), F(K), F(K)), {"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
    ((F(Q), F(K), F(K)), {"softmax_scale": 0.0}, ValueError, "softmax_scale"),
    ((F(Q), F(K), F(K)), {"softmax_scale": -1.0}, ValueError, "softmax_scale"),
    ((F(Q), F(K), F(K)), {"softmax_scale": float("inf")}, ValueError, "softmax_scale"),
    ((F(Q), F(K), F(K)), {"softmax_scale": "0.1"}, TypeError, "softmax_scale"),
    ((F(Q), F(K), F(K)), {"window_size": (-2, 0)}, ValueError, "window_size"),
    ((F(Q), F(K), F(K)), {"window_size": 4}, TypeError, "window_size"),
    ((F(Q), F(K), F(K)), {"causal": "yes"}, TypeError, "causal"),
    ((F(Q), F(K), F(K)), {"return_lse": 1}, TypeError, "return_lse"),
    ((F(Q), F(K), F(K)), {"out": F((2, 33, 8, 32))}, ValueError, "out: expected shape"),
    ((F(Q), F(K), F(K)), {"out": F(Q, "float32")}, TypeError, "out: dtype float32"),
    ((F(Q, strides=(33 * 8 * 128, 8 * 128, 128, 4)), F(K), F(K)), {}, ValueError,
     "q: last dimension must be contiguous"),
]


@pytest.mark.parametrize("args,kwargs,exc,start", BAD_DENSE,
                         ids=[b[3].split(":")[0] + "-" + str(i) for i, b in enumerate(BAD_DENSE)])
def test_bad_dense_input_raises_before_launch(no_launch, args, kwargs, exc, start):
    with pytest.raises(exc) as e:
        api.flash_attn_func(*args, **kwargs)
    assert str(e.value).startswith(start), str(e.value)
    assert no_launch == []


def test_numpy_message_points_to_the_reference(no_launch):
    a = np.zeros(Q, np.float16)
    with pytest.raises(TypeError, match=r"^q: .*numpy\.ndarray.*cupyflash\.reference\."
                                        r"attention_reference"):
        api.flash_attn_func(a, a, a)
    cu = np.array([0, 33], np.int32)
    with pytest.raises(TypeError, match=r"^q: .*varlen_attention_reference"):
        api.flash_attn_varlen_func(a[0], a[0], a[0], cu, cu, 33, 33)
    assert no_launch == []


QV, KV = (40, 8, 64), (50, 2, 64)
CU = F((3,), "int32")

BAD_VARLEN = [
    ((F(QV), F(KV), F(KV), np.array([0, 10, 40], np.int32), CU, 30, 30), {}, TypeError,
     "cu_seqlens_q: expected a CUDA array"),
    ((F(QV), F(KV), F(KV), CU, F((3,), "int64"), 30, 30), {}, TypeError, "cu_seqlens_k: dtype"),
    ((F(QV), F(KV), F(KV), CU, F((4,), "int32"), 30, 30), {}, ValueError, "cu_seqlens_k: shape"),
    ((F(QV), F(KV), F(KV), CU, CU, -1, 30), {}, ValueError, "max_seqlen_q"),
    ((F(QV), F(KV), F(KV), CU, CU, 30, 2.5), {}, TypeError, "max_seqlen_k"),
    ((F((40, 8, 64, 1)), F(KV), F(KV), CU, CU, 30, 30), {}, ValueError, "q: expected 3 dims"),
    ((F(QV), F(KV), F(KV), CU, CU, 30, 30), {"validate": "no"}, TypeError, "validate"),
    ((F(QV), F(KV), F(KV), CU, CU, 30, 30), {"out": F((40, 8, 32))}, ValueError, "out"),
    ((F(QV), F(KV), F(KV), CU, CU, 30, 30), {"return_lse": None}, TypeError, "return_lse"),
]


@pytest.mark.parametrize("args,kwargs,exc,start", BAD_VARLEN,
                         ids=[b[3].split(":")[0] + "-" + str(i) for i, b in enumerate(BAD_VARLEN)])
def test_bad_varlen_input_raises_before_launch(no_launch, args, kwargs, exc, start):
    kwargs = {"validate": False, **kwargs}  # no host copy of the (fake) cu_seqlens
    with pytest.raises(exc) as e:
        api.flash_attn_varlen_func(*args, **kwargs)
    assert str(e.value).startswith(start), str(e.value)
    assert no_launch == []


def test_valid_input_reaches_plan_then_launch_in_that_order(monkeypatch):
    """Validation passes -> _run gets the problem; a plan failure stops before any launch."""
    seen = []
    monkeypatch.setattr(run, "_run", lambda problem, *a, **k: seen.append(problem) or (1, 2))
    assert api.flash_attn_func(F(Q), F(K), F(K), causal=True, return_lse=True) == (1, 2)
    assert api.flash_attn_func(F(Q), F(K), F(K)) == 1
    assert seen[0].causal and seen[0].nheads == 8 and seen[0].nheads_k == 2
    monkeypatch.undo()

    launched = []
    monkeypatch.setattr(prefill, "launch", lambda *a, **k: launched.append(a))

    def no_plan(problem):
        raise ValueError("problem: no prefill kernel (test)")

    monkeypatch.setattr(dispatch, "launch_plan", no_plan)
    monkeypatch.setattr(run, "as_cupy", lambda a, name, dtype=None: a)  # no device memory on a CPU
    pytest.importorskip("cupy")
    with pytest.raises(ValueError, match="no prefill kernel"):
        api.flash_attn_func(F(Q), F(K), F(K))
    assert launched == []


def test_import_does_not_need_cupy():
    code = ("import sys; import cupyflash.api, cupyflash.forward.dispatch, cupyflash.forward.heuristics; "
            "import numpy as np; q = np.zeros((1, 4, 2, 32), np.float32); "
            "cupyflash.api.explain(q, q, q, arch='sm_80'); "
            "print('cupy' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # explain() asks whether a device exists (imports cupy lazily); importing alone must not
    code2 = ("import sys; import cupyflash.api, cupyflash.forward.dispatch, cupyflash.forward.heuristics; "
             "print('cupy' in sys.modules)")
    r2 = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True,
                        timeout=120)
    assert r2.returncode == 0 and r2.stdout.strip() == "False", r2.stderr


# ----------------------------------------------------------------------------------------------
# The launch cache (cache.LAUNCH_CACHE): same plan as a fresh one; any key field misses
# ----------------------------------------------------------------------------------------------
class FakeDevArray(FakeCuda):
    """FakeCuda with a (16-byte aligned) pointer and a device, as the warm path reads them."""

    class data:
        ptr = 1 << 20
        device_id = 0


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(cache, "LAUNCH_CACHE", {})
    monkeypatch.setattr(planning, "_device_info", lambda dev: ("sm_90a", 132, 227 * 1024))
    monkeypatch.setattr(dispatch, "launch_plan", lambda p: dispatch._launch_plan_cached(p, 0))
    dispatch._launch_plan_cached.cache_clear()
    yield cache.LAUNCH_CACHE
    dispatch._launch_plan_cached.cache_clear()


def _entry(q, k, v, out=None, softmax_scale=None, causal=False, window_size=(-1, -1)):
    opts = ("dense",) + run._plain_options(softmax_scale, causal, window_size)
    p = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, out=out)
    key = cache.launch_key("dense", 0, opts[1:], (q, k, v, out, None, None))
    return key, dispatch.prefill_launch(p, key, 0, q, k, v, out), p


def test_launch_cache_entry_equals_a_fresh_plan(fresh_cache):
    q, k, v, out = (FakeDevArray(s) for s in (Q, K, K, Q))
    lse = FakeDevArray((2, 8, 33), "float32")
    for causal, window, scale in ((False, (-1, -1), None), (True, (5, -1), 0.3)):
        key, e, p = _entry(q, k, v, out, scale, causal, window)
        assert dispatch.prefill_launch(p, key, 0, q, k, v, out) is e  # a hit
        fresh = dispatch._plan_prefill(p, "sm_90a", False, False, 132, 227 * 1024, None,
                                       reasons=False)
        assert e.plan == fresh and e.plan.kernel.spec == fresh.kernel.spec
        assert (e.grid, e.block, e.smem) == prefill.launch_config(fresh.kernel.spec, p)
        prm = prefill.kernel_params(fresh.kernel.spec, q, k, v, out, lse, problem=p)
        cached = prefill.params_of(e.strides, e.sizes)
        # the same constant fields (the pointers are the call's)
        for name, _ in prm._fields_:
            if name not in prefill.POINTERS:
                assert getattr(cached, name) == getattr(prm, name), name
        assert e.lse_shape == lse.shape and e.action == "launch"
    assert len(fresh_cache) == 2


@pytest.mark.parametrize("change", ["q strides", "k strides", "dtype", "out", "causal", "window",
                                    "scale", "shape"])
def test_launch_cache_misses_on_any_key_field(fresh_cache, change):
    base = dict(q=FakeDevArray(Q), k=FakeDevArray(K), v=FakeDevArray(K), out=None,
                softmax_scale=0.125, causal=False, window_size=(-1, -1))
    key0, e0, _ = _entry(**base)
    kw = dict(base)
    if change == "q strides":  # same shape, padded rows
        kw["q"] = FakeDevArray(Q, strides=(33 * 8 * 72 * 2, 8 * 72 * 2, 72 * 2, 2))
    elif change == "k strides":
        kw["k"] = FakeDevArray(K, strides=(45 * 2 * 64 * 2, 64 * 2, 45 * 64 * 2, 2))
    elif change == "dtype":
        kw.update(q=FakeDevArray(Q, "bfloat16"), k=FakeDevArray(K, "bfloat16"),
                  v=FakeDevArray(K, "bfloat16"))
    elif change == "out":
        kw["out"] = FakeDevArray(Q)
    elif change == "causal":
        kw["causal"] = True
    elif change == "window":
        kw["window_size"] = (16, -1)
    elif change == "scale":
        kw["softmax_scale"] = 0.25
    elif change == "shape":
        kw.update(q=FakeDevArray((2, 34, 8, 64)))
    key1, e1, p1 = _entry(**kw)
    assert key1 != key0 and e1 is not e0 and len(fresh_cache) == 2
    assert e1.plan == dispatch._plan_prefill(p1, "sm_90a", False, False, 132, 227 * 1024, None,
                                             reasons=False)


def test_launch_cache_takes_only_plain_options():
    """Values equal to plain ones but of other types (1 == True, -1.0 == -1) must not share an
    entry: the checks treat them differently."""
    assert run._plain_options(None, True, (-1, 0)) == (None, True, (-1, 0))
    for bad in ((None, 1, (-1, -1)), (None, np.bool_(True), (-1, -1)), (1, False, (-1, -1)),
                (None, False, [-1, -1]), (None, False, (-1.0, -1)), (None, False, (True, -1)),
                (np.float32(0.1), False, (-1, -1))):
        assert run._plain_options(*bad) is None, bad


def test_warm_path_still_rejects_bad_input(fresh_cache, monkeypatch):
    """After a call is cached, the same arrays with a bad option, or an out of another dtype,
    miss the cache and raise the errors of the full checks before any launch."""
    cupy = pytest.importorskip("cupy")
    launched = []
    monkeypatch.setattr(interop, "_CUPY_NDARRAY", FakeDevArray)  # the fakes play cupy.ndarray
    monkeypatch.setattr(interop, "current_device", lambda: 0)
    monkeypatch.setattr(run, "as_cupy", lambda a, name, dtype=None: a)
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: FakeDevArray(shape, "float32"))
    monkeypatch.setattr(jit, "get_kernel", lambda spec: spec)
    monkeypatch.setattr(launch, "Launch",  # records the spec per launch
                        lambda kern, *a, **k: lambda ptrs, stream: launched.append(kern))
    monkeypatch.setattr(interop.CupyCaller, "stream", staticmethod(lambda dev: 0))
    q, k, v, out = FakeDevArray(Q), FakeDevArray(K), FakeDevArray(K), FakeDevArray(Q)
    for _ in range(3):
        assert api.flash_attn_func(q, k, v, out=out) is out
    assert len(launched) == 3 and len(fresh_cache) == 1
    for kwargs, exc, start in (({"causal": "yes"}, TypeError, "causal"),
                               ({"causal": 1}, TypeError, "causal"),
                               ({"return_lse": 1}, TypeError, "return_lse"),
                               ({"softmax_scale": -1.0}, ValueError, "softmax_scale"),
                               ({"window_size": (-2, 0)}, ValueError, "window_size"),
                               ({"out": FakeDevArray(Q, "float32")}, TypeError, "out: dtype")):
        with pytest.raises(exc) as e:
            api.flash_attn_func(q, k, v, **{"out": out, **kwargs})
        assert str(e.value).startswith(start), str(e.value)
    assert len(launched) == 3 and len(fresh_cache) == 1


def test_explain_applies_the_kernels_layout_rule_to_host_arrays():
    # flash_attn_func rejects a non-unit last stride; explain (which also takes NumPy arrays)
    # must not describe a plan for it
    q = np.zeros((1, 64, 4, 256), np.float16)[..., ::2]
    with pytest.raises(ValueError, match=r"^q: last dimension must be contiguous"):
        api.explain(q, q, q)


def test_prefill_options_are_keyword_only():
    """FlashAttention's fourth positional parameter is dropout_p: here every option after v
    (after max_seqlen_k for varlen) is keyword-only, so a ported positional call raises a
    TypeError instead of reading the dropout rate as softmax_scale."""
    import inspect
    q = np.zeros((1, 16, 2, 64), np.float16)
    for fn in (api.flash_attn_func, api.explain):
        with pytest.raises(TypeError, match="positional"):
            fn(q, q, q, 0.1)
        ps = inspect.signature(fn).parameters
        assert ps["softmax_scale"].kind is inspect.Parameter.KEYWORD_ONLY
    cu = np.array([0, 16], np.int32)
    for fn in (api.flash_attn_varlen_func, api.explain_varlen):
        with pytest.raises(TypeError, match="positional"):
            fn(q[0], q[0], q[0], cu, cu, 16, 16, 0.1)


def test_prefill_plan_says_when_it_assumed_an_h200():
    """Without a visible GPU a prefill plan is made for an H200's 132 SMs and says so, unless
    num_sms is given (then used by the tile heuristic)."""
    from cupyflash.decode import plan as decode_plan
    if not decode_plan._planning_limits().get("assumed"):
        pytest.skip("a GPU is visible: its limits are used")
    q = np.zeros((1, 300, 8, 128), np.float16)
    plan = api.explain(q, q, q, causal=True)
    assert plan.num_sms == 132
    assert ("note", "planned for 132 SMs, an H200's: no GPU is visible here; pass num_sms= "
                    "(and the device's arch) for another GPU") in plan.reasons
    other = api.explain(q, q, q, causal=True, num_sms=78)
    assert other.num_sms == 78 and other.reasons == []
    with pytest.raises(ValueError, match="num_sms: expected an int >= 1"):
        api.explain(q, q, q, num_sms=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rule_3c_no_192_row_tile_where_128_rows_make_as_few_m_blocks(dtype):
    """hd64 on the TMA kernel: 192 x 128 by default, but 128 x 128 where it makes no more
    m-blocks (seqlen_q 65-128 and 193-256: the same CTAs with fewer padding rows)."""
    for sq in (65, 100, 128, 193, 256):
        assert heuristics.choose_prefill_tile(dtype, 64, sq, 4096, False,
                                              batch_nheads=512)[:2] == (128, 128), sq
    for sq in (129, 192, 257, 384, 4096):
        assert heuristics.choose_prefill_tile(dtype, 64, sq, 4096, False,
                                              batch_nheads=512)[:2] == (192, 128), sq
