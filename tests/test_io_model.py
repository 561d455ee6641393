"""cupyflash.io_model: hand-computed small cases, exact mask counts, and the limits that the
figures rely on (baseline bytes grow with slope 2 in S, the tiled kernel's compulsory bytes with
slope 1)."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupyflash import io_model as m


def brute_pairs(sq, sk, causal, window):
    """The README's mask semantics, one pair at a time."""
    left, right = window
    n = 0
    for i in range(sq):
        d = i + sk - sq
        for j in range(sk):
            ok = True
            if causal and j > d:
                ok = False
            if right >= 0 and j > d + right:
                ok = False
            if left >= 0 and j < d - left:
                ok = False
            n += ok
    return n


@pytest.mark.parametrize("sq,sk,causal,window,expected", [
    (4, 4, False, (-1, -1), 16),
    (4, 4, True, (-1, -1), 10),          # S (S + 1) / 2
    (2, 4, True, (-1, -1), 3 + 4),       # bottom-right: row 0 sees keys 0..2
    (4, 2, True, (-1, -1), 0 + 0 + 1 + 2),  # rows 0, 1 see nothing
    (4, 4, False, (1, 0), 1 + 2 + 2 + 2),
    (4, 4, False, (0, 0), 4),
    (4, 4, True, (-1, 1), 10),           # causal wins over right = 1
    (3, 5, False, (0, 1), 2 + 2 + 1),    # row 2 sees key 4 only (right clipped at Sk)
    (0, 5, True, (-1, -1), 0),
])
def test_visible_pairs_hand(sq, sk, causal, window, expected):
    assert m.visible_pairs(sq, sk, causal, window) == expected
    assert brute_pairs(sq, sk, causal, window) == expected


@given(sq=st.integers(0, 40), sk=st.integers(0, 40), causal=st.booleans(),
       left=st.integers(-1, 12), right=st.integers(-1, 12))
def test_visible_pairs_matches_brute_force(sq, sk, causal, left, right):
    assert m.visible_pairs(sq, sk, causal, (left, right)) == brute_pairs(sq, sk, causal, (left, right))


def test_flops():
    assert m.prefill_flops(1, 1, 4, 4, 8, causal=True) == 4 * 10 * 8
    assert m.prefill_flops(2, 16, 1024, 1024, 128) == 4 * 2 * 16 * 1024 * 1024 * 128
    # causal S x S is a bit more than half of the full count
    full = m.prefill_flops(1, 1, 4096, 4096, 64)
    assert m.prefill_flops(1, 1, 4096, 4096, 64, causal=True) == full // 2 + 4 * 4096 * 64 // 2
    # one decode query sees every key (bottom-right causal)
    assert m.decode_flops(3, 32, 1000, 128) == 4 * 3 * 32 * 1000 * 128


def test_itemsize():
    assert m.itemsize("bfloat16") == 2 and m.itemsize("float16") == 2
    assert m.itemsize(np.float32) == 4 and m.itemsize("float64") == 8 and m.itemsize(2) == 2
    with pytest.raises(ValueError, match="^dtype"):
        m.itemsize("int128")


def test_prefill_traffic_hand_noncausal():
    # B=1, H=2 (GQA: one KV head), S=256, d=64, bf16, BLOCK_M=128: two query tiles per head, each
    # reads all 256 keys of K and V.
    t = m.prefill_traffic(1, 2, 1, 256, 256, 64, "bfloat16", block_m=128)
    terms = {n: (r, w) for n, r, w in t.terms}
    assert terms["q"] == (2 * 256 * 64 * 2, 0)
    assert terms["kv"] == (2 * (2 * 2 * 256) * 64 * 2, 0)  # K and V x heads x tiles x keys
    assert terms["o"] == (0, 2 * 256 * 64 * 2)
    assert terms["lse"] == (0, 2 * 256 * 4)
    assert t.read == 65536 + 262144 and t.write == 65536 + 2048
    assert t.total == m.prefill_hbm_bytes(1, 2, 1, 256, 256, 64, "bfloat16", block_m=128)
    # compulsory: K and V of the one KV head read once
    tr = m.prefill_traffic(1, 2, 1, 256, 256, 64, "bfloat16", block_m=128, kv_reuse=True)
    assert dict((n, r) for n, r, _ in tr.terms)["kv"] == 2 * 256 * 64 * 2


def test_prefill_traffic_hand_causal():
    # causal, S=256, BLOCK_M=128: tile 0 (rows 0..127) needs keys [0, 128), tile 1 all 256.
    t = m.prefill_traffic(1, 1, 1, 256, 256, 64, "float16", causal=True, block_m=128)
    assert dict((n, r) for n, r, _ in t.terms)["kv"] == 2 * (128 + 256) * 64 * 2
    # BLOCK_M=100, BLOCK_N=64: tiles of rows [0,100) [100,200) [200,256) need keys up to 100, 200,
    # 256, rounded up to whole key tiles: 128, 256 (clipped), 256.
    t = m.prefill_traffic(1, 1, 1, 256, 256, 64, "float16", causal=True, block_m=100, block_n=64)
    assert dict((n, r) for n, r, _ in t.terms)["kv"] == 2 * (128 + 256 + 256) * 64 * 2
    # sliding window (left=16, right=0): tile of rows [128, 256) needs keys [112, 256)
    t = m.prefill_traffic(1, 1, 1, 256, 256, 64, "float16", window_size=(16, 0), block_m=128)
    assert dict((n, r) for n, r, _ in t.terms)["kv"] == 2 * (128 + 144) * 64 * 2
    # a query tile whose rows see nothing reads nothing (causal, Sq > Sk)
    t = m.prefill_traffic(1, 1, 1, 256, 64, 64, "float16", causal=True, block_m=128)
    assert dict((n, r) for n, r, _ in t.terms)["kv"] == 2 * (0 + 64) * 64 * 2


def test_baseline_traffic_hand():
    b, h, hk, s, d = 1, 2, 1, 8, 4
    t = m.baseline_traffic(b, h, hk, s, s, d, "bfloat16")
    qn, kn, sq = b * h * s * d * 2, b * hk * s * d * 2, b * h * s * s
    assert t.write == (qn + 2 * kn + qn) + sq * 4 + sq * 2 + b * h * s * 4 + qn
    assert t.read == (qn + 2 * kn + qn) + qn + kn + sq * 4 + sq * 2 + kn
    # the mask does not change the baseline's bytes
    assert m.baseline_hbm_bytes(b, h, hk, s, s, d, "bfloat16", causal=True) == t.total
    # fp64 inputs: fp64 scores
    t64 = m.baseline_traffic(1, 1, 1, 8, 8, 4, "float64", layout_copies=False)
    assert dict((n, r) for n, r, _ in t64.terms)["scores"] == 64 * 8


def test_baseline_extra_memory_hand():
    # B=1, H=16, S=16k, d=128, bf16: S (fp32) + P (bf16) = 16 * 16384^2 * 6 bytes
    got = m.baseline_extra_memory(1, 16, 16, 16384, 16384, 128, "bfloat16")
    assert got == 16 * 16384 * 16384 * 6 + 16 * 16384 * 4  # + the float32 LSE
    # tiny S: the head-major copies dominate
    assert m.baseline_extra_memory(1, 1, 1, 2, 2, 128, "float32") == 2 * 128 * 4 * 2 + 4 * 4 + 2 * 4
    assert m.prefill_extra_memory(1, 16, 32768) == 16 * 32768 * 4


def _slope(f, s1, s2):
    return math.log(f(s2) / f(s1)) / math.log(s2 / s1)


def test_slopes_in_sequence_length():
    """Fixed batch and heads, growing S: the baseline's bytes grow as S^2, the tiled kernel's
    compulsory bytes as S; with every K/V re-read from HBM the tiled kernel is also quadratic, but
    by a factor 2 * dtype * d / BLOCK_M per score (here 4 bytes) instead of the baseline's
    2 * (4 + 2) = 12 bytes per score."""
    args = dict(batch=1, nheads=16, nheads_k=16, headdim=128, dtype="bfloat16")

    def base(s):
        return m.baseline_hbm_bytes(seqlen_q=s, seqlen_k=s, **args)

    def flash_min(s):
        return m.prefill_hbm_bytes(seqlen_q=s, seqlen_k=s, kv_reuse=True, **args)

    def flash_rr(s):
        return m.prefill_hbm_bytes(seqlen_q=s, seqlen_k=s, block_m=128, **args)

    assert abs(_slope(base, 16384, 32768) - 2) < 0.02
    assert abs(_slope(flash_min, 512, 32768) - 1) < 1e-9
    assert abs(_slope(flash_rr, 16384, 32768) - 2) < 0.05
    ratio = flash_rr(1 << 17) / base(1 << 17)
    assert abs(ratio - 4 / 12) < 0.01
    # the benchmark's shape (16k tokens per batch, B = 16384 / S): baseline slope 1, tiled flat
    tok = dict(nheads=16, nheads_k=16, headdim=128, dtype="bfloat16")
    b2 = [m.baseline_hbm_bytes(16384 // s, seqlen_q=s, seqlen_k=s, **tok) for s in (4096, 8192)]
    f2 = [m.prefill_hbm_bytes(16384 // s, seqlen_q=s, seqlen_k=s, kv_reuse=True, **tok)
          for s in (4096, 8192)]
    assert abs(math.log2(b2[1] / b2[0]) - 1) < 0.05 and f2[0] == f2[1]  # + linear terms


def test_decode_traffic_hand():
    # Llama-3-8B heads, batch 2, 1000 keys, bf16
    b, h, hk, s, d = 2, 32, 8, 1000, 128
    t1 = m.decode_traffic(b, h, hk, s, d, "bfloat16", num_splits=1)
    terms = {n: (r, w) for n, r, w in t1.terms}
    assert terms["kv"] == (2 * b * hk * s * d * 2, 0)
    assert terms["q"] == (b * h * d * 2, 0) and terms["o"] == (0, b * h * d * 2)
    assert terms["meta"] == (b * 4, 0) and "workspace" not in terms
    t4 = m.decode_traffic(b, h, hk, s, d, "bfloat16", num_splits=4, page_size=16)
    terms4 = {n: (r, w) for n, r, w in t4.terms}
    ws = 4 * b * h * (d + 2) * 4  # accumulators and (m, l) pairs, float32
    assert terms4["workspace"] == (ws, ws)
    assert terms4["meta"] == (b * 4 + b * 63 * 4, 0)  # ceil(1000 / 16) = 63 pages per sequence
    assert t4.total == t1.total + 2 * ws + b * 63 * 4
    assert m.decode_hbm_bytes(b, h, hk, s, d, "bfloat16", num_splits=4, page_size=16) == t4.total
    with pytest.raises(ValueError, match="^num_splits"):
        m.decode_traffic(b, h, hk, s, d, "bfloat16", num_splits=0)


def test_intensity():
    # decode with GQA group 4: 4 FLOP per K/V byte in the long-cache limit
    s = 1 << 17
    i = m.intensity(m.decode_flops(1, 32, s, 128), m.decode_hbm_bytes(1, 32, 8, s, 128, "bfloat16"))
    assert abs(i - 4.0) < 0.01
    # prefill, compulsory bytes: intensity grows linearly with S
    i1 = m.intensity(m.prefill_flops(1, 16, 4096, 4096, 128),
                     m.prefill_hbm_bytes(1, 16, 16, 4096, 4096, 128, "bfloat16", kv_reuse=True))
    i2 = m.intensity(m.prefill_flops(1, 16, 8192, 8192, 128),
                     m.prefill_hbm_bytes(1, 16, 16, 8192, 8192, 128, "bfloat16", kv_reuse=True))
    assert abs(i2 / i1 - 2) < 0.01
    assert m.intensity(1.0, 0) == math.inf


def test_traffic_as_dict():
    t = m.decode_traffic(1, 2, 1, 16, 8, "float32")
    d = t.as_dict()
    assert d["total"] == t.total and sum(v["read"] for v in d["terms"].values()) == t.read


def _brute_tile_keys(sq, sk, causal, window, bm, bn):
    out = []
    for t in range(-(-sq // bm)):
        ks = set()
        for i in range(t * bm, min(sq, (t + 1) * bm)):
            lo, hi = m.visible_key_range(i, sq, sk, causal, window)
            ks |= set(range(int(lo), int(hi)))
        if not ks:
            out.append(0)
            continue
        lo, hi = min(ks), max(ks) + 1
        assert len(ks) == hi - lo  # a tile's visible keys are contiguous
        if bn:
            lo, hi = lo // bn * bn, min(sk, -(-hi // bn) * bn)
        out.append(hi - lo)
    return out


@given(sq=st.integers(0, 130), sk=st.integers(0, 130), causal=st.booleans(),
       left=st.integers(-1, 40), right=st.integers(-1, 40),
       bm=st.sampled_from([16, 32, 64]), bn=st.sampled_from([None, 16, 32]))
def test_keys_per_query_tile_matches_brute_force(sq, sk, causal, left, right, bm, bn):
    got = m._keys_per_query_tile(sq, sk, causal, (left, right), bm, bn)
    assert list(got) == _brute_tile_keys(sq, sk, causal, (left, right), bm, bn)


def test_backward_flops_and_memory():
    fwd = m.prefill_flops(2, 16, 4096, 4096, 128, causal=True)
    assert m.backward_flops(2, 16, 4096, 4096, 128, causal=True) == 2.5 * fwd
    assert m.backward_flops(2, 16, 4096, 4096, 128, causal=True, executed=True) == 3.5 * fwd
    # a window: only the visible pairs count
    w = m.backward_flops(1, 1, 100, 100, 64, window_size=(3, 0))
    assert w == 10 * m.visible_pairs(100, 100, False, (3, 0)) * 64
    assert m.backward_extra_memory(2, 16, 4096) == 2 * 16 * 4096 * 4
    assert m.backward_extra_memory(2, 16, 4096, "float64") == 2 * 16 * 4096 * 8
