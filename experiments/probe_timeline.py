"""Per-block timeline of the decode split kernel: where the paged kernel's extra time goes at
short calls (NOTES v33; the instrumentation of the session-4/5 timeline probes, v10-v11).

    PYTHONPATH=. python experiments/probe_timeline.py [--out DIR]

A copy of ``kernels_cu/`` gets thread 0 of every block writing ``%globaltimer`` at fixed points
of ``decode_split`` (text anchors in ``flash_decode.cu``; the script stops if one is missing):

    0 entry   8 length landed (tile range known)   11 paged: prologue page ids landed
    12 prologue issued (before the Q tile)   2 first tile landed   3 loop end
    4 partial / output written   5 merging block (fused merge)   6 merge done

The same call (Llama-3-8B heads, bf16, full sequences, the public heuristic's tile, flags and
split count via ``run_split_variant``) runs on a contiguous cache and on the same bytes as a
paged pool of 16- and 256-key pages read through the identity table (NOTES v32: the paged
kernel alone costs 0.9 us at b1 x 8k). Each is graph-timed uninstrumented (20 calls per graph,
best of 3), then run instrumented once warm (back to back) and once after the L2 flush; per
mark the median over blocks (us from the earliest block's entry). Records are appended to
``$OUT/probe_timeline.jsonl`` (or --out).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import numpy as np

MARKS = {0: "entry", 8: "len", 11: "ids", 12: "issued", 2: "first_tile", 3: "loop_end",
         4: "written", 5: "merging", 6: "merged"}
NSLOT = 16
MAX_CTAS = 8192


def instrument(src: str) -> str:
    """flash_decode.cu with the timeline marks (see the module docstring)."""
    def ins(s, anchor, text, after=True):
        if s.count(anchor) != 1:
            raise SystemExit(f"anchor not found exactly once ({s.count(anchor)}): {anchor!r}")
        return s.replace(anchor, anchor + text if after else text + anchor)
    tl = r'''
extern "C" __device__ unsigned long long cf_timeline[8192 * 16];
namespace cf {
__device__ __forceinline__ void tl_mark(int slot) {
    if (threadIdx.x != 0) return;
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g) :: "memory");
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (cta < 8192) cf_timeline[cta * 16 + slot] = g;
}
}
'''
    s = ins(src, '#include "common/cluster.cuh"\n', tl)
    s = ins(s, "        __trap();  // launch bug, never silent\n", "    tl_mark(0);\n")
    s = ins(s, "    const int n_iter = tile_end - tile_begin;\n",
            "    asm volatile(\"\" :: \"r\"(len) : \"memory\");\n    tl_mark(8);\n")
    s = ins(s, "    if (!spec_kv_hit) {\n", "    if constexpr (PAGED) tl_mark(11);\n", after=False)
    s = ins(s, "    // ---- Q tile (16 rows", "    tl_mark(12);\n", after=False)
    s = ins(s, "            __syncthreads();          // everyone's have; everyone is done with "
               "stage it - 1\n", "        if (it == 0) tl_mark(2);\n")
    s = ins(s, "    // ---- epilogue: merge the NWARPS warp states", "    tl_mark(3);\n",
            after=False)
    s = ins(s, "        if (direct) return;\n", "        tl_mark(4);\n", after=False)
    s = ins(s, "        if (*flag == 0) return;\n", "        tl_mark(5);\n")
    anchor = "            store_merged<T>(p, st, b, qi, h, c);\n        }\n    }\n}\n"
    s = ins(s, anchor, "", after=True)
    s = s.replace(anchor, "            store_merged<T>(p, st, b, qi, h, c);\n        }\n"
                          "        tl_mark(6);\n    }\n}\n")
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get(
        "OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")))
    ap.add_argument("--cases", nargs="+", default=["1,8192", "1,2048", "64,1024", "16,1024"])
    ap.add_argument("--no-spec-ids", action="store_true",
                    help="paged kernels without FLAG_SPEC_PAGE_IDS (the length read first)")
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[0, 16, 256])
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    kdir = tempfile.mkdtemp(prefix="cupyflash_tl_")
    shutil.copytree(os.path.join(root, "kernels_cu"), kdir, dirs_exist_ok=True)
    with open(os.path.join(root, "kernels_cu", "flash_decode.cu")) as f:
        code = instrument(f.read())
    with open(os.path.join(kdir, "probe_timeline.cu"), "w") as f:
        f.write(code)
    os.environ["CUPYFLASH_KERNELS_DIR"] = kdir  # the copy (plain kernels: the same text)
    import cupy as cp
    import ml_dtypes
    sys.path.insert(0, here)
    import common
    from cupyflash import decode as Dm, jit

    mods = {}

    def instrumented(spec):
        if spec not in mods:
            src = jit.preprocess("probe_timeline.cu")
            opts = jit.BASE_OPTIONS + tuple(f"-I{d}" for d in jit.include_dirs())
            mod = cp.RawModule(code=src, options=opts, name_expressions=[spec.entry])
            k = mod.get_function(spec.entry)
            k.max_dynamic_shared_size_bytes = spec.smem_bytes
            mods[spec] = (mod, k)
        return mods[spec]

    orig_get = jit.get_kernel

    def get_kernel(spec, options=()):
        if getattr(spec, "name", "").endswith("_timeline"):
            return instrumented(spec)[1]
        return orig_get(spec, options)

    class Probe(Dm.SplitVariant):
        def spec(self, dtype, headdim, paged):
            s = Dm.SplitVariant.spec(self, dtype, headdim, paged)
            return jit.KernelSpec(s.name + "_timeline", s.source, s.entry, s.smem_bytes)

    bf = ml_dtypes.bfloat16
    H, HK, D = 32, 8, 128
    prov = common.provenance()
    rng = cp.random.default_rng(3)
    recs = []
    for case in args.cases:
        B, S = (int(x) for x in case.split(","))
        q = rng.standard_normal((B, 1, H, D), dtype=cp.float32).astype(bf)
        kc = rng.standard_normal((B, S, HK, D), dtype=cp.float32).astype(bf)
        vc = rng.standard_normal((B, S, HK, D), dtype=cp.float32).astype(bf)
        cs = cp.full((B,), S, cp.int32)
        ref = None
        for ps in args.page_sizes:
            if ps:
                kk, vv = kc.reshape(-1, ps, HK, D), vc.reshape(-1, ps, HK, D)
                bt = cp.arange(B * S // ps, dtype=cp.int32).reshape(B, S // ps)
            else:
                kk, vv, bt = kc, vc, None
            plan = Dm.explain_kvcache(q, kk, vv, cache_seqlens=cs, block_table=bt, report=False)
            t = plan.template
            flags = Dm.default_flags(D, bool(ps), ps or None)
            if ps and args.no_spec_ids:
                flags &= ~Dm.FLAG_SPEC_PAGE_IDS
            order = Dm._grid_order(bool(ps))
            ns = plan.num_splits
            base = Dm.SplitVariant(t["block_n"], t["nwarps"], t["stages"], flags, order, pdl=True)
            probe = Probe(t["block_n"], t["nwarps"], t["stages"], flags, order, pdl=True)
            out = cp.full(q.shape, np.nan, q.dtype)
            ws = cp.zeros(max(base.workspace_elems(B, 1, H, HK, D, ns), 1), cp.float32)
            fn = lambda v=base: Dm.run_split_variant(v, q, kk, vv, cs, bt, out, ws,  # noqa: E731
                                                     num_splits=ns)
            fn()
            cp.cuda.Device().synchronize()
            o = cp.asnumpy(out.view(cp.uint16))
            ref = o if ref is None else ref
            rec = dict(probe="timeline", batch=B, seqlen_k=S, page_size=ps,
                       kernel=base.spec("bfloat16", D, bool(ps)).name,
                       num_splits=ns, grid_order=order, us_graph=common.graph_time_us(fn),
                       bitwise_vs_contiguous=bool(np.array_equal(o, ref)), **prov)
            jit.get_kernel = get_kernel
            try:
                mod = instrumented(probe.spec("bfloat16", D, bool(ps)))[0]
                tl = cp.ndarray((MAX_CTAS * NSLOT,), cp.uint64, mod.get_global("cf_timeline"))
                nblk = min(MAX_CTAS, int(np.prod(plan.grid)))
                for mode in ("warm", "flushed"):
                    for _ in range(3):  # the last of three runs is kept
                        tl.fill(0)
                        if mode == "flushed":
                            common.flush_l2_cache("read")
                        Dm.run_split_variant(probe, q, kk, vv, cs, bt, out, ws, num_splits=ns)
                        cp.cuda.Device().synchronize()
                    a = cp.asnumpy(tl[:nblk * NSLOT]).reshape(nblk, NSLOT).astype(np.float64)
                    t0 = a[:, 0].min()
                    for slot, name in MARKS.items():
                        hit = a[:, slot] > 0
                        if hit.any():
                            x = (a[hit, slot] - t0) / 1e3
                            rec[f"{mode}_{name}_p50"] = round(float(np.median(x)), 3)
                            rec[f"{mode}_{name}_max"] = round(float(x.max()), 3)
            finally:
                jit.get_kernel = orig_get
            recs.append(rec)
            print(f"B={B} S={S} page={ps} ns={ns} graph {rec['us_graph']:.2f} us | " + " ".join(
                f"{n}={rec.get('warm_' + n + '_p50', float('nan')):.2f}/"
                f"{rec.get('flushed_' + n + '_p50', float('nan')):.2f}"
                for n in MARKS.values()), flush=True)
        del q, kc, vc
        common.free_memory()
    os.makedirs(args.out, exist_ok=True)
    common.append_jsonl(os.path.join(args.out, "probe_timeline.jsonl"), recs)
    shutil.rmtree(kdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
