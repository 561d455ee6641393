"""CPU tests of the split-KV decode path (no GPU needed).

* the ``num_splits`` heuristic: range, monotonicity, documented examples;
* specialisation names and the supported-set table;
* every decode specialisation compiles with NVRTC for sm_80 and sm_90a with zero spills;
* a NumPy emulation of the split kernel's index arithmetic (split ranges per sequence, tiles,
  warp key ownership, page lookups with shift/division, zero-fill, row chunks of GQA heads x
  query tokens, per-row bottom-right masks, warp and split merges, the append) against the
  float64 reference, on NaN-poisoned caches;
* bad inputs raise before any kernel is requested.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ml_dtypes

from cupyflash import decode, reference, testing
from cupyflash.core import checks, jit
from cupyflash.decode import plan as decode_plan

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------------
# Heuristic
# ----------------------------------------------------------------------------------------------
def test_heuristic_documented_examples():
    # Llama-3-8B heads (8 KV heads), hd128 tiles of 64 keys, 132 SMs; contiguous: 1 block per SM
    # (v1 sweep: b1 x 128k best at 16 splits, b16 x 16k at 1), paged: 2 (b1 page 16 best at 33)
    assert decode.choose_num_splits(1, 8, 131072) == 16
    assert decode.choose_num_splits(1, 8, 8192) == 16
    assert decode.choose_num_splits(16, 8, 16384) == 1
    assert decode.choose_num_splits(8, 8, 16384) == 2
    assert decode.choose_num_splits(9, 8, 16384) == 1
    assert decode.choose_num_splits(1, 8, 131072, ctas_per_sm=2) == 33
    assert decode.choose_num_splits(16, 8, 16384, ctas_per_sm=2) == 2
    assert decode.choose_num_splits(17, 8, 16384, ctas_per_sm=2) == 1
    assert decode.choose_num_splits(64, 8, 16384) == 1
    # short caches: down to one tile per split (MIN_TILES_PER_SPLIT = 1, v10 sweep: b1 x 1k best
    # at 8 one-tile splits, b1 x 4k at 16 two-tile splits)
    assert decode.MIN_TILES_PER_SPLIT == 1
    assert decode.choose_num_splits(1, 8, 1024, block_n=128) == 8
    assert decode.choose_num_splits(1, 8, 512, block_n=128) == 4
    assert decode.choose_num_splits(1, 8, 4096, block_n=128) == 16
    assert decode.choose_num_splits(1, 8, 1024, block_n=128, min_tiles_per_split=4) == 2
    assert decode.choose_num_splits(1, 1, 0) == 1
    assert decode.choose_num_splits(1, 1, 64) == 1


@given(batch=st.integers(1, 300), hk=st.integers(1, 64), seqlen=st.integers(0, 300000),
       sms=st.integers(1, 200), chunks=st.integers(1, 8), block_n=st.sampled_from([32, 64, 128]),
       cps=st.integers(1, 4))
def test_heuristic_range_and_monotonicity(batch, hk, seqlen, sms, chunks, block_n, cps):
    f = lambda **kw: decode.choose_num_splits(  # noqa: E731
        kw.get("batch", batch), kw.get("hk", hk), kw.get("seqlen", seqlen),
        kw.get("sms", sms), row_chunks=kw.get("chunks", chunks), block_n=block_n,
        ctas_per_sm=cps)
    s = f()
    tiles = -(-seqlen // block_n)
    assert 1 <= s <= max(1, min(decode.MAX_SPLITS, tiles))
    assert f(batch=batch + 1) <= s
    assert f(hk=hk + 1) <= s
    assert f(chunks=chunks + 1) <= s
    assert f(seqlen=seqlen + 1) >= s
    assert f(seqlen=2 * seqlen) >= s
    assert f(sms=sms + 1) >= s
    assert decode.choose_num_splits(batch, hk, seqlen, sms, row_chunks=chunks, block_n=block_n,
                                    ctas_per_sm=cps + 1) >= s
    # never more blocks than one wave unless unsplit
    if s > 1:
        assert batch * hk * chunks * s <= sms * cps


@given(stages=st.integers(2, 6), hd=st.sampled_from([64, 128, 256]), paged=st.booleans(),
       waves=st.booleans(), one_block=st.booleans(), seqlen=st.integers(0, 300000),
       splits=st.integers(1, 128), block_n=st.sampled_from([32, 64, 128]),
       split_tiles=st.sampled_from([0, 0, 0, 1, 32, 63, 64, 256]))
def test_split_stages_rule(stages, hd, paged, waves, one_block, seqlen, splits, block_n,
                           split_tiles):
    """Two stages only on contiguous hd128 caches, for the several-waves tile from
    TWO_STAGES_MIN_KEYS_SEVERAL_WAVES keys or for the one-block tile from
    TWO_STAGES_MIN_KEYS_PER_SPLIT keys per split; never deeper than given; monotone in length."""
    from cupyflash.decode import heuristics as decode_heuristics
    f = lambda **kw: decode_heuristics.choose_split_stages(  # noqa: E731
        kw.get("stages", stages), headdim=hd, paged=paged, several_waves=waves,
        one_block=one_block, seqlen_k=kw.get("seqlen", seqlen),
        num_splits=kw.get("splits", splits), block_n=block_n, split_tiles=split_tiles)
    r = f()
    assert r in (2, stages)
    if paged or hd != 128 or not (waves or one_block):
        assert r == stages
    per_split = (split_tiles or -(-(-(-seqlen // block_n)) // splits)) * block_n
    if not paged and hd == 128:
        if waves:
            assert r == (2 if seqlen >= decode_heuristics.TWO_STAGES_MIN_KEYS_SEVERAL_WAVES else stages)
        elif one_block:
            assert r == (2 if per_split >= decode_heuristics.TWO_STAGES_MIN_KEYS_PER_SPLIT else stages)
    assert f(seqlen=2 * seqlen + block_n) <= r  # longer caches: never deeper
    assert f(splits=splits + 1) >= r            # more splits (shorter ones): never shallower


def test_split_stages_rule_rejects_bad_input():
    from cupyflash.decode import heuristics as decode_heuristics
    kw = dict(headdim=128, paged=False, several_waves=False, one_block=True, seqlen_k=8192,
              num_splits=1, block_n=128)
    for bad in (dict(stages=1), dict(num_splits=0), dict(seqlen_k=-1), dict(block_n=0),
                dict(stages=2.0), dict(split_tiles=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            decode_heuristics.choose_split_stages(**{**dict(stages=3), **kw, **bad})


def test_heuristic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch"):
        decode.choose_num_splits(0, 8, 100)
    with pytest.raises(ValueError, match="seqlen_k"):
        decode.choose_num_splits(1, 8, -1)
    # non-integers name the argument (a float batch used to return a float split count)
    with pytest.raises(ValueError, match="^batch: expected an int >= 1, got 1.5"):
        decode.choose_num_splits(1.5, 8, 1024)
    with pytest.raises(ValueError, match="^nheads_k: expected an int >= 1, got 'x'"):
        decode.choose_num_splits(1, "x", 1024)
    with pytest.raises(ValueError, match="^seqlen_k"):
        decode.choose_num_splits(1, 8, 10.0)
    r = decode.choose_num_splits(np.int64(1), np.int32(8), np.int64(1024))  # 16 tiles of 64
    assert r == 16 and type(r) is int


# ----------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------
def test_spec_names_and_table():
    # the K/V path the public functions run (v18, v20): contiguous; paged with copy pointers up to
    # hd128 for a power-of-two page_size; otherwise paged with page ids per row
    for hd in (64, 128, 256):
        assert decode.kv_path(hd, False) == decode.kv_path(hd, False, 16) == "contiguous"
        assert decode.kv_path(hd, True) == "paged_rows"  # page_size None: not known
    for ps in (1, 2, 16, 64, 256, 1024):
        assert decode.kv_path(128, True, ps) == "paged_copy_pointers"
        assert decode.kv_path(64, True, ps) == "paged_copy_pointers"
        assert decode.kv_path(256, True, ps) == "paged_rows"  # would spill
    for ps in (3, 12, 100, 255, 0):
        assert decode.kv_path(128, True, ps) == "paged_rows"
    s = decode.split_kernel_spec("bfloat16", 128, True)
    assert s.name == "decode_split_bf16_hd128_n128_w8_g16_s3_paged"
    assert s.entry == ("cf::decode_split_kernel<__nv_bfloat16, 128, 128, 8, 16, 3, "
                       "cf::KvPath::kPagedRows>")
    cp = decode.split_kernel_spec("bfloat16", 128, True, page_size=16)
    assert cp.name == "decode_split_bf16_hd128_n128_w8_g16_s3_paged_cp"
    assert cp.entry == ("cf::decode_split_kernel<__nv_bfloat16, 128, 128, 8, 16, 3, "
                        "cf::KvPath::kPagedCopyPointers>")
    assert decode.split_kernel_spec("bfloat16", 128, True, page_size=24).name == s.name
    assert decode.split_kernel_spec("bfloat16", 128, False, page_size=24).name == \
        decode.split_kernel_spec("bfloat16", 128, False).name
    assert decode.split_kernel_spec("bfloat16", 256, True, page_size=16).name == \
        "decode_split_bf16_hd256_n32_w2_g16_s3_paged"
    # the kernel's DecodeTraits::kSmemBytes (an NVRTC probe): more keys per tile or more stages
    # take more
    assert s.smem_bytes == decode.split_smem_bytes("bfloat16", 128, 128, 3)
    s64 = decode.split_kernel_spec("bfloat16", 128, True, block_n=64, nwarps=4)
    assert s64.smem_bytes == decode.split_smem_bytes("bfloat16", 128, 64, 3) < s.smem_bytes
    assert decode.split_smem_bytes("bfloat16", 128, 64, 2) < s64.smem_bytes
    f = decode.split_kernel_spec("bfloat16", 128, False, block_n=32, nwarps=2, stages=6)
    assert f.name == "decode_split_bf16_hd128_n32_w2_g16_s6"
    assert f.entry == ("cf::decode_split_kernel<__nv_bfloat16, 128, 32, 2, 16, 6, "
                       "cf::KvPath::kContiguous>")
    assert decode.split_kernel_spec("float16", 64, False).name == \
        "decode_split_fp16_hd64_n128_w4_g16_s3"
    assert decode.combine_kernel_spec("float32").name == "decode_combine_fp32"
    assert decode.combine_kernel_spec("float32").source == "decode/combine.cu"
    assert decode.append_kernel_spec(True).name == "decode_append_b16_paged"
    assert decode.append_kernel_spec(True).source == "decode/append.cu"
    specs = decode.all_specs()
    names = [x.name for x in specs]
    # (2 dtypes x (hd64, hd128: contiguous, paged copy pointers, paged per-row ids; hd256:
    # contiguous, paged)) + hd128's 64 x 4 tiles (x 3 layouts) + hd128's two-stage contiguous
    # tiles (128 x 8 and 64 x 4) + combine + append
    assert len(names) == len(set(names)) == 2 * 8 + 2 * 3 + 2 * 2 + 3 + 2
    for x in specs:  # within the per-block opt-in limit; other paged tiles: two blocks per SM
        assert x.smem_bytes <= decode.H200_SMEM_PER_BLOCK_OPTIN
        if x.name.startswith("decode_split") and "_paged" in x.name and "_hd128_" not in x.name:
            assert 2 * (x.smem_bytes + 1024) <= decode.H200_SMEM_PER_SM
    assert decode.split_config(128) == decode.ONE_BLOCK_SPLIT_CONFIGS[128]
    assert decode.split_config(64) == decode.SPLIT_CONFIGS[64]
    # contiguous hd128: the measured 128-key x 8-warp tile (one block per SM)
    assert decode.split_kernel_spec("bfloat16", 128, False).name == \
        "decode_split_bf16_hd128_n128_w8_g16_s3"
    with pytest.raises(TypeError, match="dtype"):
        decode.split_kernel_spec("float32", 128, False)
    with pytest.raises(ValueError, match="headdim"):
        decode.split_kernel_spec("float16", 96, False)


@pytest.mark.parametrize("d,hd", [(8, 64), (64, 64), (72, 128), (128, 128), (136, 256),
                                  (256, 256)])
def test_padded_headdim(d, hd):
    assert decode.padded_headdim(d) == hd


@pytest.fixture(scope="module")
def compiled():
    return {(spec.name, arch): jit.compile_report(spec, arch)
            for spec in decode.all_specs() for arch in ("sm_90a", "sm_80")}


def test_every_spec_compiles_without_spills(compiled):
    for (name, arch), r in compiled.items():
        assert r.ptxas.spill_bytes == 0, (name, arch, r.ptxas)
        assert r.ptxas.stack_bytes == 0, (name, arch, r.ptxas)
        assert r.ptxas.registers <= 255, (name, arch, r.ptxas)
        assert r.ptxas.shared_bytes == 0, (name, arch)  # all shared memory is dynamic


def test_registers_allow_the_blocks_shared_memory_allows(compiled):
    """The planner counts blocks per SM from shared memory (two for the 64-key hd128 tile); the
    registers must not cut that: blocks x threads x registers <= 64K per SM. One exception,
    named: the two-stage 64-key hd128 tile (heuristics.choose_split_stages) would fit three
    blocks by shared memory, but its 191 registers allow two, which is what it was measured and
    is planned with (v24-v25); for it the check is two blocks, and that three do not fit."""
    two_by_registers = {f"decode_split_{t}_hd128_n64_w4_g16_s2" for t in ("bf16", "fp16")}
    seen = set()
    for spec in decode.all_specs():
        if not spec.name.startswith("decode_split"):
            continue
        nthreads = 32 * int(spec.name.split("_w")[1].split("_")[0])
        by_smem = max(1, decode.H200_SMEM_PER_SM // (spec.smem_bytes + 1024))
        r = compiled[(spec.name, "sm_90a")]
        if spec.name in two_by_registers:
            seen.add(spec.name)
            assert by_smem == 3 and 3 * nthreads * r.ptxas.registers > 65536, spec.name
            by_smem = 2
        assert by_smem * nthreads * r.ptxas.registers <= 65536, (spec.name, r.ptxas.registers)
    assert seen == two_by_registers


def test_paged_pools_past_32_bit_offsets_plan_the_general_kernel():
    """check_kvcache records whether a paged pool's page offsets fit 32 bits; where they do not
    (a page stride of 2^31 elements, negative strides), the plan and explain() name the general
    paged kernel and say why; the copy-pointer kernel refuses tiles that are not powers of two."""
    q, kc, vc, cs, bt = _arrays(dtype=np.float16, d=64, paged=True)
    ok = decode.explain_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt, report=False)
    assert ok.problem.page_offsets_fit_i32 and ok.name.endswith("_paged_cp")
    far = np.lib.stride_tricks.as_strided(kc, shape=kc.shape,
                                          strides=(2 ** 32,) + kc.strides[1:])
    rev = kc[::-1]
    for k_, v_ in ((far, vc), (kc, far), (rev, vc), (kc, rev[::-1][::-1])):
        p = decode.explain_kvcache(q, k_, v_, cache_seqlens=cs, block_table=bt, report=False)
        fits = k_ is kc and v_ is not far and v_.strides[0] > 0
        assert p.problem.page_offsets_fit_i32 == fits
        assert p.name.endswith("_paged" + ("_cp" if fits else ""))
        assert ("negative or >= 2^31 elements" in str(p)) != fits
    assert checks.element_strides(kc) == (16 * 2 * 64, 2 * 64, 64, 1)
    assert checks.page_offsets_fit_i32(16, kc, vc) and not checks.page_offsets_fit_i32(16, rev)
    big = np.lib.stride_tricks.as_strided(kc, shape=kc.shape, strides=(kc.strides[0], 2 ** 28,
                                                                       128, 2))
    assert not checks.page_offsets_fit_i32(16, big)  # 16 x 2^27 elements per page = 2^31
    assert checks.page_strides_fit_i32(16, (2 ** 31 - 1, 2 ** 27 - 1))
    assert not checks.page_strides_fit_i32(16, (0, 2 ** 27))
    with pytest.raises(ValueError, match="^block_n: paged copy pointers need block_n and the "
                                         "copy pass"):
        decode.split_kernel_spec("bfloat16", 64, True, block_n=96, nwarps=6, page_size=16)


def test_heads_mismatch_names_both_axes():
    """Fresh-user trial (2026-11-29, 79d6d60): 30 query heads against 8 KV heads blamed k_cache alone."""
    q, kc, vc, cs, bt = _arrays(dtype=np.float16, d=64, paged=True)
    q30 = np.zeros((2, 1, 3, 64), np.float16)
    with pytest.raises(ValueError, match=r"^k_cache: nheads_k 2 \(k_cache axis 2\) must divide "
                                         r"nheads 3 \(q axis 2\)"):
        decode.explain_kvcache(q30, kc, vc, cache_seqlens=cs, block_table=bt, report=False)


def test_explain_checks_cache_row_strides_on_host_arrays():
    """A fresh user's trial (2026-11-29, 98ed31f): explain() on NumPy arrays planned caches whose rows are
    not 16-byte aligned, which the call refuses; now it raises the call's message."""
    q, kc, vc, cs, bt = _arrays(dtype=np.float16, d=64, paged=True)
    wide = np.zeros(kc.shape[:-1] + (65,), kc.dtype)[..., :64]  # rows of 130 bytes
    for k_, v_, name in ((wide, vc, "k_cache"), (kc, wide, "v_cache")):
        with pytest.raises(ValueError, match=f"^{name}: rows must be 16-byte aligned for the "
                                             r"decode kernel \(strides \(4160, 260, 130, 2\)"):
            decode.explain_kvcache(q, k_, v_, cache_seqlens=cs, block_table=bt, report=False)


def test_ptxas_table_covers_every_spec(compiled):
    """The register table the report quotes (printed with ``pytest -s``): one row per public
    specialisation, with its sm_90a registers and the shared memory the launch asks for."""
    specs = {s.name: s for s in decode.all_specs()}
    rows = []
    for (name, arch), r in sorted(compiled.items()):
        if arch == "sm_90a":
            rows.append(f"{name:48s} regs {r.ptxas.registers:3d} smem "
                        f"{specs[name].smem_bytes:6d} spill {r.ptxas.spill_bytes}")
    assert len(rows) == len(specs) and all(" regs " in r for r in rows)
    print("\n".join(rows))


# ----------------------------------------------------------------------------------------------
# Split layout vs the reference's split boundaries
# ----------------------------------------------------------------------------------------------
@given(seqlen=st.integers(0, 2000), ns=st.integers(1, 40), bn=st.sampled_from([16, 32, 64, 128]))
def test_split_layout_matches_reference(seqlen, ns, bn):
    assert decode.split_layout(seqlen, ns, bn) == reference.split_boundaries(seqlen, ns, bn)


@given(seqlen=st.integers(0, 2000), tiles=st.integers(1, 10), bn=st.sampled_from([32, 64]),
       cap_extra=st.integers(0, 500))
def test_split_layout_fixed_size_covers_and_is_batch_independent(seqlen, tiles, bn, cap_extra):
    cap = seqlen + cap_extra
    ns = max(1, -(-(-(-cap // bn)) // tiles))  # as launch_config: ceil(capacity tiles / tiles)
    lay = decode.split_layout(seqlen, ns, bn, tiles)
    # contiguous cover of [0, seqlen)
    assert lay[0][0] == 0 and lay[-1][1] == seqlen
    assert all(a[1] == b[0] for a, b in zip(lay, lay[1:]))
    # boundaries depend on seqlen only: the same with a larger grid (bigger capacity elsewhere)
    lay2 = decode.split_layout(seqlen, ns + 5, bn, tiles)
    assert lay2[:ns] == lay and all(a == b for a, b in lay2[ns:])


# ----------------------------------------------------------------------------------------------
# NumPy emulation of the kernels' index arithmetic
# ----------------------------------------------------------------------------------------------
def _cache_offset(b, j, hk, cap_shape, bt, page_size, num_pages, paged, block_n=None):
    """(index tuple into the cache) or None, as the split kernel's load_tile (shift for powers
    of two). With ``block_n`` and page_size % block_n == 0 (tile_pages) the page id is the one
    prefetched for the tile's first key, as the kernel does; the row in the page is j's."""
    if paged:
        shift = int(math.log2(page_size)) if page_size & (page_size - 1) == 0 else -1
        slot_of = lambda x: (x >> shift) if shift >= 0 else x // page_size  # noqa: E731
        slot = slot_of(j)
        in_page = j - slot * page_size
        if block_n is not None and page_size % block_n == 0:
            slot = slot_of((j // block_n) * block_n)  # the tile's first key
        page = int(bt[b, slot])
        if page < 0 or page >= num_pages:
            return None
        return (page, in_page, hk)
    return (b, j, hk)


def emulate_decode(q, k_cache, v_cache, k, v, cache_seqlens, block_table, *, scale, causal,
                   num_splits, split_tiles, block_n, nwarps, group):
    """float64 mirror of decode_append_kernel + decode_split_kernel, whose last block of a row
    merges the splits' partial states (m, l, unnormalised acc; decode_merge, PartialMerge4).

    Returns (out, lse, o_part, ml_part, k_cache, v_cache) (caches updated in copies)."""
    batch, sq, nh, d = q.shape
    nhk = k_cache.shape[2]
    hpk = nh // nhk
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 0
    num_pages = k_cache.shape[0] if paged else 0
    cap = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    snew = 0 if k is None else k.shape[1]
    kc, vc = k_cache.copy(), v_cache.copy()
    # ---- append kernel
    for b in range(batch):
        for i in range(snew):
            pos = int(cache_seqlens[b]) + i
            if pos < 0 or pos >= cap:
                continue
            for h in range(nhk):
                off = _cache_offset(b, pos, h, None, block_table, page_size, num_pages, paged)
                if off is None:
                    continue
                kc[off] = k[b, i, h]
                vc[off] = v[b, i, h]
    # ---- split kernel
    rows = hpk * sq
    row_chunks = -(-rows // group)
    kpw = block_n // nwarps
    scale_log2 = scale * LOG2E
    o_part = np.full((num_splits, batch, sq, nh, d), np.nan)
    ml_part = np.full((num_splits, batch, nh, sq, 2), np.nan)
    out = np.full((batch, sq, nh, d), np.nan)
    lse_out = np.full((batch, nh, sq), np.nan)
    for split in range(num_splits):
        for b in range(batch):
            for z in range(nhk * row_chunks):
                hk, row_base = z // row_chunks, (z % row_chunks) * group
                ln = int(cache_seqlens[b]) + snew if cache_seqlens is not None else cap
                ln = max(0, min(ln, cap))
                n_tiles = -(-ln // block_n)
                tps = split_tiles if split_tiles > 0 else -(-n_tiles // num_splits)
                t0 = min(split * tps, n_tiles)
                t1 = min(t0 + tps, n_tiles)
                Q = np.zeros((group, d))
                lo = np.zeros(group, np.int64)
                hi = np.zeros(group, np.int64)
                for r in range(group):
                    rg = row_base + r
                    if rg < rows:
                        qi, h = rg // hpk, hk * hpk + rg % hpk
                        Q[r] = q[b, qi, h]
                        diag = qi + ln - sq  # mask.cuh visible_keys, window (-1, causal ? 0 : -1)
                        lo[r], hi[r] = 0, (min(ln, diag + 1) if causal else ln)
                m = np.full((nwarps, group), -np.inf)
                l = np.zeros((nwarps, group))
                acc = np.zeros((nwarps, group, d))
                for tile in range(t0, t1):
                    for w in range(nwarps):
                        js = tile * block_n + w * kpw + np.arange(kpw)
                        K = np.zeros((kpw, d))  # zero-fill: rows past len / bad pages
                        V = np.zeros((kpw, d))
                        for x, j in enumerate(js):
                            if j < ln:
                                off = _cache_offset(b, int(j), hk, None, block_table, page_size,
                                                    num_pages, paged, block_n)
                                if off is not None:
                                    K[x], V[x] = kc[off], vc[off]
                        s = (Q @ K.T) * scale_log2
                        vis = (js[None, :] >= lo[:, None]) & (js[None, :] < hi[:, None])
                        s = np.where(vis, s, -np.inf)
                        m_new = np.maximum(m[w], s.max(axis=1))
                        ref = np.where(m_new == -np.inf, 0.0, m_new)
                        corr = np.exp2(m[w] - ref)
                        p = np.exp2(s - ref[:, None])
                        l[w] = l[w] * corr + p.sum(axis=1)
                        acc[w] = acc[w] * corr[:, None] + p @ V
                        m[w] = m_new
                m_tot = m.max(axis=0)
                f = np.exp2(m - np.where(m_tot == -np.inf, 0.0, m_tot)[None, :])
                l_tot = (l * f).sum(axis=0)
                a = (acc * f[:, :, None]).sum(axis=0)  # unnormalised
                with np.errstate(divide="ignore"):
                    o = a * np.where(l_tot == 0, 0.0, 1.0 / np.where(l_tot == 0, 1.0, l_tot))[:, None]
                    lse = np.where(l_tot == 0, -np.inf, m_tot * LN2 + np.log(l_tot))
                for r in range(group):
                    rg = row_base + r
                    if rg >= rows:
                        continue
                    qi, h = rg // hpk, hk * hpk + rg % hpk
                    if num_splits == 1:
                        out[b, qi, h], lse_out[b, h, qi] = o[r], lse[r]
                    else:
                        o_part[split, b, qi, h] = a[r]
                        ml_part[split, b, h, qi] = m_tot[r], l_tot[r]
    # ---- the fused merge: per (row, column), the online softmax over the splits' (m, l, acc)
    if num_splits > 1:
        for b in range(batch):
            for i in range(sq):
                for h in range(nh):
                    m, l, acc = -np.inf, 0.0, np.zeros(d)
                    for s_ in range(num_splits):
                        m_u, l_u = ml_part[s_, b, h, i]
                        if m_u == -np.inf:
                            continue
                        m_new = max(m, m_u)
                        f, w = np.exp2(m - m_new), np.exp2(m_u - m_new)
                        l = l * f + w * l_u
                        acc = acc * f + w * o_part[s_, b, i, h]
                        m = m_new
                    out[b, i, h] = acc * (0.0 if l == 0 else 1.0 / l)
                    lse_out[b, h, i] = -np.inf if l == 0 else m * LN2 + np.log(l)
    return out, lse_out, o_part, ml_part, kc, vc


@st.composite
def emulation_configs(draw):
    nwarps = draw(st.sampled_from([1, 2, 4]))
    block_n = nwarps * draw(st.sampled_from([2, 4, 8]))
    fixed = draw(st.booleans())
    split_tiles = draw(st.integers(1, 4)) if fixed else 0
    num_splits = draw(st.sampled_from([1, 2, 3, 7, 40]))
    group = draw(st.sampled_from([1, 3, 16]))
    return dict(block_n=block_n, nwarps=nwarps, split_tiles=split_tiles, num_splits=num_splits,
                group=group)


@settings(max_examples=30)
@given(case=testing.kvcache_cases(dtypes=("float64",), max_headdim=16, max_seqlen_cache=64,
                                  max_batch=3, max_seqlen_q=6),
       cfg=emulation_configs())
def test_emulated_kernel_index_math_matches_reference(case, cfg):
    ref = reference.kvcache_attention_reference(*case.args(), **case.kwargs())
    scale = checks.resolve_softmax_scale(case.softmax_scale, case.q.shape[-1])
    ns = cfg["num_splits"]
    if cfg["split_tiles"]:  # fixed split size: the grid covers the capacity
        cap = (case.block_table.shape[1] * case.k_cache.shape[1] if case.paged
               else case.k_cache.shape[1])
        ns = max(1, -(-(-(-cap // cfg["block_n"])) // cfg["split_tiles"]))
    out, lse, o_part, ml_part, kc, vc = emulate_decode(
        case.q, case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens,
        case.block_table, scale=scale, causal=case.causal, num_splits=ns,
        split_tiles=cfg["split_tiles"], block_n=cfg["block_n"], nwarps=cfg["nwarps"],
        group=cfg["group"])
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    if ns > 1:  # every split wrote every row of the workspace (NaN-poisoned before)
        assert not np.isnan(ml_part).any() and not np.isnan(o_part).any()
    assert testing.rel_error(out, ref.out if hasattr(ref, "out") else ref[0]) <= 1e-12
    ref_lse = ref.lse if hasattr(ref, "lse") else ref[1]
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.allclose(lse[fin], ref_lse[fin], rtol=0, atol=1e-12)
    if case.k is not None:  # the append wrote exactly where the reference did
        ref_kc = ref[2]
        both = ~np.isnan(ref_kc)
        assert np.array_equal(np.isnan(kc), np.isnan(ref_kc))
        assert np.array_equal(kc[both], ref_kc[both])


def _kv_offset(headdim, row, chunk):
    """Mirror of DecodeTraits::kv_offset: element offset of 16-byte chunk `chunk` of `row`."""
    return row * headdim + (chunk ^ (row & 7)) * 8


@pytest.mark.parametrize("headdim,block_n,nwarps", [(64, 128, 4), (128, 64, 4), (128, 128, 8),
                                                    (256, 32, 2)])
def test_swizzled_kv_tile_layout(headdim, block_n, nwarps):
    """The K/V tile layout of the split kernel (swizzled 16-byte chunks, unpadded rows):
    * a bijection from (row, chunk) onto the tile's 16-byte slots;
    * the copies of one warp instruction (lane l: chunk l % chunks of row l // chunks, as the
      kernel's tid -> (row, chunk) map) fill whole 128-byte shared-memory lines, each line
      from one 128-byte global segment (what lets L1TEX send whole-line L2 requests);
    * every 8 x 16 B ldmatrix matrix the math reads (8 consecutive rows of one logical chunk;
      K: krow = key0 + (lane >> 4) * 8 + (lane & 7), V: vrow = key0 + ((lane >> 3) & 1) * 8 +
      (lane & 7)) touches 8 different 16-byte bank groups: conflict-free."""
    chunks = headdim // 8
    slots = {_kv_offset(headdim, r, c) for r in range(block_n) for c in range(chunks)}
    assert slots == set(range(0, block_n * headdim, 8))
    threads = nwarps * 32
    for warp in range(nwarps):  # first copy pass; later passes add threads // chunks rows
        lines = {}
        for lane in range(32):
            row, chunk = divmod(warp * 32 + lane, chunks)
            dst_line = _kv_offset(headdim, row, chunk) * 2 // 128
            lines.setdefault(dst_line, set()).add((row, chunk * 16 // 128))  # global segment
        assert all(len(segments) == 1 for segments in lines.values())
        assert len(lines) == 4  # 512 bytes: 4 whole lines of 8 lanes each
    assert threads % chunks == 0
    for key0 in range(0, block_n, 16):
        for logical in range(chunks):
            for rows in (range(key0, key0 + 8), range(key0 + 8, key0 + 16)):
                banks = {(_kv_offset(headdim, r, logical) * 2 // 16) % 8 for r in rows}
                assert len(banks) == 8, (key0, logical)


def test_emulation_merge_of_partials_equals_reference_merge():
    """The combine formula (skip -inf parts) equals reference.merge_states, NaN in empty parts."""
    rng = np.random.default_rng(0)
    o = rng.standard_normal((5, 2, 3, 4, 8))
    lse = rng.standard_normal((5, 2, 4, 3))
    lse[1] = -np.inf
    o[1] = np.nan
    lse[:, 1, 2, 0] = -np.inf
    ref_o, ref_l = reference.merge_states(o, lse)
    mx = lse.max(axis=0)
    w = np.where(lse == -np.inf, 0.0, np.exp(lse - np.where(mx == -np.inf, 0, mx)))
    ws = w.sum(axis=0)
    acc = np.einsum("pbhs,pbshd->bshd", w, np.where(np.isnan(o), 0.0, o))
    got = acc / np.where(ws == 0, 1, ws).transpose(0, 2, 1)[..., None]
    assert np.allclose(got, ref_o, atol=1e-14)
    assert np.isinf(ref_l[1, 2, 0]) and np.all(ref_o[1, 0, 2] == 0)


# ----------------------------------------------------------------------------------------------
# Plan
# ----------------------------------------------------------------------------------------------
def _problem(**kw):
    base = dict(batch=1, seqlen_q=1, nheads=32, nheads_k=8, headdim=128, dtype="bfloat16",
                softmax_scale=128 ** -0.5, causal=True, paged=False, seqlen_cache=131072,
                page_size=0, num_pages=0, max_pages_per_seq=0, seqlen_new=0, num_splits=0)
    base.update(kw)
    return checks.DecodeProblem(**base)


@given(batch=st.integers(1, 80), seqlen=st.integers(1, 70000), hk=st.sampled_from([1, 2, 8]),
       group=st.sampled_from([1, 4, 8]), sq=st.integers(1, 16),
       headdim=st.sampled_from([40, 64, 96, 128, 256]), page=st.sampled_from([0, 3, 16, 256]),
       num_splits=st.integers(0, 40), split_size=st.sampled_from([None, 1000, 8192]))
def test_reason_topics_are_given_with_each_reason(batch, seqlen, hk, group, sq, headdim, page,
                                                  num_splits, split_size):
    """launch_config names the topic of every reason where it gives it (REASON_TOPICS); the
    plan pairs them: the split count under num_splits, the depth under stages, the Q tile's and
    the paged copy path under copies, the grid and launch under note."""
    kw = dict(batch=batch, nheads=hk * group, nheads_k=hk, headdim=headdim, seqlen_q=sq,
              num_splits=num_splits, seqlen_cache=seqlen)
    if page:
        pages = -(-seqlen // page)
        kw.update(paged=True, page_size=page, seqlen_cache=pages * page,
                  num_pages=batch * pages, max_pages_per_seq=pages)
    la = decode.launch_config(_problem(**kw), split_size=split_size)
    assert len(la.reason_topics) == len(la.reasons) and la.reasons
    assert set(la.reason_topics) <= set(decode.REASON_TOPICS)
    by = {}
    for topic, text in zip(la.reason_topics, la.reasons):
        by.setdefault(topic, []).append(text)
    assert any(t.startswith(("num_splits=", "split_size=")) for t in by["num_splits"])
    assert any(t.startswith("grid (") for t in by["note"])
    stages = by.get("stages", [])
    assert all("K/V stages instead" in t or "stages need" in t
               or ("K/V stages kept" in t and page) for t in stages)  # "kept": pages only
    assert ("K/V stages instead" in " ".join(la.reasons)) == ("stages" in by) or \
        any("stages need" in t or "K/V stages kept" in t for t in stages)
    copies = by["copies"]  # the Q tile's copy always (v44); the pages' copy path when paged
    assert sum(t.startswith("q: ") for t in copies) == 1
    assert (len(copies) == 2) == bool(page)
    assert (headdim != decode.padded_headdim(headdim)) == any(
        t.startswith(f"headdim {headdim} runs") for t in by.get("tile", []))


def test_plan_llama_decode():
    p = decode.launch_config(_problem())
    # 16 splits of 8192 keys: the two-stage pipeline (heuristics.choose_split_stages, v26)
    assert p.kernel == "decode_split_bf16_hd128_n128_w8_g16_s2"
    assert any("2 K/V stages instead of 3" in r for r in p.reasons)
    assert p.smem_bytes == decode.split_smem_bytes("bfloat16", 128, 128, 2)
    assert p.grid == (8, 16, 1) and p.block == (256, 1, 1)
    assert p.num_splits == 16 and p.append is None  # fused combine: no combine launch
    # fp32 partials (accumulators and (m, l) pairs), then int32 counters (batch, nheads_k,
    # row_chunks)
    assert p.counter_elems == 8
    assert p.workspace_elems == 16 * 1 * 1 * 32 * (128 + 2) + 8
    assert any("heuristic" in r for r in p.reasons)
    assert any("fused combine" in r for r in p.reasons)
    p1 = decode.launch_config(_problem(batch=64, seqlen_cache=4096))
    assert p1.num_splits == 1 and p1.workspace_elems == 0
    assert p1.counter_elems == 0
    # 512 blocks unsplit (several waves): the 64-key tile at two blocks per SM (v9), from 4k
    # keys with two stages (v24-v25), but not with an explicit num_splits or split_size (a row's
    # result must not depend on the batch); 4096 keys per split keep the one-block tile's 3
    assert p1.kernel == "decode_split_bf16_hd128_n64_w4_g16_s2"
    assert any("two blocks per SM" in r for r in p1.reasons)
    assert any("2 K/V stages instead of 3" in r and "several waves" in r for r in p1.reasons)
    p2 = decode.launch_config(_problem(batch=64, seqlen_cache=2048))
    assert p2.kernel == "decode_split_bf16_hd128_n64_w4_g16_s3"
    assert not any("K/V stages instead" in r for r in p2.reasons)
    for kw, opts in ((dict(num_splits=1), {}), ({}, dict(split_size=4096))):
        pe = decode.launch_config(_problem(batch=64, seqlen_cache=4096, **kw), **opts)
        assert pe.kernel == "decode_split_bf16_hd128_n128_w8_g16_s3"
    # one split of 16k keys: two stages; an explicit split count that leaves 8k per split too
    assert decode.launch_config(_problem(batch=16, seqlen_cache=16384)).template["stages"] == 2
    assert decode.launch_config(_problem(batch=16, seqlen_cache=8192)).template["stages"] == 2
    assert decode.launch_config(_problem(batch=16, seqlen_cache=8064)).template["stages"] == 3
    assert decode.launch_config(_problem(num_splits=32)).template["stages"] == 3  # 4k per split
    # split_size: the fixed keys per split decide, not capacity / num_splits (helper review)
    for cap in (16384, 16385, 24576, 24577):
        ps = decode.launch_config(_problem(seqlen_cache=cap), split_size=8192)
        assert ps.template["stages"] == 2, (cap, ps.num_splits)
        assert decode.launch_config(_problem(seqlen_cache=cap),
                                    split_size=4096).template["stages"] == 3
    assert decode.launch_config(_problem(batch=16, seqlen_cache=4096)).template["block_n"] == 128
    assert decode.launch_config(_problem(batch=17, seqlen_cache=4096)).template["block_n"] == 64
    # only where two of those blocks fit an SM (an A100's 164 KB: one would; keep the 128 x 8)
    a100 = decode.launch_config(_problem(batch=32, seqlen_cache=4096), num_sms=108,
                                smem_per_sm=167936, max_smem_per_block=166912)
    assert a100.template["block_n"] == 128 and a100.template["stages"] == 2
    # paged hd128 caches: the same one-block tile and split count as contiguous ones, for any
    # page size, with three stages (two were slower at pages of 16, v25) (v6 sweep, page ids by cp.async: page 16 b1 x 128k 4.02 TB/s at 16 splits vs
    # 3.82 for 64 x 4 at 33; b16 x 16k pages 16 / 64 / 256 4.32-4.35 at 1 split); copy
    # pointers for powers of two (v20), said in the reasons
    for ps in (16, 64, 128, 256, 3):
        cap = -(-131072 // ps) * ps
        pg = decode.launch_config(_problem(paged=True, page_size=ps, seqlen_cache=cap,
                                           num_pages=cap // ps, max_pages_per_seq=cap // ps))
        assert pg.kernel == "decode_split_bf16_hd128_n128_w8_g16_s3_paged" + (
            "" if ps == 3 else "_cp")
        assert any((f"page_size {ps} is not a power of two" if ps == 3 else
                    f"page_size {ps} (a power of two): copy pointers") in r for r in pg.reasons)
        assert pg.num_splits == 16 and pg.block == (256, 1, 1)
        pb = decode.launch_config(_problem(batch=16, seqlen_cache=16384 // ps * ps, paged=True,
                                           page_size=ps, num_pages=16 * (16384 // ps),
                                           max_pages_per_seq=16384 // ps))
        assert pb.num_splits == 1 and pb.counter_elems == 0
    # other head dims' paged tiles still fill two blocks per SM
    p64 = decode.launch_config(_problem(headdim=64, paged=True, page_size=16, num_pages=8192,
                                        max_pages_per_seq=8192))
    assert p64.kernel == "decode_split_bf16_hd64_n128_w4_g16_s3_paged_cp"
    p256 = decode.launch_config(_problem(headdim=256, paged=True, page_size=16, num_pages=8192,
                                         max_pages_per_seq=8192))
    assert p256.kernel.endswith("_paged")
    assert any("hd256 paged: the general paged path" in r for r in p256.reasons)
    assert p64.num_splits == 33  # floor(2 * 132 / 8) blocks per KV head
    assert decode.launch_config(_problem(batch=16, seqlen_cache=16384)).num_splits == 1


def test_plan_row_chunks_padding_split_size_and_small_smem():
    p = decode.launch_config(_problem(nheads=64, nheads_k=8, seqlen_q=4, headdim=96,
                                    paged=True, page_size=3, seqlen_cache=300,
                                    num_pages=200, max_pages_per_seq=100, seqlen_new=2))
    assert p.row_chunks == 2 and p.grid[2] == 16 and p.template["headdim"] == 128
    assert p.kernel.endswith("_paged") and p.append == "decode_append_b16_paged"
    q = decode.launch_config(_problem(seqlen_cache=1000), split_size=100)
    assert q.split_tiles == 1 and q.num_splits == 8  # ceil(1000/128)=8 tiles / 1
    qp = decode.launch_config(_problem(seqlen_cache=1024, paged=True, page_size=16,
                                       num_pages=64, max_pages_per_seq=64), split_size=100)
    assert qp.split_tiles == 1 and qp.num_splits == 8  # ceil(1024/128)=8 tiles / 1
    # an sm_86-like device (99 KB per block): the 64-key tile with two stages
    r = decode.launch_config(_problem(), max_smem_per_block=101376, smem_per_sm=102400)
    assert r.template["stages"] == 2 and r.smem_bytes <= 101376
    assert r.kernel == "decode_split_bf16_hd128_n64_w4_g16_s2"
    assert any("does not fit" in x for x in r.reasons)
    with pytest.raises(ValueError, match="split_size"):
        decode.launch_config(_problem(), split_size=0)


def test_explain_kvcache_on_host_arrays():
    q, kc, vc, cs, bt = _arrays(dtype=np.float16, d=96, paged=True)
    plan = decode.explain_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt, num_splits=3)
    assert plan.name == "decode_split_fp16_hd128_n128_w8_g16_s3_paged_cp"
    assert plan.num_splits == 3 and plan.grid == (3, 2, 2) and plan.spill_bytes == 0
    assert [e.name for e in plan.extra_kernels] == []  # fused combine: no combine launch
    names = [r[0] for r in plan.rejected]
    assert "decode_split_fp16_hd64_n128_w4_g16_s3_paged_cp" in names
    assert "page_size 16 (a power of two): copy pointers" in str(plan)
    # the choice's reasons are listed apart from the rejected specialisations (fresh-user trial)
    assert "num_splits" in [r[0] for r in plan.reasons] and "num_splits" not in names
    assert all(n.startswith("decode_") for n in names)
    assert "  why (" in str(plan) and str(plan).index("  why (") < str(plan).index("  rejected (")
    assert "decode_split_fp16_hd128_n128_w8_g16_s3" in names
    str(plan), plan.as_dict()  # printable and JSON-ready


def test_explain_says_how_q_is_copied():
    """explain_kvcache names how the kernel will copy the Q tile (v44, fresh-user trial of
    2026-11-30, 0a04612): by 16-byte cp.async when q's strides (and, for device arrays, pointer) are
    16-byte multiples, else by 2-byte loads; a dim of one element never counts."""
    _, kc, vc, cs, bt = _arrays(dtype=np.float16, d=64, paged=True)

    def q_line(q):
        plan = decode.explain_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt, report=False)
        lines = [t for topic, t in plan.reasons if topic == "copies" and t.startswith("q: ")]
        assert len(lines) == 1 and plan.problem.q_aligned16 == lines[0].startswith(
            "q: the Q tile by 16-byte cp.async"), lines
        return plan.problem.q_aligned16

    q = np.ones((2, 1, 4, 64), np.float16)
    assert q_line(q)
    wide = np.ones((2, 1, 4, 65), np.float16)[..., :64]  # head stride 65 elements: 130 bytes
    assert not q_line(wide)
    odd_batch = np.lib.stride_tricks.as_strided(q, (2, 1, 4, 64), (4 * 64 * 2 + 2, 2, 128, 2))
    assert not q_line(odd_batch)  # batch stride 514 bytes
    one = np.lib.stride_tricks.as_strided(q[:1], (1, 1, 4, 64), (6, 10, 128, 2))  # size-1 dims
    assert checks.aligned16(one) and not checks.aligned16(wide)
    assert checks.device_pointer(q) is None  # a host pointer is not the kernel's


def test_plan_says_when_it_assumed_an_h200():
    """Without a visible GPU a plan is made for an H200's 132 SMs; the plan says so (and how to
    plan for another GPU) unless num_sms was given, which changes the split count."""
    q = np.zeros((1, 1, 32, 128), ml_dtypes.bfloat16)
    kc = np.zeros((1, 8192, 8, 128), ml_dtypes.bfloat16)
    cs = np.full(1, 8192, np.int32)
    if not decode_plan._planning_limits().get("assumed"):
        pytest.skip("a GPU is visible: its limits are used")
    plan = decode.explain_kvcache(q, kc, kc, cache_seqlens=cs, arch="sm_80", report=False)
    assert ("note", "planned for 132 SMs, an H200's: no GPU is visible here; pass num_sms= "
                    "(and the device's arch) for another GPU") in plan.reasons
    a100 = decode.explain_kvcache(q, kc, kc, cache_seqlens=cs, arch="sm_80", report=False,
                                  num_sms=108)
    assert a100.num_sms == 108 and not any("H200" in r[1] for r in a100.reasons)
    assert a100.num_splits != plan.num_splits


def test_plan_decode_is_a_dispatch_plan_with_ptxas_report():
    from cupyflash.core import planning
    p = decode.plan_decode(_problem(seqlen_new=2), arch="sm_90a")
    assert isinstance(p, planning.Plan) and p.num_splits == 16 and p.num_sms == 132
    assert p.spill_bytes == 0 and 0 < p.registers <= 255 and p.kernel.arch == "sm_90a"
    assert [e.name for e in p.extra_kernels] == ["decode_append_b16"]
    assert p.hbm_bytes > 2 * 131072 * 8 * 128 * 2 and p.flops > 0
    with pytest.raises(TypeError, match="problem"):
        decode.plan_decode(object())


# ----------------------------------------------------------------------------------------------
# Bad inputs raise before any kernel is requested
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def no_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel was requested for an invalid call")
    monkeypatch.setattr(jit, "get_kernel", boom)


def _arrays(dtype=np.float16, d=64, paged=False):
    q = np.zeros((2, 1, 4, d), dtype)
    if paged:
        kc = np.zeros((6, 16, 2, d), dtype)
        bt = np.arange(6, dtype=np.int32).reshape(2, 3)
    else:
        kc = np.zeros((2, 48, 2, d), dtype)
        bt = None
    return q, kc, kc.copy(), np.array([3, 5], np.int32), bt


def test_host_planning_messages_from_a_second_users_trial():
    """Second user's trial (2026-11-29, 938adf0): planning limits name the argument; a
    (b, h, s, d) tensor is a hint."""
    q, kc, vc, cs, bt = _arrays(paged=True)
    with pytest.raises(ValueError, match="^num_sms: expected an int >= 1 or None, got 'x'"):
        decode.explain_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt, num_sms="x",
                               report=False)
    qt = np.zeros((2, 4, 1, 64), np.float16)  # (batch, nheads, seqlen, headdim): transposed
    with pytest.raises(ValueError, match="must be transposed first"):
        decode.explain_kvcache(qt, kc, vc, cache_seqlens=cs, block_table=bt, report=False)


def test_host_planning_messages_from_a_new_users_trial():
    """What a first-time user hit on the CPU: errors naming the argument, offline sizing."""
    q, kc, vc, cs, bt = _arrays(paged=True)
    with pytest.raises(ValueError, match=r"^k_cache: batch 6 must match q batch 2 .*needs "
                                         r"block_table"):
        decode.explain_kvcache(q, kc, vc, cache_seqlens=cs, report=False)
    with pytest.raises(ValueError, match=r"^q: seqlen_q is 0"):
        decode.explain_kvcache(q[:, :0], kc, vc, cache_seqlens=cs, block_table=bt, report=False)
    # workspace sizing without a GPU (host arrays): planned for an H200, no device touched
    big = np.zeros((1, 8192, 2, 64), np.float16)
    n = decode.workspace_size(q[:1], big, big, cache_seqlens=cs[:1])
    plan = decode.explain_kvcache(q[:1], big, big, cache_seqlens=cs[:1], report=False)
    assert n == decode.workspace_elems(1, 1, 4, 64, plan.num_splits) + 2 and plan.num_splits > 1
    # split_size overrides num_splits, and the plan says so
    p = decode.explain_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt, num_splits=3,
                               split_size=16, report=False)
    assert any("num_splits=3 ignored" in r for _, r in p.reasons)
    # the SM count of an offline plan
    p80 = decode.explain_kvcache(q[:1], big, big, cache_seqlens=cs[:1], report=False,
                                 num_sms=108)
    assert p80.num_sms == 108


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a.update(q=a["q"].astype(np.float32), k_cache=a["k_cache"].astype(np.float32),
                        v_cache=a["v_cache"].astype(np.float32)), TypeError, "q: dtype float32"),
    (lambda a: a.update(q=np.zeros((2, 1, 3, 64), np.float16)), ValueError, "nheads_k"),
    (lambda a: a.update(cache_seqlens=np.array([3, 49], np.int32)), ValueError, "cache_seqlens"),
    (lambda a: a.update(cache_seqlens=np.array([3, 2 ** 31], np.int64)), ValueError,
     "cache_seqlens: values must fit int32"),
    (lambda a: a.update(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (lambda a: a.update(num_splits=-1), ValueError, "num_splits"),
    (lambda a: None, TypeError, "q: flash_attn_with_kvcache runs on the GPU"),
])
def test_bad_inputs_raise_before_launch(no_launch, mutate, exc, match):
    q, kc, vc, cs, _ = _arrays()
    a = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=cs)
    mutate(a)
    with pytest.raises(exc, match=match):
        decode.flash_attn_with_kvcache(**a)


def test_bad_page_id_raises_in_validate_mode(no_launch):
    q, kc, vc, cs, bt = _arrays(paged=True)
    bt[1, 0] = 6  # outside the pool of 6 pages, used by sequence 1
    with pytest.raises(ValueError, match=r"block_table: page id block_table\[1, 0\]=6"):
        decode.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt)


def test_merge_states_host_arrays_raise(no_launch):
    o = np.zeros((2, 1, 1, 1, 8), np.float32)
    lse = np.zeros((2, 1, 1, 1), np.float32)
    with pytest.raises(TypeError, match="reference.merge_states"):
        decode.merge_states(o, lse)
    with pytest.raises(ValueError, match="lse_parts"):
        decode.merge_states(o, np.zeros((2, 1, 1, 2), np.float32))


# ----------------------------------------------------------------------------------------------
# Lane-level emulation of the split kernel's ldmatrix / mma fragment addressing
# ----------------------------------------------------------------------------------------------
def _ldmatrix_x4(smem, addr_of_lane, trans):
    """regs[lane][i] = (lo, hi) of matrix i, as PTX ldmatrix.m8n8.x4(.trans) defines them:
    lanes 8i..8i+7 give the (row, col) start of matrix i's 8 rows (8 consecutive elements)."""
    mats = []
    for i in range(4):
        rows = [addr_of_lane(8 * i + r) for r in range(8)]
        mats.append(np.array([smem[r, c:c + 8] for r, c in rows]))  # 8 x 8
    regs = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        regs.append([(m[2 * t, g], m[2 * t + 1, g]) if trans else (m[g, 2 * t], m[g, 2 * t + 1])
                     for m in mats])
    return regs


def _mma(acc, a, b0, b1):
    """acc[lane][4] += A (16x16 from a[lane][4]) @ B (16x8 from b0/b1[lane]) in fragment layout."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, 2 * t:2 * t + 2] = a[lane][0]
        A[g + 8, 2 * t:2 * t + 2] = a[lane][1]
        A[g, 2 * t + 8:2 * t + 10] = a[lane][2]
        A[g + 8, 2 * t + 8:2 * t + 10] = a[lane][3]
        B[2 * t:2 * t + 2, g] = b0[lane]
        B[2 * t + 8:2 * t + 10, g] = b1[lane]
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        acc[lane] += np.array([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])


@pytest.mark.parametrize("headdim,block_n,nwarps", [(64, 128, 4), (128, 64, 4), (256, 32, 2)])
def test_fragment_addressing_computes_qk_and_pv(headdim, block_n, nwarps):
    """The kernel's ldmatrix addresses (sQ_addr, krow/kcol, vrow/vcol) and the P -> A-fragment
    repacking, emulated lane by lane, give S = Q K^T and O = P V for every warp's keys."""
    rng = np.random.default_rng(headdim)
    rs = headdim + 8  # kRowStride
    sQ = rng.standard_normal((16, rs))
    sK = rng.standard_normal((block_n, rs))
    sV = rng.standard_normal((block_n, rs))
    kpw = block_n // nwarps
    for warp in range(nwarps):
        warp_key0 = warp * kpw
        ksteps = kpw // 16
        s = [[np.zeros((32, 4)) for _ in range(2)] for _ in range(ksteps)]
        for ks in range(headdim // 16):
            a = _ldmatrix_x4(sQ, lambda l: (l & 15, (l >> 4) * 8 + ks * 16), False)
            for kw in range(ksteps):
                bk = _ldmatrix_x4(sK, lambda l: (warp_key0 + kw * 16 + (l >> 4) * 8 + (l & 7),
                                                 ks * 16 + ((l >> 3) & 1) * 8), False)
                _mma(s[kw][0], a, [r[0] for r in bk], [r[1] for r in bk])
                _mma(s[kw][1], a, [r[2] for r in bk], [r[3] for r in bk])
        # S fragments: c[e] = S[g + 8 * (e >> 1)][key0 + kw * 16 + nt * 8 + 2t + (e & 1)]
        S_ref = sQ[:, :headdim] @ sK[:, :headdim].T
        acc = [np.zeros((32, 4)) for _ in range(headdim // 8)]
        P = rng.standard_normal((16, block_n))  # stand-in probabilities for this warp's keys
        for kw in range(ksteps):
            for nt in range(2):
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for e in range(4):
                        j = warp_key0 + kw * 16 + nt * 8 + 2 * t + (e & 1)
                        assert np.isclose(s[kw][nt][lane, e], S_ref[g + 8 * (e >> 1), j])
            pa = []
            for lane in range(32):  # pa[0..3] = pack(s[kw][0][0..1]), (s[kw][0][2..3]), ...
                g, t = lane >> 2, lane & 3
                row = lambda e: g + 8 * (e >> 1)  # noqa: E731
                col = lambda nt, e: warp_key0 + kw * 16 + nt * 8 + 2 * t + (e & 1)  # noqa: E731
                frag = [[P[row(e), col(nt, e)] for e in range(4)] for nt in range(2)]
                pa.append([(frag[0][0], frag[0][1]), (frag[0][2], frag[0][3]),
                           (frag[1][0], frag[1][1]), (frag[1][2], frag[1][3])])
            for dn in range(headdim // 16):
                bv = _ldmatrix_x4(sV, lambda l: (warp_key0 + kw * 16 + ((l >> 3) & 1) * 8 + (l & 7),
                                                 dn * 16 + (l >> 4) * 8), True)
                _mma(acc[2 * dn], pa, [r[0] for r in bv], [r[1] for r in bv])
                _mma(acc[2 * dn + 1], pa, [r[2] for r in bv], [r[3] for r in bv])
        keys = slice(warp_key0, warp_key0 + kpw)
        O_ref = P[:, keys] @ sV[keys, :headdim]
        for dt in range(headdim // 8):  # epilogue: sO[g + 8rh][dt * 8 + 2t + {0,1}] = acc[dt][2rh + {0,1}]
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for rh in range(2):
                    for x in range(2):
                        assert np.isclose(acc[dt][lane, 2 * rh + x], O_ref[g + 8 * rh, dt * 8 + 2 * t + x])


def test_plan_spec_matches_the_launch_geometry_on_small_smem_devices():
    # sm_86-like limits: the contiguous 128-key tile does not fit, the 64-key tile is planned,
    # and every place that names the kernel names that one (the plan's spec, which the launch
    # path compiles, is the one its template values give)
    for kw in (dict(), dict(max_smem_per_block=101376, smem_per_sm=102400)):
        la = decode.launch_config(_problem(), **kw)
        t = la.template
        spec = decode.split_kernel_spec(t["dtype"], t["headdim"], False, block_n=t["block_n"],
                                        nwarps=t["nwarps"], stages=t["stages"])
        assert spec == la.spec and spec.name == la.kernel and la.block == (32 * t["nwarps"], 1, 1)
        assert spec.smem_bytes == la.smem_bytes
    q = np.zeros((1, 1, 32, 128), np.float16)
    kc = np.zeros((1, 4096, 8, 128), np.float16)
    p86 = decode.explain_kvcache(q, kc, kc, arch="sm_86", report=False)
    assert p86.name == "decode_split_fp16_hd128_n64_w4_g16_s2" and p86.block == (128, 1, 1)
    assert p86.smem_bytes <= 99 * 1024


# ----------------------------------------------------------------------------------------------
# Speculative page ids (v13): the split kernel's two partitions, restated (decode/split.cu,
# decode_split: the guess for len = capacity, then the real one)
# ----------------------------------------------------------------------------------------------
def _split_tiles(length, block_n, num_splits, split_tiles, split):
    n_tiles = -(-length // block_n)
    tps = split_tiles if split_tiles > 0 else -(-n_tiles // num_splits)
    begin = min(split * tps, n_tiles)
    return begin, min(begin + tps, n_tiles)


@settings(max_examples=400, deadline=None)
@given(page=st.sampled_from([1, 3, 16, 64, 128, 256]), max_pages=st.integers(1, 80),
       block_n=st.sampled_from([32, 64, 128]), num_splits=st.integers(1, 40),
       split_tiles=st.sampled_from([0, 0, 1, 2, 5]), stages=st.integers(2, 6), data=st.data())
def test_speculative_page_ids_cover_the_prologue_when_the_guess_is_right(
        page, max_pages, block_n, num_splits, split_tiles, stages, data):
    """Where the guessed split (the sequence filling its block_table row) starts at the real
    split's first tile, the speculative fetch holds every id the prologue needs: its tiles
    reach at least as far (the real split is never longer) and its rows cover j < len; and
    the fetch only reads table slots < max_pages_per_seq."""
    cap = max_pages * page
    length = data.draw(st.integers(0, cap))
    split = data.draw(st.integers(0, num_splits - 1))
    begin, end = _split_tiles(length, block_n, num_splits, split_tiles, split)
    g_begin, g_end = _split_tiles(cap, block_n, num_splits, split_tiles, split)
    if begin == g_begin:
        assert end <= g_end
        for s in range(stages - 1):
            t = begin + s
            if t < end:  # the prologue needs tile t's ids for rows j < length
                assert t < g_end
                rows = range(t * block_n, min((t + 1) * block_n, length))
                assert all(j < cap for j in rows)  # fetched: rows j < cap
    fetched_slots = {j // page for s in range(stages - 1) if g_begin + s < g_end
                     for j in range((g_begin + s) * block_n, min((g_begin + s + 1) * block_n, cap))}
    assert all(0 <= x < max_pages for x in fetched_slots)


def _kernel_block_coords(block_idx, grid_order):
    """Mirror of decode_split's (split, b, hz) from blockIdx (decode/split.cu, DecodeSplitExtra)."""
    x, y, z = block_idx
    return (x, y, z) if grid_order == 0 else (y, z, x)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("ns,batch,head_blocks", [(1, 1, 8), (16, 1, 8), (3, 5, 4), (7, 2, 16)])
def test_public_grid_and_grid_order_cover_every_split_sequence_and_head_once(paged, ns, batch,
                                                                            head_blocks):
    """The grid the public path launches (decode_plan._split_grid) and the grid_order it
    passes (decode_plan._grid_order) make the kernel visit every (split, sequence, KV-head
    block) exactly once: contiguous caches heads first, paged caches splits first (v16)."""
    grid = decode_plan._split_grid(paged, ns, batch, head_blocks)
    order = decode_plan._grid_order(paged)
    assert order == (0 if paged else 1)
    seen = [_kernel_block_coords((x, y, z), order)
            for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2])]
    assert sorted(seen) == sorted((s, b, h) for s in range(ns) for b in range(batch)
                                  for h in range(head_blocks))
    plan = decode.launch_config(_problem(batch=batch, seqlen_cache=4096, paged=paged,
                                         **({"page_size": 16, "num_pages": 4096 * batch // 16,
                                             "max_pages_per_seq": 256} if paged else {})),)
    assert plan.grid == decode_plan._split_grid(paged, plan.num_splits, batch,
                                           8 * plan.row_chunks)


def test_grid_limits_checked_before_launch_and_grid_order_explained():
    """Contiguous caches put num_splits on gridDim.y (<= 65535): more splits is a clear
    ValueError from the planner (hence before any launch); paged caches put them on x. The plan
    notes say the grid order and the PDL launch."""
    q = np.zeros((1, 1, 8, 128), ml_dtypes.bfloat16)
    kc = np.zeros((1, 256, 2, 128), ml_dtypes.bfloat16)
    cs = np.array([256], np.int32)
    with pytest.raises(ValueError, match="num_splits: 70000 exceeds 65535"):
        decode.explain_kvcache(q, kc, kc, cache_seqlens=cs, num_splits=70000, report=False)
    plan = decode.explain_kvcache(q, kc, kc, cache_seqlens=cs, num_splits=65535, report=False)
    assert plan.kernel.grid == (2, 65535, 1)
    notes = [r for k, r in plan.reasons if k == "note"]
    assert any(r.startswith("grid (2, 65535, 1): (KV-head blocks, splits, batch)") for r in notes)
    assert any("programmatic dependent launch" in r for r in notes)
    pool = np.zeros((16, 16, 2, 128), ml_dtypes.bfloat16)
    bt = np.arange(16, dtype=np.int32).reshape(1, 16)
    paged = decode.explain_kvcache(q, pool, pool, cache_seqlens=cs, block_table=bt,
                                   num_splits=70000, report=False)
    assert paged.kernel.grid == (70000, 1, 2)


def test_pdl_launches_restores_the_switch():
    prev = decode.PDL
    with decode.pdl_launches(not prev):
        assert decode.PDL is (not prev)
        with decode.pdl_launches(prev):
            assert decode.PDL is prev
        assert decode.PDL is (not prev)
    assert decode.PDL is prev
    with pytest.raises(RuntimeError):
        with decode.pdl_launches(False):
            raise RuntimeError("inside")
    assert decode.PDL is prev
    with pytest.raises(TypeError, match="enabled"):
        with decode.pdl_launches(0):
            pass


def test_explain_kvcache_takes_the_calls_arguments():
    """explain_kvcache's parameters are flash_attn_with_kvcache's, in the call's order, then
    keyword-only arch / report / num_sms; out, return_lse and workspace are checked as the call
    checks them, and the plan states the workspace it needs."""
    import inspect
    call = list(inspect.signature(decode.flash_attn_with_kvcache).parameters)
    sig = inspect.signature(decode.explain_kvcache).parameters
    assert list(sig)[:len(call)] == call
    assert all(sig[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("arch", "report", "num_sms"))
    bf = ml_dtypes.bfloat16
    q = np.zeros((1, 1, 32, 128), bf)
    kc = np.zeros((1, 8192, 8, 128), bf)
    cs = np.full(1, 8000, np.int32)
    plan = decode.explain_kvcache(q, kc, kc, cache_seqlens=cs, out=np.zeros_like(q),
                                  return_lse=True, report=False, num_sms=132)
    need = decode.workspace_size(q, kc, kc, cache_seqlens=cs)
    assert plan.num_splits > 1 and plan.workspace_elems == need > 0
    assert f"workspace_elems={need}" in str(plan) and plan.as_dict()["workspace_elems"] == need
    ok = decode.explain_kvcache(q, kc, kc, cache_seqlens=cs, workspace=np.zeros(need, np.float32),
                                report=False, num_sms=132)
    assert ok.name == plan.name
    with pytest.raises(ValueError, match=f"workspace: .* at least {need} elements"):
        decode.explain_kvcache(q, kc, kc, cache_seqlens=cs, workspace=np.zeros(need - 1, np.float32),
                               report=False, num_sms=132)
    with pytest.raises(TypeError, match="workspace: expected float32, got float16"):
        decode.explain_kvcache(q, kc, kc, cache_seqlens=cs, workspace=np.zeros(need, np.float16),
                               report=False, num_sms=132)
    with pytest.raises(TypeError, match="return_lse: expected a bool"):
        decode.explain_kvcache(q, kc, kc, cache_seqlens=cs, return_lse=1, report=False)
    with pytest.raises(ValueError, match="out: .*shape"):
        decode.explain_kvcache(q, kc, kc, cache_seqlens=cs, out=np.zeros((1, 1, 32, 64), bf),
                               report=False)
    strided = np.zeros((1, 1, 32, 256), bf)[..., ::2]  # headdim 128 with stride 2
    with pytest.raises(ValueError, match="q: last dimension must be contiguous"):
        decode.explain_kvcache(strided, kc, kc, cache_seqlens=cs, report=False)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a.update(cache_seqlens=np.array([3, -1], np.int32)), ValueError,
     r"^cache_seqlens: must be >= 0, got cache_seqlens\[1\]=-1$"),
    (lambda a: a.update(cache_seqlens=np.array([3, 49], np.int32)), ValueError,
     r"^cache_seqlens: cache_seqlens\[1\]=49 \+ seqlen_new 0 exceeds the cache capacity 48 "
     r"\(max_pages_per_seq \* page_size\)$"),
    (lambda a: a.update(k=np.zeros((2, 2, 2, 64), np.float16),
                        v=np.zeros((2, 2, 2, 64), np.float16),
                        cache_seqlens=np.array([46, 47], np.int32)), ValueError,
     r"^cache_seqlens: cache_seqlens\[1\]=47 \+ seqlen_new 2 exceeds the cache capacity 48"),
    (lambda a: a["block_table"].__setitem__((1, 0), 6), ValueError,
     r"^block_table: page id block_table\[1, 0\]=6 is outside the pool \[0, 6\) \(sequence 1 "
     r"uses 1 page\)$"),
    (lambda a: a["block_table"].__setitem__((0, 0), -2), ValueError,
     r"^block_table: page id block_table\[0, 0\]=-2 is outside the pool \[0, 6\)"),
    (lambda a: a.update(cache_seqlens=[3, 5.0]), TypeError,
     r"^cache_seqlens: expected an integer array, an int or a list of ints, got list"),
    (lambda a: a.update(cache_seqlens=[3, 49]), ValueError,  # a list: FlashAttention's forms
     r"^cache_seqlens: cache_seqlens\[1\]=49 \+ seqlen_new 0 exceeds the cache capacity 48 "),
    (lambda a: a.update(cache_seqlens=-1), ValueError,  # an int: every sequence's length
     r"^cache_seqlens: must be >= 0, got cache_seqlens\[0\]=-1$"),
    (lambda a: a.update(cache_seqlens=[3, 2 ** 31]), ValueError,
     r"^cache_seqlens: values must fit int32"),
    (lambda a: a.update(block_table=[[0, 1, 2], [3, 4, 5]]), TypeError,
     r"^block_table: expected an array \(NumPy, CuPy, or torch tensor\)"),
])
def test_explain_kvcache_checks_host_lengths_and_page_ids(no_launch, mutate, exc, match):
    """explain_kvcache applies the call's value checks to host cache_seqlens and block_table
    (negative lengths, lengths over the capacity, page ids outside the pool; lists are not
    arrays), with the call's messages, whatever its validate flag (reading host arrays costs no
    synchronisation); page ids past the pages a sequence uses are not read. cache_seqlens may
    also be an int or a list of ints (FlashAttention's forms), checked the same way."""
    q, kc, vc, cs, bt = _arrays(paged=True)
    a = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=cs, block_table=bt)
    mutate(a)
    for validate in (False, True):
        with pytest.raises(exc, match=match):
            decode.explain_kvcache(**a, validate=validate, report=False)
    with pytest.raises(exc, match=match):  # the call: the same error, before any launch
        decode.flash_attn_with_kvcache(**a)
    # the contiguous cache's capacity is its dim 1
    q, kc, vc, _, _ = _arrays()
    with pytest.raises(ValueError, match=r"exceeds the cache capacity 48 \(k_cache dim 1\)$"):
        decode.explain_kvcache(q, kc, vc, cache_seqlens=np.array([48, 49], np.int32),
                               report=False)
    q, kc, vc, cs, bt = _arrays(paged=True)
    bt[0, 1], bt[1, 2] = 99, -5  # both sequences (3 and 5 tokens) use page slot 0 only
    plan = decode.explain_kvcache(q, kc, vc, cache_seqlens=cs, block_table=bt, report=False)
    assert plan.name.endswith("_paged_cp")


@pytest.mark.parametrize("arch,exc,msg", [("foo", ValueError, "NVRTC target"),
                                          (90, TypeError, "expected a str"),
                                          ("sm_75", ValueError, "older than sm_80"),
                                          ("sm90", ValueError, "NVRTC target")])
def test_explain_refuses_a_bad_arch_before_compiling(arch, exc, msg):
    """A bad ``arch`` is an argument error naming ``arch`` (before, NVRTC's or ptxas's log)."""
    import cupyflash
    q = np.zeros((1, 1, 8, 128), np.float16)
    with pytest.raises(exc, match=f"arch: .*{msg}"):
        cupyflash.explain_kvcache(q, q, q, arch=arch)
    with pytest.raises(exc, match=f"arch: .*{msg}"):
        cupyflash.explain(q, q, q, arch=arch)


def test_paged_plan_says_why_it_keeps_three_stages():
    """A long paged cache keeps the 3-stage pipeline where the contiguous cache of the same
    shape takes 2 (heuristics.choose_split_stages); its plan says why under "stages"."""
    bf = ml_dtypes.bfloat16
    q = np.zeros((16, 1, 32, 128), bf)
    cs = np.full(16, 16384, np.int32)
    pool = np.zeros((16 * 1024, 16, 8, 128), bf)
    bt = np.arange(16 * 1024, dtype=np.int32).reshape(16, 1024)
    paged = decode.explain_kvcache(q, pool, pool, cache_seqlens=cs, block_table=bt,
                                   report=False, num_sms=132)
    flat = np.zeros((16, 16384, 8, 128), bf)
    contiguous = decode.explain_kvcache(q, flat, flat, cache_seqlens=cs, report=False,
                                        num_sms=132)
    assert contiguous.template["stages"] == 2 and paged.template["stages"] == 3
    assert any(t == "stages" and "3 K/V stages kept" in r for t, r in paged.reasons)
    short = decode.explain_kvcache(q, pool[:, :], pool, cache_seqlens=np.full(16, 1024, np.int32),
                                   block_table=bt[:, :64], report=False, num_sms=132)
    assert not any(t == "stages" for t, _ in short.reasons)  # nothing to explain there


@pytest.mark.parametrize("lens", [[8000, 17], 17, (8000, 17)])
def test_cache_seqlens_passed_positionally_gets_a_hint(lens):
    """FlashAttention's signature puts k, v after the caches: a list or int given there is taken
    for k, and the error says the lengths are a keyword argument."""
    bf16 = ml_dtypes.bfloat16
    q = np.zeros((2, 1, 8, 64), bf16)
    kc = np.zeros((2, 8192, 2, 64), bf16)
    with pytest.raises(TypeError, match=r"^v: k and v must be given together .*cache_seqlens="):
        decode.explain_kvcache(q, kc, kc, lens)
    with pytest.raises(TypeError, match=r"^v: k and v must be given together \(got k=ndarray, "
                                        r"v=None\)$"):
        decode.explain_kvcache(q, kc, kc, np.zeros((2, 1, 2, 64), bf16))
