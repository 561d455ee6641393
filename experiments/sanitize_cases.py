"""A reduced set of launches for compute-sanitizer (memcheck, racecheck): every kernel family
(prefill, decode, backward; the Hopper backward on sm_90a),
tails that are not multiples of the tiles, causal/window, GQA, paged cache with a shuffled table.

    compute-sanitizer --tool memcheck python experiments/sanitize_cases.py
(``experiments/gpu_suite.py --sanitize`` runs both tools and records the summaries.)
"""
import argparse

import cupy as cp
import numpy as np

import cupyflash as cf

rng = np.random.default_rng(0)


def rand(shape, dtype):
    return cp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))  # cast on the host


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true", help="fewer prefill cases (racecheck is slow)")
    ap.add_argument("--backward-only", action="store_true", help="the backward cases alone")
    args = ap.parse_args()
    small = args.small
    import ml_dtypes
    bf16 = np.dtype(ml_dtypes.bfloat16)
    dtypes = [bf16, cp.float64] if small else [cp.float16, bf16, cp.float32, cp.float64]
    if not args.backward_only:
        forward_and_decode(dtypes, small, bf16)
    backward(dtypes, small, bf16)
    cp.cuda.runtime.deviceSynchronize()
    print("sanitize cases: done")


def forward_and_decode(dtypes, small, bf16):
    for dt in dtypes:
        for d in ((64, 40) if small else (64, 128, 40)):
            q, k, v = rand((2, 77, 4, d), dt), rand((2, 133, 2, d), dt), rand((2, 133, 2, d), dt)
            for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (16, 8))):
                cf.flash_attn_func(q, k, v, causal=causal, window_size=window)
    # the Hopper TMA kernel: the dispatcher takes it for large problems only, so its rows are
    # launched directly here (ragged tails, GQA, causal and window masks, a padded head
    # dim, varlen); then the TMA kernel through the call with more work tiles than SMs, so that
    # its persistent CTAs take several tiles each (from the counter when causal)
    from cupyflash.core import checks
    from cupyflash.forward import kernels as prefill
    from cupyflash.core import planning
    if planning.default_arch() == prefill.WG_ARCH:
        q, k, v = rand((1, 1100, 16, 64), bf16), rand((1, 1100, 4, 64), bf16), rand((1, 1100, 4, 64), bf16)
        for causal in (False, True):
            cf.flash_attn_func(q, k, v, causal=causal)
        for cfg in prefill.SUPPORTED:
            if cfg.isa not in prefill.HOPPER_ISAS or (small and cfg.dtype != "bfloat16"):
                continue
            dt = bf16 if cfg.dtype == "bfloat16" else cp.float16
            d = cfg.headdim - 8
            q, k, v = rand((2, 200, 4, d), dt), rand((2, 333, 2, d), dt), rand((2, 333, 2, d), dt)
            for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (40, 8))):
                pr = checks.check_attention(q, k, v, causal=causal, window_size=window)
                out = cp.empty_like(q)
                lse = cp.empty((2, 4, 200), cp.float32)
                prefill.launch(prefill.spec_of(cfg, pr.causal), q, k, v, out, lse, problem=pr)
            # varlen: 1 token, none, ragged, queries without keys: tiles that run past a
            # sequence's end into the next one (the TMA producer zeroes those V rows)
            cu_q = cp.asarray(np.array([0, 1, 1, 131, 134], np.int32))
            cu_k = cp.asarray(np.array([0, 1, 10, 210, 210], np.int32))
            q, k, v = rand((134, 4, d), dt), rand((210, 2, d), dt), rand((210, 2, d), dt)
            for causal in (False, True):
                pr = checks.check_varlen(q, k, v, cu_q, cu_k, 130, 200, causal=causal)
                out, lse = cp.empty_like(q), cp.empty((4, 134), cp.float32)
                prefill.launch(prefill.spec_of(cfg, causal), q, k, v, out, lse, problem=pr,
                               cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    # varlen
    cu = cp.asarray(np.array([0, 5, 5, 70], dtype=np.int32))
    q = rand((70, 4, 64), cp.float16)
    cf.flash_attn_varlen_func(q, q[:, :2], q[:, :2], cu, cu, 65, 65, causal=True)
    # decode: contiguous and paged, ragged lengths incl. 0, GQA 4, seqlen_q 1 and 3
    for dt in (cp.float16, bf16):
        kc, vc = rand((3, 300, 2, 128), dt), rand((3, 300, 2, 128), dt)
        lens = cp.asarray(np.array([0, 1, 257], dtype=np.int32))
        for sq in (1, 3):
            qd = rand((3, sq, 8, 128), dt)
            cf.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, num_splits=4)
        page = 16
        pool_k, pool_v = rand((64, page, 2, 128), dt), rand((64, page, 2, 128), dt)
        table = cp.asarray(rng.permutation(64)[:3 * 19].reshape(3, 19).astype(np.int32))
        cf.flash_attn_with_kvcache(rand((3, 1, 8, 128), dt), pool_k, pool_v, cache_seqlens=lens,
                                   block_table=table, num_splits=0)
    # decode: more unsplit blocks than SMs (the 64-key tile, two blocks per SM)
    b = cp.cuda.Device().attributes["MultiProcessorCount"] // 8 + 1
    kc, vc = rand((b, 200, 8, 128), bf16), rand((b, 200, 8, 128), bf16)
    lens = cp.asarray(rng.integers(0, 201, b).astype(np.int32))
    cf.flash_attn_with_kvcache(rand((b, 1, 32, 128), bf16), kc, vc, cache_seqlens=lens)
    # decode: the two-stage pipelines (heuristics.choose_split_stages): several waves from 4k
    # keys (the 64-key tile), and one split of >= 8k keys (the one-block tile)
    kc, vc = rand((b, 4100, 8, 128), bf16), rand((b, 4100, 8, 128), bf16)
    lens = cp.asarray(rng.integers(0, 4101, b).astype(np.int32))
    cf.flash_attn_with_kvcache(rand((b, 1, 32, 128), bf16), kc, vc, cache_seqlens=lens)
    kc, vc = rand((2, 8200, 2, 128), bf16), rand((2, 8200, 2, 128), bf16)
    lens = cp.asarray(np.array([8200, 5003], dtype=np.int32))
    cf.flash_attn_with_kvcache(rand((2, 1, 8, 128), bf16), kc, vc, cache_seqlens=lens,
                               num_splits=1)
    # decode: a q 2 bytes off a 16-byte boundary (the Q tile by 2-byte loads, not cp.async)
    kc, vc = rand((3, 300, 2, 128), bf16), rand((3, 300, 2, 128), bf16)
    lens = cp.asarray(np.array([0, 277, 300], dtype=np.int32))
    qm = rand((3 * 2 * 8 * 128 + 1,), bf16)[1:].reshape(3, 2, 8, 128)
    for ns in (1, 3):
        cf.flash_attn_with_kvcache(qm, kc, vc, cache_seqlens=lens, num_splits=ns)


def backward(dtypes, small, bf16):
    # backward: every kernel family (mma.sync dK/dV in one and in two parts, CUDA cores), tails,
    # causal with queries that see no key, a window, GQA, varlen with empty sequences; the
    # mma.sync plan also on sm_90a (where the Hopper plan is the default: hopper_backward)
    import os
    from unittest import mock
    with mock.patch.dict(os.environ, {"CUPYFLASH_BWD_HOPPER": "0"}):
        _mma_backward(dtypes, small)
    hopper_backward(small, bf16)
    cu_q = cp.asarray(np.array([0, 5, 5, 70, 71], dtype=np.int32))
    cu_k = cp.asarray(np.array([0, 9, 40, 40, 130], dtype=np.int32))
    q, k = rand((71, 4, 64), bf16), rand((130, 2, 64), bf16)
    out, lse = cf.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 65, 90, causal=True, return_lse=True)
    cf.flash_attn_varlen_backward(rand(q.shape, bf16), q, k, k, out, lse, cu_q, cu_k, 65, 90,
                                  causal=True)


def _mma_backward(dtypes, small):
    for dt in dtypes:
        for d in ((64, 200) if small else (64, 128, 200)):
            q, k, v = rand((2, 77, 4, d), dt), rand((2, 133, 2, d), dt), rand((2, 133, 2, d), dt)
            for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (16, 8))):
                out, lse = cf.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                              return_lse=True)
                cf.flash_attn_backward(rand(q.shape, dt), q, k, v, out, lse, causal=causal,
                                       window_size=window)
            qs = q[:, :50]  # causal with seqlen_q < seqlen_k, and seqlen_q > seqlen_k
            for qq, kk in ((qs, k), (rand((2, 150, 4, d), dt), k[:, :30])):
                out, lse = cf.flash_attn_func(qq, kk, kk, causal=True, return_lse=True)
                cf.flash_attn_backward(rand(qq.shape, dt), qq, kk, kk, out, lse, causal=True)


def hopper_backward(small, bf16):
    """The Hopper backward (sm_90a's default): hd64, hd128 (a padded 72) and hd256 (a padded
    200), tails, GQA, causal with keys no query sees, a window, more than one query head per
    CTA."""
    import os
    from unittest import mock

    from cupyflash.core import planning
    if planning.default_arch() != "sm_90a":
        return
    with mock.patch.dict(os.environ, {"CUPYFLASH_BWD_HOPPER": "1"}):
        for dt in ((bf16,) if small else (bf16, cp.float16)):
            for d in (64, 72, 200):
                q, k = rand((2, 77, 4, d), dt), rand((2, 133, 2, d), dt)
                v = rand((2, 133, 2, d), dt)
                for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (16, 8))):
                    out, lse = cf.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                                  return_lse=True)
                    for det in (False, True):  # atomics; turns in a fixed order
                        cf.flash_attn_backward(rand(q.shape, dt), q, k, v, out, lse, causal=causal,
                                               window_size=window, deterministic=det)


if __name__ == "__main__":
    main()
