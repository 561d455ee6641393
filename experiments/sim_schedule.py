"""The TMA prefill kernel's persistent tile order, simulated on the CPU (NOTES v73).

``tile_order`` is a Python twin of ``TileScheduler`` in ``kernels_cu/common/tile_scheduler.cuh``
(the same integer arithmetic: L2 groups of heads, m-blocks longest first when causal, the causal
tail group below ``TAIL_TILES_PER_CTA`` tiles per CTA). ``makespan`` hands the tiles in that
order to ``grid`` CTAs, each tile to the CTA that becomes free first (the causal kernel's global
counter), a tile costing its key blocks plus ``overhead`` blocks (prologue and epilogue), and
returns the last CTA's finish over the ideal (total work / grid). A model of the schedule's
balance only: no L2, no tensor-core or memory timing. Tiles: the dispatcher's own choice
(:func:`cupyflash.forward.heuristics.choose_prefill_tile`).

    python experiments/sim_schedule.py                  # the bench's causal shapes, bf16
    python experiments/sim_schedule.py --overhead 2 --grid 132

Prints a table (with and without the tail group, and the order the kernel uses); writes nothing.
"""
from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's cupyflash
from cupyflash.forward.heuristics import choose_prefill_tile  # noqa: E402

#: TileScheduler::kL2Bytes and kTailTilesPerCta
L2_BYTES = 8 << 20
TAIL_TILES_PER_CTA = 12


def tile(batch: int, nheads: int, seqlen: int, headdim: int, causal: bool, grid: int) -> tuple:
    """``(block_m, block_n)`` the dispatcher picks for this bf16 self-attention shape."""
    bm, bn, _, _ = choose_prefill_tile("bfloat16", headdim, seqlen, seqlen, causal, grid,
                                       batch_nheads=batch * nheads)
    return bm, bn


def tile_order(batch: int, nheads: int, seqlen: int, headdim: int, block_m: int, causal: bool,
               grid: int, h_per_kv: int = 1, tail: bool | None = None) -> list:
    """``[(m_block, bh), ...]`` in the order the kernel hands tiles out (tile t = entry t).
    ``tail``: force the causal tail group on (True) or off (False); None: the kernel's rule."""
    num_m_blocks = -(-seqlen // block_m)
    num_bh = batch * nheads
    num_tiles = num_m_blocks * num_bh
    kv_bytes = max(1, seqlen * headdim * 4 // h_per_kv)
    group = max(1, min(num_bh, L2_BYTES // kv_bytes))
    tail_min = (2 * grid + num_m_blocks - 1) // max(num_m_blocks, 1)
    if tail is None:
        tail = num_tiles < TAIL_TILES_PER_CTA * grid
    tail_bh = num_bh - min(num_bh, max(group, tail_min)) if (causal and tail) else num_bh
    head_tiles = tail_bh * num_m_blocks
    out = []
    for t in range(num_tiles):
        if t < head_tiles:
            span = group * num_m_blocks
            grp = t // span
            first, size, r = grp * group, min(group, tail_bh - grp * group), t - grp * span
        else:
            first, size, r = tail_bh, num_bh - tail_bh, t - head_tiles
        mi = r // size
        out.append((num_m_blocks - 1 - mi if causal else mi, first + (r - mi * size)))
    return out


def makespan(order: list, seqlen: int, block_m: int, block_n: int, causal: bool, grid: int,
             overhead: float = 1.0) -> float:
    """Finish time of the last CTA over total work / grid, tiles taken by the first free CTA."""
    def cost(mi):
        keys = min((mi + 1) * block_m, seqlen) if causal else seqlen
        return math.ceil(keys / block_n) + overhead
    free = [0.0] * grid
    total = 0.0
    for mi, _ in order:
        c = cost(mi)
        total += c
        heapq.heapreplace(free, free[0] + c)
    return max(free) / (total / grid)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", type=int, default=132, help="CTAs (the H200's SMs)")
    ap.add_argument("--overhead", type=float, default=1.0,
                    help="a tile's fixed cost in key blocks (prologue, epilogue)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch (bench_prefill)")
    ap.add_argument("--hidden", type=int, default=2048, help="nheads x headdim (bench_prefill)")
    args = ap.parse_args(argv)
    print(f"{'hd':>3} {'S':>6} {'tiles/CTA':>9}  {'makespan / ideal: no tail':>26} "
          f"{'tail group':>10} {'kernel':>7}")
    for hd in (64, 128, 256):
        for s in (1024, 2048, 4096, 8192, 16384, 32768):
            b, h = max(1, args.tokens // s), args.hidden // hd
            bm, bn = tile(b, h, s, hd, True, args.grid)
            spans = []
            for tail in (False, True, None):
                order = tile_order(b, h, s, hd, bm, True, args.grid, tail=tail)
                spans.append(makespan(order, s, bm, bn, True, args.grid, args.overhead))
            per_cta = len(order) / args.grid
            print(f"{hd:>3} {s:>6} {per_cta:>9.1f}  {spans[0]:>26.3f} {spans[1]:>10.3f} "
                  f"{spans[2]:>7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
