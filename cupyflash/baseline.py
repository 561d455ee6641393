"""The materialising attention baseline: what most code computes, for comparison.

Standard attention (FlashAttention arXiv 2205.14135, Sec. 2.2, Algorithm 0) with the score matrix
in device memory:

1. ``S = Q K^T``: one cuBLAS strided-batched GEMM per call (``cublasGemmStridedBatchedEx``,
   one batch per (batch, KV head), the GQA group's query heads stacked as extra rows, so GQA needs
   no copy of K or V); S is written in float32 (float64 for float64 inputs) with float32
   accumulation (tensor cores for fp16/bf16).
2. ``P = softmax(scale * S + mask)``: our row-wise kernel (``kernels_cu/baseline.cu``), causal and
   sliding-window aware (bottom-right, README "Semantics"), writes P in the input dtype and the LSE.
3. ``O = P V``: a second strided-batched GEMM, float32 accumulation, O in the input dtype.

S and P, ``batch * nheads * seqlen_q * seqlen_k`` elements each, are the O(S^2) memory and HBM
traffic that the fused kernel avoids; ``cupyflash.io_model.baseline_traffic`` and
``baseline_extra_memory`` count them.
"""
from __future__ import annotations

import numpy as np

from .core import checks, deps, interop, jit, launch
from .core.params import BaselineSoftmaxParams, pointer_fields

__all__ = ["attention_baseline", "softmax_spec", "all_specs", "score_dtype", "gemm_plans"]

# cudaDataType_t / cublasComputeType_t / cublasOperation_t values (library_types.h, cublas_api.h)
_CUDA_R = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_COMPUTE_64F = 70
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_POINTER_MODE_HOST = 0

_CXX = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}
_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}
SOFTMAX_THREADS = 256


def score_dtype(dtype: str) -> str:
    """Element type of the stored scores S: float64 for float64 inputs, else float32."""
    return "float64" if dtype == "float64" else "float32"


def softmax_spec(dtype: str) -> jit.KernelSpec:
    """The softmax kernel specialisation for inputs of ``dtype`` (scores in :func:`score_dtype`)."""
    sd = score_dtype(dtype)
    return jit.KernelSpec(
        name=f"baseline_softmax_{_SHORT[sd]}_to_{_SHORT[dtype]}",
        source="baseline.cu",
        entry=f"cf::baseline_softmax_kernel<{_CXX[sd]}, {_CXX[dtype]}, {SOFTMAX_THREADS}>",
        smem_bytes=0)


def all_specs() -> list:
    """Every specialisation of the baseline softmax (one per input dtype)."""
    return [softmax_spec(dt) for dt in ("float16", "bfloat16", "float32", "float64")]


def _gemm_strided_batched(plan, a, b, c, dtype, c_dtype):
    """Column-major ``C = op(A) op(B)`` for ``batch_count`` matrices (cuBLAS conventions, ``plan``
    from :func:`gemm_plans`), on the current stream, alpha = 1, beta = 0, float32 accumulation
    (float64 for float64)."""
    transa, transb, m, n, k, lda, stride_a, ldb, stride_b, ldc, stride_c, batch_count = plan
    cupy = deps.cupy("attention_baseline")
    cublas = deps.cublas("attention_baseline")
    handle = cupy.cuda.device.get_cublas_handle()
    acc = np.float64 if c_dtype == "float64" else np.float32
    alpha = np.ones((), dtype=acc)
    beta = np.zeros((), dtype=acc)
    compute = _CUBLAS_COMPUTE_64F if c_dtype == "float64" else _CUBLAS_COMPUTE_32F
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, _CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmStridedBatchedEx(
            handle, transa, transb, m, n, k,
            alpha.ctypes.data, a.data.ptr, _CUDA_R[dtype], lda, stride_a,
            b.data.ptr, _CUDA_R[dtype], ldb, stride_b,
            beta.ctypes.data, c.data.ptr, _CUDA_R[c_dtype], ldc, stride_c,
            batch_count, compute, _CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)


def gemm_plans(batch: int, nheads_k: int, group: int, seqlen_q: int, seqlen_k: int, headdim: int):
    """Arguments of the two cuBLAS calls, as ``(transa, transb, m, n, k, lda, stride_a, ldb,
    stride_b, ldc, stride_c, batch_count)``; the operands are (A, B, C) = (kh, qh, S) for the first
    and (vh, P, oh) for the second. Kept apart so a CPU test can replay them in NumPy.

    cuBLAS is column-major: a row-major (rows x cols) buffer is the column-major (cols x rows)
    matrix. With M = group * seqlen_q query rows per (batch, KV head):

    * ``S^T (Sk x M) = op_T(K) . Q^T``: K's buffer is column-major d x Sk (lda = d), Q's is
      d x M (ldb = d); S's row-major (M x Sk) buffer is the column-major Sk x M result (ldc = Sk).
    * ``O^T (d x M) = V^T . P^T``: V's buffer is column-major d x Sk (lda = d), P's is Sk x M
      (ldb = Sk); O's row-major (M x d) buffer is the column-major d x M result (ldc = d).
    """
    M, Sk, d, nb = group * seqlen_q, seqlen_k, headdim, batch * nheads_k
    qk = (_CUBLAS_OP_T, _CUBLAS_OP_N, Sk, M, d, d, Sk * d, d, M * d, Sk, M * Sk, nb)
    pv = (_CUBLAS_OP_N, _CUBLAS_OP_N, d, M, Sk, d, Sk * d, Sk, M * Sk, d, M * d, nb)
    return qk, pv


def _heads_major(x, dtype):
    """(batch, seqlen, heads, d) -> contiguous (batch, heads, seqlen, d), copied as raw bits
    (so that 16-bit types need no arithmetic support in CuPy)."""
    cupy = deps.cupy("attention_baseline")
    bits = {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[x.dtype.itemsize]
    return cupy.ascontiguousarray(x.view(bits).transpose(0, 2, 1, 3)).view(x.dtype)


def attention_baseline(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                       return_lse=False):
    """Materialising attention: S = QK^T and P = softmax(S) written to device memory.

    Same arguments and result as :func:`cupyflash.flash_attn_func`, so benchmarks can swap the
    two; use it to measure what the fused kernel saves (time, memory, HBM bytes).

    Parameters
    ----------
    q : CUDA array, shape (batch, seqlen_q, nheads, headdim)
    k, v : CUDA arrays, shape (batch, seqlen_k, nheads_k, headdim)
        float16, bfloat16, float32 or float64, the same dtype; ``nheads % nheads_k == 0`` (query
        head ``h`` reads KV head ``h // (nheads // nheads_k)``).
    softmax_scale : float or None
        None = ``1 / sqrt(headdim)``.
    causal : bool
        Bottom-right aligned causal mask.
    window_size : (int, int)
        Sliding window ``(left, right)``, -1 = unbounded, bottom-right aligned.
    return_lse : bool
        Also return the LSE.

    Returns
    -------
    out : cupy.ndarray, shape (batch, seqlen_q, nheads, headdim), dtype of q
        0 for rows with no visible key.
    lse : cupy.ndarray float32, shape (batch, nheads, seqlen_q), only if ``return_lse``
        Natural log; -inf for rows with no visible key.

    Raises
    ------
    TypeError, ValueError
        From :func:`cupyflash.core.checks.check_attention`.

    Notes
    -----
    Extra device memory: ``batch * nheads * seqlen_q * seqlen_k * (4 + itemsize)`` bytes for S
    and P (``cupyflash.io_model.baseline_extra_memory``), plus head-major copies of q, k, v, o.
    """
    cupy = deps.cupy("attention_baseline")
    q, k, v = interop.as_cupy(q, "q"), interop.as_cupy(k, "k"), interop.as_cupy(v, "v")
    p = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size)
    B, Sq, Sk, H, Hk, d = p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_k, p.headdim
    g = H // Hk
    M = g * Sq                      # rows of one GEMM batch: the GQA group's queries
    nb = B * Hk                     # GEMM batch count
    sd = score_dtype(p.dtype)
    out = cupy.empty((B, Sq, H, d), dtype=q.dtype)
    lse = cupy.empty((B, H, Sq), dtype=cupy.float32)
    if out.size == 0 or lse.size == 0:
        if lse.size:
            lse.fill(-np.inf)
        return (out, lse) if return_lse else out
    if Sk == 0:  # every row empty
        out.view({2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[q.dtype.itemsize]).fill(0)
        lse.fill(-np.inf)
        return (out, lse) if return_lse else out

    # (B, H, Sq, d) with H = Hk * g is (B, Hk, g * Sq, d): row r of batch (b, kv) is query
    # r % Sq of head kv * g + r // Sq.
    plan_qk, plan_pv = gemm_plans(B, Hk, g, Sq, Sk, d)
    qh = _heads_major(q, q.dtype)
    kh = _heads_major(k, k.dtype)
    # 1. S = Q K^T (see gemm_plans for the column-major bookkeeping).
    s = cupy.empty((nb, M, Sk), dtype=np.float64 if sd == "float64" else np.float32)
    _gemm_strided_batched(plan_qk, kh, qh, s, p.dtype, sd)
    del qh, kh
    # 2. P = softmax(scale * S + mask), and the LSE.
    probs = cupy.empty((nb, M, Sk), dtype=q.dtype)
    rows = nb * M
    prm = BaselineSoftmaxParams(rows=rows, seqlen_q=Sq, seqlen_k=Sk, causal=int(p.causal),
                                softmax_scale=p.softmax_scale)
    prm.window_left, prm.window_right = checks.kernel_window(p)
    run = launch.Launch(jit.get_kernel(softmax_spec(p.dtype)), prm, (rows, 1, 1),
                        (SOFTMAX_THREADS, 1, 1),
                        pointers=pointer_fields(BaselineSoftmaxParams, ("s", "p", "lse")))
    run((s.data.ptr, probs.data.ptr, lse.data.ptr), cupy.cuda.get_current_stream().ptr)
    del s
    # 3. O = P V.
    vh = _heads_major(v, v.dtype)
    oh = cupy.empty((nb, M, d), dtype=q.dtype)
    _gemm_strided_batched(plan_pv, vh, probs, oh, p.dtype, p.dtype)
    del probs, vh
    bits = {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[q.dtype.itemsize]
    out.view(bits)[...] = oh.view(bits).reshape(B, H, Sq, d).transpose(0, 2, 1, 3)
    return (out, lse) if return_lse else out
