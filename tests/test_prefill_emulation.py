"""CPU emulation of the tensor-core prefill kernel's index math (kernels_cu/forward/mma.cu).

No GPU here, so the risky part of the kernel -- which thread copies which 16-byte chunk, the
padded shared-memory layout, the per-lane ``ldmatrix`` row addresses, the mma.m16n8k16
fragment layouts, the C-fragment -> A-fragment reuse of P, the key-tile loop bounds and masks,
the epilogue's (row, column) of every store -- is re-executed here lane by lane in NumPy,
transliterated line by line from the kernel, against an emulator of the three warp-level
instructions written from the PTX ISA's fragment tables (and nothing else):

* ``ldmatrix.m8n8.x4[.trans].b16``: lanes 8i..8i+7 give the row addresses of matrix i; register i
  of lane l receives matrix i's elements [l/4][2(l%4)], [l/4][2(l%4)+1] (transposed: [2(l%4)][l/4],
  [2(l%4)+1][l/4]).
* ``mma.m16n8k16.row.col`` (g = lane/4, t = lane%4): a0 = A[g][2t..], a1 = A[g+8][2t..],
  a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t..][g], b1 = B[2t+8..][g];
  c0,c1 = C[g][2t..], c2,c3 = C[g+8][2t..].
* ``cp.async`` 16 bytes with zero fill.

Global memory is a flat buffer whose every element outside the logical tensors is NaN and every
read is bounds-checked; shared memory starts as NaN. So a wrong offset, a read past a sequence
end, an unwritten smem chunk or a stage mix-up all show up as NaN or as a wrong result, not as
silence. The emulated kernel is compared with the float64 reference.
"""
import math

import numpy as np
import pytest

from cupyflash.forward import kernels as prefill

ml_dtypes = pytest.importorskip("ml_dtypes")

LANE = np.arange(32)
SKIPPED = []  # tiles skipped by warps per emulated CTA (a causal case must exercise the skip)
G, TQ = LANE >> 2, LANE & 3  # mma groupID, threadID_in_group


def _round(x, dtype):
    return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Instruction emulators (PTX ISA fragment tables)
# ----------------------------------------------------------------------------------------------
def ldmatrix_x4(smem, addr_bytes, trans=False):
    """Per-lane 16-byte row addresses (bytes) -> registers (32 lanes, 4 regs, 2 halves)."""
    addr_bytes = np.asarray(addr_bytes)
    assert addr_bytes.shape == (32,) and np.all(addr_bytes % 16 == 0), "ldmatrix rows: 16-byte aligned"
    el = addr_bytes // 2
    assert el.min() >= 0 and el.max() + 8 <= smem.size, "ldmatrix outside shared memory"
    rows = smem[el[:, None] + np.arange(8)]          # (32, 8): row supplied by each lane
    mats = rows.reshape(4, 8, 8)                     # matrix i = rows of lanes 8i..8i+7
    regs = np.empty((32, 4, 2), np.float32)
    for i in range(4):
        if not trans:
            regs[:, i, 0] = mats[i, G, 2 * TQ]
            regs[:, i, 1] = mats[i, G, 2 * TQ + 1]
        else:
            regs[:, i, 0] = mats[i, 2 * TQ, G]
            regs[:, i, 1] = mats[i, 2 * TQ + 1, G]
    return regs


def mma_m16n8k16(d, a, b0, b1):
    """d (32, 4) f32 += A (from a: (32, 4, 2)) @ B (from b0, b1: (32, 2)); returns the new d."""
    A = np.full((16, 16), np.nan, np.float64)
    B = np.full((16, 8), np.nan, np.float64)
    C = np.full((16, 8), np.nan, np.float64)
    for e in range(2):
        A[G, 2 * TQ + e] = a[:, 0, e]
        A[G + 8, 2 * TQ + e] = a[:, 1, e]
        A[G, 2 * TQ + 8 + e] = a[:, 2, e]
        A[G + 8, 2 * TQ + 8 + e] = a[:, 3, e]
        B[2 * TQ + e, G] = b0[:, e]
        B[2 * TQ + 8 + e, G] = b1[:, e]
        C[G, 2 * TQ + e] = d[:, e]
        C[G + 8, 2 * TQ + e] = d[:, 2 + e]
    assert not np.isnan(A).all() and not np.isnan(B).all()
    D = A @ B + C
    out = np.empty((32, 4), np.float32)
    for e in range(2):
        out[:, e] = D[G, 2 * TQ + e]
        out[:, 2 + e] = D[G + 8, 2 * TQ + e]
    return out


class Global:
    """Flat global memory: logical tensors embedded in NaN, bounds-checked reads."""

    def __init__(self, size):
        self.buf = np.full(size, np.nan, np.float32)

    def read16(self, off):
        assert 0 <= off and off + 8 <= self.buf.size, f"global read out of bounds at {off}"
        return self.buf[off:off + 8]


# ----------------------------------------------------------------------------------------------
# The kernel, transliterated (names and order follow forward/mma.cu)
# ----------------------------------------------------------------------------------------------
class Traits:
    def __init__(self, hd, bm, bn, nw, prefetch=False):
        self.kPrefetch = prefetch
        self.kThreads = nw * 32
        self.kMTiles = bm // (16 * nw)
        self.kNTiles = bn // 8
        self.kDTiles = hd // 8
        self.kKSteps = hd // 16
        self.kPSteps = bn // 16
        self.kChunks = hd // 8
        self.kRow = hd + 8
        self.kQElems = bm * self.kRow
        self.kKVElems = bn * self.kRow
        self.kStages = stages = 2
        self.kWaitK = 2 * (stages - 1) - 1
        self.kWaitV = 2 * (stages - 1)
        self.kWaitQ = 2 * (stages - 1)
        self.kSmemBytes = (self.kQElems + 2 * self.kStages * self.kKVElems) * 2
        est = self.kMTiles * (hd // 2 + bn // 2 + hd // 4)
        self.kQInRegs = est <= 160
        self.kWarpSkip = not self.kQInRegs


class AsyncCopies:
    """cp.async group bookkeeping of one CTA (every thread commits the same groups, so one
    counter stands for all): each smem element remembers the group that wrote it, and a read
    must come after a wait that retired that group (followed by __syncthreads in the kernel)."""

    def __init__(self, n_elems):
        self.group = np.full(n_elems, -1, np.int64)   # -1: never written by cp.async
        self.committed = 0                            # groups committed so far
        self.retired = 0                              # groups [0, retired) have landed

    def write(self, dst_elem):
        self.group[dst_elem:dst_elem + 8] = self.committed   # joins the group being built

    def commit(self):
        self.committed += 1

    def wait(self, n):
        self.retired = max(self.retired, self.committed - n)

    def check_read(self, addr_bytes):
        el = np.asarray(addr_bytes) // 2
        g = self.group[el[:, None] + np.arange(8)]
        assert (g < self.retired).all(), "ldmatrix reads a cp.async chunk before its wait_group"


class TileLoader:
    def __init__(self, tr, rows, tid):
        c = tr.kChunks
        self.tr, self.rows = tr, rows
        self.kTPR = 32 if c % 32 == 0 else 16 if c % 16 == 0 else 8 if c % 8 == 0 else 4
        self.kRowsPerPass = tr.kThreads // self.kTPR
        self.kPasses = -(-rows // self.kRowsPerPass)
        self.kChunkIters = c // self.kTPR
        self.r0, self.c0 = tid // self.kTPR, tid % self.kTPR
        self.s_off = (self.r0 * tr.kRow + self.c0 * 8) * 2

    def load(self, smem, gmem, s_tile, g_tile, row_stride, rows_valid, chunks_valid, g_safe, cp):
        thread_off = self.r0 * row_stride + self.c0 * 8
        for pas in range(self.kPasses):
            r = self.r0 + pas * self.kRowsPerPass
            if self.rows % self.kRowsPerPass == 0 or r < self.rows:
                g_row = g_tile + pas * self.kRowsPerPass * row_stride + thread_off
                for ci in range(self.kChunkIters):
                    ok = r < rows_valid and self.c0 + ci * self.kTPR < chunks_valid
                    src = g_row + ci * self.kTPR * 8 if ok else g_safe
                    dst = s_tile + self.s_off + (pas * self.kRowsPerPass * self.tr.kRow + ci * self.kTPR * 8) * 2
                    assert dst % 16 == 0
                    smem[dst // 2: dst // 2 + 8] = gmem.read16(src) if ok else 0.0
                    cp.write(dst // 2)


def visible_keys(row, sq, sk, causal, wl, wr):
    diag = row + sk - sq
    lo, hi = 0, sk
    if causal:
        hi = min(hi, diag + 1)
    if wr >= 0:
        hi = min(hi, diag + wr + 1)
    if wl >= 0:
        lo = max(lo, diag - wl)
    return lo, hi


def key_tiles(row_first, row_last, sq, sk, causal, wl, wr, bn):
    f = visible_keys(row_first, sq, sk, causal, wl, wr)
    la = visible_keys(row_last, sq, sk, causal, wl, wr)
    lo, hi = max(f[0], 0), min(la[1], sk)
    nmin = lo // bn
    nmax = (hi + bn - 1) // bn if hi > lo else nmin
    return nmin, nmax, la[0], f[1]


def fwd_seq(P, b, h):
    """Mirror of the kernels' per-CTA sequence setup (common/fwd_entry.cuh, FwdCta): this
    sequence's lengths (varlen: from cu_seqlens) and the element offsets of its q, o, k, v rows
    for head h (KV head h // h_per_kv) and of its LSE row."""
    hk = h // P["h_per_kv"]
    sq, sk = P["seqlen_q"], P["seqlen_k"]
    q_tok = k_tok = 0
    bq = bk = b
    if P["cu_q"] is not None:
        q_tok, sq, bq = P["cu_q"][b], P["cu_q"][b + 1] - P["cu_q"][b], 0
    if P["cu_k"] is not None:
        k_tok, sk, bk = P["cu_k"][b], P["cu_k"][b + 1] - P["cu_k"][b], 0
    q_off = P["q"] + bq * P["qb"] + q_tok * P["qr"] + h * P["qh"]
    o_off = P["o"] + bq * P["ob"] + q_tok * P["or"] + h * P["oh"]
    k_off = P["k"] + bk * P["kb"] + k_tok * P["kr"] + hk * P["kh"]
    v_off = P["v"] + bk * P["vb"] + k_tok * P["vr"] + hk * P["vh"]
    lse_off = bq * P["lb"] + h * P["lh"] + q_tok
    return sq, sk, q_off, o_off, k_off, v_off, lse_off


def run_cta(tr, hd, bm, bn, nw, causal, P, gmem, out, lse, m_block, h, b, dtype):
    """One CTA of flash_fwd_block; P holds the FwdParams fields; out/lse are flat arrays."""
    MT, NT, DT = tr.kMTiles, tr.kNTiles, tr.kDTiles
    smem = np.full(tr.kSmemBytes // 2, np.nan, np.float32)
    cp = AsyncCopies(smem.size)
    sQ_base, sK_base = 0, tr.kQElems * 2
    sV_base = sK_base + tr.kStages * tr.kKVElems * 2
    # fwd_seq
    sq, sk, q_off, o_off, k_off, v_off, lse_off = fwd_seq(P, b, h)
    m0 = m_block * bm
    if m0 >= sq:
        return
    chunks_valid = P["headdim"] // 8
    wl, wr = P["wl"], P["wr"]
    nmin, nmax, lo_last, hi_first = key_tiles(m0, min(m0 + bm, sq) - 1, sq, sk, causal, wl, wr, bn)

    def needs_mask(nb):
        n0 = nb * bn
        return not (n0 >= lo_last and n0 + bn <= hi_first)

    kKVStageBytes = tr.kKVElems * 2
    loaders_q = [TileLoader(tr, bm, tid) for tid in range(tr.kThreads)]
    loaders_kv = [TileLoader(tr, bn, tid) for tid in range(tr.kThreads)]

    def load_tile(nb, stage_bytes):
        n0 = nb * bn
        for ld in loaders_kv:
            ld.load(smem, gmem, sK_base + stage_bytes, k_off + n0 * P["kr"], P["kr"], sk - n0,
                    chunks_valid, k_off, cp)
        cp.commit()
        for ld in loaders_kv:
            ld.load(smem, gmem, sV_base + stage_bytes, v_off + n0 * P["vr"], P["vr"], sk - n0,
                    chunks_valid, v_off, cp)
        cp.commit()

    for ld in loaders_q:
        ld.load(smem, gmem, sQ_base, q_off + m0 * P["qr"], P["qr"], sq - m0, chunks_valid, q_off, cp)
    cp.commit()
    for st_ in range(tr.kStages - 1):
        if nmin + st_ < nmax:
            load_tile(nmin + st_, st_ * kKVStageBytes)
        else:
            cp.commit()
            cp.commit()

    scale_log2 = np.float32(P["scale_log2"])
    # per-warp state
    W = []
    if tr.kQInRegs:
        cp.wait(tr.kWaitQ)
    for warp in range(nw):
        warp_row0 = warp * 16 * MT
        sQ_addr = (warp_row0 + (LANE & 15)) * tr.kRow + (LANE >> 4) * 8   # elements
        k_lane_off = ((LANE & 7) + ((LANE >> 4) << 3)) * tr.kRow + ((LANE >> 3) & 1) * 8
        v_lane_off = ((LANE & 7) + (((LANE >> 3) & 1) << 3)) * tr.kRow + (LANE >> 4) * 8
        st = dict(warp_row0=warp_row0, sQ_addr=sQ_base + sQ_addr * 2, k_lane_off=k_lane_off,
                  v_lane_off=v_lane_off,
                  acc=np.zeros((MT, DT, 32, 4), np.float32),
                  m_i=np.full((MT, 2, 32), -np.inf, np.float32), l_i=np.zeros((MT, 2, 32), np.float32))
        if tr.kQInRegs:
            def ldq(addr):
                cp.check_read(addr)
                return ldmatrix_x4(smem, addr)
            st["q_frag"] = [[ldq(st["sQ_addr"] + (mt * 16 * tr.kRow + ks * 16) * 2)
                             for ks in range(tr.kKSteps)] for mt in range(MT)]
        W.append(st)

    def ldsm(addr, trans=False):
        cp.check_read(addr)
        return ldmatrix_x4(smem, addr, trans)

    stage = 0
    skipped = 0
    for nb in range(nmin, nmax):
        n0 = nb * bn
        stage_off = stage * kKVStageBytes
        cp.wait(tr.kWaitK)   # + __syncthreads: every warp is done with tile nb - 1
        nf = nb + tr.kStages - 1
        if nf < nmax:        # prefetch into the stage tile nb - 1 used
            load_tile(nf, (tr.kStages - 1 if stage == 0 else stage - 1) * kKVStageBytes)
        else:
            cp.commit()
            cp.commit()
        mask_tile = needs_mask(nb)
        p_frags = {}
        for warp, st in enumerate(W):
            active = True
            if tr.kWarpSkip and mask_tile:
                r_first = m0 + st["warp_row0"]
                r_last = min(r_first + 16 * MT, sq) - 1
                f = visible_keys(r_first, sq, sk, causal, wl, wr)
                la = visible_keys(r_last, sq, sk, causal, wl, wr)
                active = r_first <= r_last and n0 < la[1] and n0 + bn > f[0]
                # the skip is exact only if no valid row of the warp sees a key of the tile
                if not active:
                    skipped += 1
                    for row in range(r_first, min(r_first + 16 * MT, sq)):
                        lo, hi = visible_keys(row, sq, sk, causal, wl, wr)
                        assert not (max(lo, n0) < min(hi, n0 + bn)), "skipped a visible key"
            st["active"] = active
            if not active:
                continue
            s = np.zeros((MT, NT, 32, 4), np.float32)
            sK_addr = sK_base + stage_off + st["k_lane_off"] * 2
            qa = lambda mt, ks: (st["q_frag"][mt][ks] if tr.kQInRegs else
                                 ldsm(st["sQ_addr"] + (mt * 16 * tr.kRow + ks * 16) * 2))
            if tr.kPrefetch:
                # PREFETCH: the kernel's flattened (ks, np) steps with double buffers,
                # fragments of step i + 1 loaded before the MMAs of step i.
                NP = NT // 2
                steps = tr.kKSteps * NP
                a2 = [[qa(mt, 0) for mt in range(MT)], None]
                bk2 = [ldsm(sK_addr), None]
                for i in range(steps):
                    ks, np_, cur, ab = i // NP, i % NP, i & 1, (i // NP) & 1
                    if i + 1 < steps:
                        ks1, np1 = (i + 1) // NP, (i + 1) % NP
                        if np1 == 0:
                            a2[ks1 & 1] = [qa(mt, ks1) for mt in range(MT)]
                        bk2[cur ^ 1] = ldsm(sK_addr + (np1 * 16 * tr.kRow + ks1 * 16) * 2)
                    a, bk_ = a2[ab], bk2[cur]
                    for mt in range(MT):
                        s[mt, 2 * np_] = mma_m16n8k16(s[mt, 2 * np_], a[mt], bk_[:, 0], bk_[:, 1])
                        s[mt, 2 * np_ + 1] = mma_m16n8k16(s[mt, 2 * np_ + 1], a[mt], bk_[:, 2], bk_[:, 3])
            for ks in range(0 if tr.kPrefetch else tr.kKSteps):
                a = [qa(mt, ks) for mt in range(MT)]
                for np_ in range(NT // 2):
                    bk_ = ldsm(sK_addr + (np_ * 16 * tr.kRow + ks * 16) * 2)
                    for mt in range(MT):
                        s[mt, 2 * np_] = mma_m16n8k16(s[mt, 2 * np_], a[mt], bk_[:, 0], bk_[:, 1])
                        s[mt, 2 * np_ + 1] = mma_m16n8k16(s[mt, 2 * np_ + 1], a[mt], bk_[:, 2], bk_[:, 3])
            if mask_tile:
                for mt in range(MT):
                    for hh in range(2):
                        for lane in range(32):
                            row = m0 + st["warp_row0"] + mt * 16 + G[lane] + hh * 8
                            lo, hi = visible_keys(row, sq, sk, causal, wl, wr)
                            for nt in range(NT):
                                for e in range(2):
                                    key = n0 + nt * 8 + 2 * TQ[lane] + e
                                    if not (lo <= key < hi):
                                        s[mt, nt, lane, 2 * hh + e] = -np.inf
            p_frag = np.empty((MT, tr.kPSteps, 32, 4, 2), np.float32)
            # SoftmaxRow (common/online_softmax.cuh), float32: alpha = exp2((m_old - ref) c),
            # l *= alpha, p = exp2((s - ref) c), l += rowsum
            for mt in range(MT):
                for hh in range(2):
                    mx = np.max(s[mt, :, :, 2 * hh:2 * hh + 2], axis=(0, 2))      # (32,)
                    mx = np.maximum(mx, mx[LANE ^ 1])
                    mx = np.maximum(mx, mx[LANE ^ 2])
                    m_old = st["m_i"][mt, hh]
                    m_new = np.maximum(m_old, mx)
                    ref = np.where(m_new == -np.inf, np.float32(0), m_new)
                    alpha = np.exp2((m_old - ref) * scale_log2)
                    st["l_i"][mt, hh] = st["l_i"][mt, hh] * alpha
                    st["m_i"][mt, hh] = m_new
                    rowsum = np.zeros(32, np.float32)
                    for nt in range(NT):
                        p0 = np.exp2((s[mt, nt, :, 2 * hh] - ref) * scale_log2)
                        p1 = np.exp2((s[mt, nt, :, 2 * hh + 1] - ref) * scale_log2)
                        rowsum += p0
                        rowsum += p1
                        p_frag[mt, nt >> 1, :, (nt & 1) * 2 + hh, 0] = _round(p0, dtype)
                        p_frag[mt, nt >> 1, :, (nt & 1) * 2 + hh, 1] = _round(p1, dtype)
                    st["l_i"][mt, hh] += rowsum
                    st["acc"][mt, :, :, 2 * hh] *= alpha
                    st["acc"][mt, :, :, 2 * hh + 1] *= alpha
            p_frags[warp] = p_frag
        cp.wait(tr.kWaitV)   # + __syncthreads, passed by every warp
        for warp, st in enumerate(W):
            if not st["active"]:
                continue
            p_frag = p_frags[warp]
            sV_addr = sV_base + stage_off + st["v_lane_off"] * 2
            for kc in range(tr.kPSteps):
                for dp in range(DT // 2):
                    bv = ldsm(sV_addr + (kc * 16 * tr.kRow + dp * 16) * 2, trans=True)
                    for mt in range(MT):
                        st["acc"][mt, 2 * dp] = mma_m16n8k16(st["acc"][mt, 2 * dp], p_frag[mt, kc], bv[:, 0], bv[:, 1])
                        st["acc"][mt, 2 * dp + 1] = mma_m16n8k16(st["acc"][mt, 2 * dp + 1], p_frag[mt, kc], bv[:, 2], bv[:, 3])
        stage = 0 if stage + 1 == tr.kStages else stage + 1
    SKIPPED.append(skipped)

    for st in W:
        for mt in range(MT):
            for hh in range(2):
                l_ = st["l_i"][mt, hh]
                l_ = l_ + l_[LANE ^ 1]
                l_ = l_ + l_[LANE ^ 2]
                inv = np.where(l_ == 0, np.float32(0), np.float32(1) / np.where(l_ == 0, 1, l_))
                for lane in range(32):
                    row = m0 + st["warp_row0"] + mt * 16 + G[lane] + hh * 8
                    if row < sq:
                        o_row = o_off + row * P["or"]
                        for dt in range(DT):
                            col = dt * 8 + 2 * TQ[lane]
                            if col < P["headdim"]:
                                pair = st["acc"][mt, dt, lane, 2 * hh:2 * hh + 2] * inv[lane]
                                assert 0 <= o_row + col and o_row + col + 2 <= out.size
                                out[o_row + col:o_row + col + 2] = _round(pair, dtype)
                        if TQ[lane] == 0:
                            m = st["m_i"][mt, hh][lane]
                            lse[lse_off + row] = (-np.inf if l_[lane] == 0 else
                                                  m * scale_log2 * math.log(2) + math.log(l_[lane]))


# ----------------------------------------------------------------------------------------------
# Harness: strided tensors inside a NaN-filled buffer, reference, comparison
# ----------------------------------------------------------------------------------------------
def _reference(q, k, v, scale, causal, wl, wr):
    """float64 one-shot softmax; q (sq, h, d), k/v (sk, hk, d) -> out (sq, h, d), lse (h, sq)."""
    sq, h, d = q.shape
    sk, hk, _ = k.shape
    out = np.zeros((sq, h, d))
    lse = np.full((h, sq), -np.inf)
    for hh in range(h):
        kk = hh // (h // hk)
        s = scale * q[:, hh].astype(np.float64) @ k[:, kk].astype(np.float64).T
        for i in range(sq):
            lo, hi = visible_keys(i, sq, sk, causal, wl, wr)
            if hi <= lo:
                continue
            row = s[i, lo:hi]
            m = row.max()
            p = np.exp(row - m)
            out[i, hh] = p @ v[lo:hi, kk].astype(np.float64) / p.sum()
            lse[hh, i] = m + math.log(p.sum())
    return out, lse


def _emulate(dtype_name, hd_actual, cfg, causal, wl, wr, seqs, nheads, nheads_k, rng, varlen):
    dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype_name]
    hd, bm, bn, nw = cfg.headdim, cfg.block_m, cfg.block_n, cfg.nwarps
    tr = Traits(hd, bm, bn, nw, cfg.prefetch)
    assert tr.kSmemBytes == cfg.smem_bytes
    batch = len(seqs)
    max_q = max(s[0] for s in seqs)
    max_k = max(s[1] for s in seqs)
    scale = 1.0 / math.sqrt(hd_actual)
    # Logical tensors; each stored with a padded row (head stride > headdim, row stride > heads).
    qs = [_round(rng.standard_normal((sq_, nheads, hd_actual)), dtype) for sq_, _ in seqs]
    ks = [_round(rng.standard_normal((sk_, nheads_k, hd_actual)), dtype) for _, sk_ in seqs]
    vs = [_round(rng.standard_normal((sk_, nheads_k, hd_actual)), dtype) for _, sk_ in seqs]
    hs_q, hs_k = hd_actual + 8, hd_actual + 16          # head strides (multiples of 8)
    rs_q, rs_k = nheads * hs_q + 8, nheads_k * hs_k + 24  # row strides
    if varlen:
        tq = sum(s[0] for s in seqs)
        tk = sum(s[1] for s in seqs)
        cu_q = np.concatenate([[0], np.cumsum([s[0] for s in seqs])]).astype(np.int64)
        cu_k = np.concatenate([[0], np.cumsum([s[1] for s in seqs])]).astype(np.int64)
        bsq = bsk = 0
        size_q, size_k = tq * rs_q, tk * rs_k
    else:
        cu_q = cu_k = None
        bsq, bsk = max_q * rs_q + 40, max_k * rs_k + 56  # batch strides with gaps
        size_q, size_k = batch * bsq, batch * bsk
    base_q, base_k = 64, 64 + size_q + 32
    base_v = base_k + size_k + 48
    base_o = base_v + size_k + 16
    gmem = Global(base_o + size_q + 64)
    for b in range(batch):
        sq_, sk_ = seqs[b]
        tok_q = cu_q[b] if varlen else 0
        tok_k = cu_k[b] if varlen else 0
        for i in range(sq_):
            for hh in range(nheads):
                off = base_q + b * bsq + (tok_q + i) * rs_q + hh * hs_q
                gmem.buf[off:off + hd_actual] = qs[b][i, hh]
        for j in range(sk_):
            for hh in range(nheads_k):
                off = (tok_k + j) * rs_k + b * bsk + hh * hs_k
                gmem.buf[base_k + off:base_k + off + hd_actual] = ks[b][j, hh]
                gmem.buf[base_v + off:base_v + off + hd_actual] = vs[b][j, hh]
    out = gmem.buf  # outputs live in the same NaN-poisoned buffer (region base_o)
    nq_total = sum(s[0] for s in seqs) if varlen else batch * max_q
    lse = np.full(nheads * nq_total if varlen else batch * nheads * max_q, np.nan, np.float64)
    P = dict(q=base_q, k=base_k, v=base_v, o=base_o, qb=bsq, qr=rs_q, qh=hs_q, kb=bsk, kr=rs_k,
             kh=hs_k, vb=bsk, vr=rs_k, vh=hs_k, ob=bsq, or_=rs_q, oh=hs_q,
             lb=0 if varlen else nheads * max_q, lh=nq_total if varlen else max_q,
             cu_q=cu_q, cu_k=cu_k, h_per_kv=nheads // nheads_k, seqlen_q=max_q, seqlen_k=max_k,
             headdim=hd_actual, scale_log2=np.float32(scale * math.log2(math.e)), wl=wl, wr=wr)
    P["or"] = P.pop("or_")
    grid = (-(-max_q // bm), nheads, batch)
    for bx in range(grid[0]):
        m_block = grid[0] - 1 - bx if causal else bx
        for h in range(nheads):
            for b in range(batch):
                run_cta(tr, hd, bm, bn, nw, causal, P, gmem, out, lse, m_block, h, b, dtype)
    # Compare every sequence with the reference; NaN must remain wherever nothing is stored.
    worst = 0.0
    written = np.zeros(gmem.buf.size, bool)
    for b in range(batch):
        sq_, sk_ = seqs[b]
        ref_o, ref_l = _reference(qs[b], ks[b], vs[b], scale, causal, wl, wr)
        tok_q = cu_q[b] if varlen else 0
        for i in range(sq_):
            for hh in range(nheads):
                off = base_o + b * bsq + (tok_q + i) * rs_q + hh * hs_q
                got = gmem.buf[off:off + hd_actual]
                written[off:off + hd_actual] = True
                assert not np.isnan(got).any(), f"unwritten/NaN output b={b} i={i} h={hh}"
                worst = max(worst, float(np.max(np.abs(got - ref_o[i, hh]))))
                lo = (hh * nq_total + tok_q + i) if varlen else (b * nheads * max_q + hh * max_q + i)
                if np.isinf(ref_l[hh, i]):
                    assert lse[lo] == -np.inf
                else:
                    assert abs(lse[lo] - ref_l[hh, i]) < 1e-3 * max(1.0, abs(ref_l[hh, i]))
    region = slice(base_o, base_o + size_q)
    assert np.isnan(gmem.buf[region][~written[region]]).all(), "a store outside the logical output"
    tol = {"float16": 4e-3, "bfloat16": 3e-2}[dtype_name]
    assert worst < tol, f"max abs error {worst}"
    return worst


def _cfg(dtype, hd, bm, bn, nw, prefetch=None):
    """The table row of the tile; with ``prefetch`` given and unlike the row's, the same tile
    built the way the table builds rows (the kernel's PREFETCH code path on another tile)."""
    for c in prefill.SUPPORTED:
        if c.isa == "mma" and (c.dtype, c.headdim, c.block_m, c.block_n, c.nwarps) == (dtype, hd, bm, bn, nw):
            if prefetch is None or prefetch == c.prefetch:
                return c
    return prefill.PrefillConfig(dtype, hd, bm, bn, nw, prefill.TC_SOURCE, prefetch=bool(prefetch))


# Dense (non-varlen) problems have one (seqlen_q, seqlen_k) for the whole batch.
# One config per distinct code path: rows per warp 16 / 32, Q in registers or re-read, 4 / 8 warps,
# loader layouts (kTPR 4, 8, 16, 32), head dims that are and are not multiples of 64, the
# prefetched fragments with Q re-read and Q in registers, and warp-level skips of tiles on the
# causal diagonal / window edges.
CASES = [
    # dtype, (hd, bm, bn, nw[, prefetch]), hd_actual, causal, window, seqs (sq, sk),
    # heads (h, hk), varlen
    ("float16", (64, 128, 64, 4), 64, False, (-1, -1), [(130, 77)] * 2, (2, 1), False),
    # 8 warps with Q in registers (hd160's default; hd64 128x128x8 until it left the table)
    ("bfloat16", (160, 128, 64, 8), 136, True, (-1, -1), [(70, 150), (150, 70)], (2, 2), True),
    ("float16", (64, 64, 64, 4), 64, True, (-1, -1), [(150, 70)] * 2, (1, 1), False),
    ("float16", (128, 128, 32, 4), 128, True, (-1, -1), [(140, 140)], (1, 1), False),
    ("float16", (128, 64, 64, 4), 120, False, (20, 3), [(90, 100)], (4, 1), False),
    ("float16", (32, 128, 128, 4), 8, True, (-1, -1), [(33, 1), (1, 33), (0, 5), (17, 0)], (2, 1), True),
    ("float16", (96, 128, 32, 4), 88, True, (7, -1), [(40, 60), (65, 20)], (2, 1), True),
    ("bfloat16", (160, 64, 32, 4), 160, False, (-1, -1), [(20, 50)], (1, 1), False),
    ("float16", (256, 128, 32, 8), 200, True, (-1, -1), [(130, 40)], (1, 1), False),
    ("bfloat16", (128, 128, 64, 4), 128, True, (-1, -1), [(200, 230)], (1, 1), False),
    ("float16", (128, 128, 64, 4), 128, True, (-1, -1), [(150, 150), (60, 170)], (1, 1), True),
    ("float16", (64, 128, 64, 4), 56, True, (-1, -1), [(260, 260), (3, 90)], (1, 1), True),
    # PREFETCH: Q re-read (hd128 / hd96) and Q in registers (hd64)
    ("float16", (128, 128, 64, 4, True), 120, False, (-1, 5), [(90, 140)], (2, 1), False),
    ("float16", (96, 128, 64, 4, True), 88, False, (-1, -1), [(130, 200)], (1, 1), True),
    ("float16", (64, 128, 64, 4, True), 64, True, (-1, -1), [(260, 300)], (1, 1), False),
    ("bfloat16", (128, 128, 64, 4, False), 128, False, (-1, -1), [(70, 130)], (1, 1), False),
]


def _case_id(c):
    tile = c[1]
    pipe = "" if len(tile) == 4 else ("-pf" if tile[4] else "-nopf")
    return f"{c[0]}-hd{tile[0]}-m{tile[1]}-n{tile[2]}-w{tile[3]}{pipe}-d{c[2]}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_emulated_kernel_matches_reference(case):
    dtype, tile, d, causal, (wl, wr), seqs, (h, hk), varlen = case
    rng = np.random.default_rng(hash(tile) % 2**32)
    cfg = _cfg(dtype, *tile)
    _emulate(dtype, d, cfg, causal, wl, 0 if causal and wr < 0 else wr, seqs, h, hk, rng, varlen)


def test_every_tensor_core_row_has_an_emulated_pipeline_shape():
    """Each (rows per warp, prefetch) combination of the table is emulated above."""
    shape = lambda c: (c.block_m // (16 * c.nwarps), c.prefetch)
    emulated = {shape(_cfg(dtype, *tile)) for dtype, tile, *_ in CASES}
    table = {shape(c) for c in prefill.SUPPORTED if c.isa == "mma"}
    assert table <= emulated, table - emulated


def test_causal_diagonal_skips_tiles():
    """32-row warps on a causal diagonal skip the 64-key tile their rows cannot see."""
    SKIPPED.clear()
    cfg = _cfg("bfloat16", 128, 128, 64, 4)
    _emulate("bfloat16", 128, cfg, True, -1, 0, [(128, 128)], 1, 1, np.random.default_rng(1), False)
    # one CTA, tiles 0 and 1 both on the diagonal: warps 0 and 1 (rows 0-63) skip tile 1
    assert SKIPPED == [2]


def test_c_fragment_is_a_fragment():
    """P's C fragments of key tiles 2kc, 2kc+1 packed as (nt & 1) * 2 + hh are the A fragment of
    the 16x16 block: the identity forward/mma.cu relies on, checked through the mma emulator."""
    rng = np.random.default_rng(0)
    S = rng.standard_normal((16, 16)).astype(np.float32)
    Vm = rng.standard_normal((16, 8)).astype(np.float32)
    # C fragments of S[:, 0:8] and S[:, 8:16] as the S = Q K^T mma leaves them
    c = [np.stack([S[G, nt * 8 + 2 * TQ], S[G, nt * 8 + 2 * TQ + 1], S[G + 8, nt * 8 + 2 * TQ],
                   S[G + 8, nt * 8 + 2 * TQ + 1]], axis=1) for nt in range(2)]
    a = np.empty((32, 4, 2), np.float32)
    for nt in range(2):
        for hh in range(2):
            a[:, (nt & 1) * 2 + hh, 0] = c[nt][:, 2 * hh]
            a[:, (nt & 1) * 2 + hh, 1] = c[nt][:, 2 * hh + 1]
    b0 = np.stack([Vm[2 * TQ, G], Vm[2 * TQ + 1, G]], axis=1)
    b1 = np.stack([Vm[2 * TQ + 8, G], Vm[2 * TQ + 9, G]], axis=1)
    d = mma_m16n8k16(np.zeros((32, 4), np.float32), a, b0, b1)
    full = S.astype(np.float64) @ Vm
    np.testing.assert_allclose(d[:, 0], full[G, 2 * TQ], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d[:, 3], full[G + 8, 2 * TQ + 1], rtol=1e-5, atol=1e-5)


def test_smem_pitch_is_bank_conflict_free():
    """ldmatrix phases (8 row addresses) hit 8 distinct 16-byte bank groups for every head dim."""
    for hd in prefill.HEADDIMS:
        pitch = (hd + 8) * 2
        groups = {(r * pitch // 16) % 8 for r in range(8)}
        assert len(groups) == 8, hd


# ----------------------------------------------------------------------------------------------
# The CUDA-core kernel (forward/simt.cu), transliterated over its 128 threads at once
# ----------------------------------------------------------------------------------------------
def run_simt_cta(hd, bm, bn, isz, causal, P, gmem, lse, m_block, h, b):
    TR, TC = 16, 8
    RM, CN, VEC = bm // TR, bn // TC, 16 // isz
    DV = hd // (TC * VEC)
    kRow, kPRow = hd + VEC, bn + VEC
    tid = np.arange(128)
    tr, tc = tid // TC, tid % TC
    smem = np.full(bm * kRow + 2 * bn * kRow + bm * kPRow, np.nan)
    sQ, sK, sV, sP = 0, bm * kRow, bm * kRow + bn * kRow, bm * kRow + 2 * bn * kRow
    sq, sk, q_off, o_off, k_off, v_off, lse_off = fwd_seq(P, b, h)
    m0 = m_block * bm
    if m0 >= sq:
        return
    wl, wr = P["wl"], P["wr"]
    nmin, nmax, lo_last, hi_first = key_tiles(m0, min(m0 + bm, sq) - 1, sq, sk, causal, wl, wr, bn)

    def load(s_tile, g_tile, row_stride, rows, rows_valid, cols_valid):
        for warp in range(4):
            for r in range(warp, rows, 4):
                for c0 in range(0, hd, 32):
                    for lane in range(32):
                        c = c0 + lane
                        ok = r < rows_valid and c < cols_valid
                        if ok:
                            idx = g_tile + r * row_stride + c
                            assert 0 <= idx < gmem.buf.size
                        smem[s_tile + r * kRow + c] = gmem.buf[idx] if ok else 0.0

    load(sQ, q_off + m0 * P["qr"], P["qr"], bm, sq - m0, P["headdim"])
    acc = np.zeros((128, RM, DV, VEC))
    m_i = np.full((128, RM), -np.inf)
    l_i = np.zeros((128, RM))
    scale_log2 = P["scale"] * 1.4426950408889634
    for nb in range(nmin, nmax):
        n0 = nb * bn
        load(sK, k_off + n0 * P["kr"], P["kr"], bn, sk - n0, P["headdim"])
        load(sV, v_off + n0 * P["vr"], P["vr"], bn, sk - n0, P["headdim"])
        s = np.zeros((128, RM, CN))
        for d in range(0, hd, VEC):
            for i in range(RM):
                qv = smem[sQ + ((tr + TR * i) * kRow + d)[:, None] + np.arange(VEC)]
                for j in range(CN):
                    kv = smem[sK + ((tc + TC * j) * kRow + d)[:, None] + np.arange(VEC)]
                    s[:, i, j] += (qv * kv).sum(axis=1)
        if not (n0 >= lo_last and n0 + bn <= hi_first):
            for t in range(128):
                for i in range(RM):
                    lo, hi = visible_keys(m0 + tr[t] + TR * i, sq, sk, causal, wl, wr)
                    for j in range(CN):
                        key = n0 + tc[t] + TC * j
                        if not (lo <= key < hi):
                            s[t, i, j] = -np.inf
        for i in range(RM):
            mx = s[:, i, :].max(axis=1)
            for off in (1, 2, 4):
                mx = np.maximum(mx, mx[tid ^ off])
            m_new = np.maximum(m_i[:, i], mx)
            ref = np.where(m_new == -np.inf, 0.0, m_new)
            alpha = np.exp2((m_i[:, i] - ref) * scale_log2)
            rowsum = np.zeros(128)
            for j in range(CN):
                pr = np.exp2((s[:, i, j] - ref) * scale_log2)
                smem[sP + (tr + TR * i) * kPRow + tc + TC * j] = pr
                rowsum += pr
            l_i[:, i] = l_i[:, i] * alpha + rowsum
            m_i[:, i] = m_new
            acc[:, i] *= alpha[:, None, None]
        for n in range(0, bn, VEC):
            for i in range(RM):
                pv = smem[sP + ((tr + TR * i) * kPRow + n)[:, None] + np.arange(VEC)]
                for e in range(VEC):
                    for c in range(DV):
                        vv = smem[sV + ((n + e) * kRow + (tc + TC * c) * VEC)[:, None] + np.arange(VEC)]
                        acc[:, i, c, :] += pv[:, e:e + 1] * vv
    for i in range(RM):
        l_ = l_i[:, i].copy()
        for off in (1, 2, 4):
            l_ = l_ + l_[tid ^ off]
        inv = np.where(l_ == 0, 0.0, 1.0 / np.where(l_ == 0, 1.0, l_))
        for t in range(128):
            row = m0 + tr[t] + TR * i
            if row < sq:
                o_row = o_off + row * P["or"]
                for c in range(DV):
                    for x in range(VEC):
                        col = (tc[t] + TC * c) * VEC + x
                        if col < P["headdim"]:
                            gmem.buf[o_row + col] = acc[t, i, c, x] * inv[t]
                if tc[t] == 0:
                    lse[lse_off + row] = (-np.inf if l_[t] == 0 else
                                          m_i[t, i] * scale_log2 * math.log(2) + math.log(l_[t]))


SIMT_CASES = [
    # dtype, (hd, bm, bn), hd_actual, causal, window, seqs, heads, varlen
    ("float32", (64, 64, 32), 56, True, (-1, -1), [(70, 90)] * 2, (2, 1), False),
    ("float64", (32, 16, 32), 8, False, (3, 9), [(20, 45), (0, 3), (33, 0)], (2, 2), True),
    ("float64", (96, 32, 32), 96, True, (-1, -1), [(40, 20)], (1, 1), False),
]


@pytest.mark.parametrize("case", SIMT_CASES, ids=[f"{c[0]}-hd{c[1][0]}-m{c[1][1]}-n{c[1][2]}-d{c[2]}"
                                                     for c in SIMT_CASES])
def test_emulated_simt_kernel_matches_reference(case):
    dtype, (hd, bm, bn), d, causal, (wl, wr), seqs, (h, hk), varlen = case
    assert any((c.dtype, c.headdim, c.block_m, c.block_n) == (dtype, hd, bm, bn) for c in prefill.SUPPORTED)
    isz = np.dtype(dtype).itemsize
    wr = 0 if causal and wr < 0 else wr
    rng = np.random.default_rng(5)
    batch = len(seqs)
    max_q, max_k = max(s[0] for s in seqs), max(s[1] for s in seqs)
    qs = [rng.standard_normal((a, h, d)) for a, _ in seqs]
    ks = [rng.standard_normal((c, hk, d)) for _, c in seqs]
    vs = [rng.standard_normal((c, hk, d)) for _, c in seqs]
    rs_q, rs_k = h * (d + 4) + 4, hk * (d + 2) + 2       # odd padding: element strides only
    if varlen:
        cu_q = np.concatenate([[0], np.cumsum([s[0] for s in seqs])])
        cu_k = np.concatenate([[0], np.cumsum([s[1] for s in seqs])])
        bsq = bsk = 0
        nq = int(cu_q[-1])
        size_q, size_k = int(cu_q[-1]) * rs_q, int(cu_k[-1]) * rs_k
    else:
        cu_q = cu_k = None
        bsq, bsk = max_q * rs_q + 3, max_k * rs_k + 5
        nq = batch * max_q
        size_q, size_k = batch * bsq, batch * bsk
    base_q, base_k = 7, 7 + size_q + 3
    base_v = base_k + size_k + 5
    base_o = base_v + size_k + 9
    gmem = Global(base_o + size_q + 11)
    gmem.buf = gmem.buf.astype(np.float64)
    for bi in range(batch):
        tq = cu_q[bi] if varlen else 0
        tk = cu_k[bi] if varlen else 0
        for i in range(seqs[bi][0]):
            for hh in range(h):
                off = base_q + bi * bsq + (tq + i) * rs_q + hh * (d + 4)
                gmem.buf[off:off + d] = qs[bi][i, hh]
        for j in range(seqs[bi][1]):
            for hh in range(hk):
                off = bi * bsk + (tk + j) * rs_k + hh * (d + 2)
                gmem.buf[base_k + off:base_k + off + d] = ks[bi][j, hh]
                gmem.buf[base_v + off:base_v + off + d] = vs[bi][j, hh]
    lse = np.full(h * nq, np.nan)
    scale = 1 / math.sqrt(d)
    P = dict(q=base_q, k=base_k, v=base_v, o=base_o, qb=bsq, qr=rs_q, qh=d + 4, kb=bsk, kr=rs_k,
             kh=d + 2, vb=bsk, vr=rs_k, vh=d + 2, ob=bsq, oh=d + 4, lb=0 if varlen else h * max_q,
             lh=nq if varlen else max_q, cu_q=cu_q, cu_k=cu_k, h_per_kv=h // hk, seqlen_q=max_q,
             seqlen_k=max_k, headdim=d, scale=scale, wl=wl, wr=wr)
    P["or"] = rs_q
    nblocks = -(-max_q // bm)
    for bx in range(nblocks):
        for hh in range(h):
            for bi in range(batch):
                run_simt_cta(hd, bm, bn, isz, causal, P, gmem, lse, nblocks - 1 - bx if causal else bx, hh, bi)
    for bi in range(batch):
        ref_o, ref_l = _reference(qs[bi], ks[bi], vs[bi], scale, causal, wl, wr)
        tq = cu_q[bi] if varlen else 0
        for i in range(seqs[bi][0]):
            for hh in range(h):
                off = base_o + bi * bsq + (tq + i) * rs_q + hh * (d + 4)
                np.testing.assert_allclose(gmem.buf[off:off + d], ref_o[i, hh], rtol=1e-12, atol=1e-12)
                lo = hh * nq + tq + i if varlen else bi * h * max_q + hh * max_q + i
                assert lse[lo] == ref_l[hh, i] or abs(lse[lo] - ref_l[hh, i]) < 1e-12
