"""Hugging Face generate() on a padded batch (issue 36): tokens/s of greedy generation with
batch 8 left-padded prompts of mixed lengths, cupyflash (``attn_implementation="cupyfa"``,
padded decode on the split-KV kernel, and ``cupyfa_varlen``: the same with
``cupyflash.hf.DECODE = "varlen"``) against torch SDPA and transformers' "flash_attention_2"
(when ``flash_attn`` imports; else a ``what: "skipped"`` record says why).

The model is a Llama decoder built from a config (random weights, no download), bf16, on one
GPU: by default Llama-3.2-1B's attention and MLP shapes (hidden 2048, 32 query heads, 8 KV
heads, head dim 64, MLP 8192, 16 layers) with a 32k vocabulary; ``--quick``: 4 layers. The
prompts: ``round(prompt_max * f)`` tokens for f in 1, .19, .75, .03, .5, .88, .27, .59 (8
rows), left-padded to ``prompt_max`` (default 1024, ``--quick`` 256).

Per impl, wall-clock medians over ``--repeats`` (host time included: HF generation is largely
host-bound, and the padded paths differ in what they launch and synchronise), each timed region
between ``torch.cuda.synchronize()`` calls:

* ``ms_generate``: ``model.generate(ids, attention_mask=mask, max_new_tokens=N,
  min_new_tokens=N, do_sample=False)``; ``tokens_per_s = batch * N / s``;
* ``ms_prefill``: the prefill forward alone (``model(ids, attention_mask=mask,
  use_cache=True)``);
* ``ms_decode_step``: one decode forward (one new token per row against the prefilled cache,
  cropped back after each step), median over ``--decode-steps`` steps;
* ``ms_decode_step_est = (ms_generate - ms_prefill) / (N - 1)`` beside it (generate's own
  per-step overhead included);
* ``agree_with_sdpa``: the fraction of generated tokens equal to SDPA's (bf16 rounding makes
  greedy paths diverge after near-ties: informative, never asserted).

Each record (``what: "hf_generate"``): impl, batch, prompt_lens, prompt_max, new_tokens,
layers, hidden, heads, kv_heads, head_dim, vocab, dtype, the fields above, ``transformers``
(its version), ``decode`` (cupyflash.hf.DECODE for the cupyflash rows). An impl that fails gets
``error``.

    PYTHONPATH=. python3 experiments/bench_hf_generate.py --quick   # ~1-2 min on an H100
    PYTHONPATH=. python3 experiments/bench_hf_generate.py           # 16 layers, 1k prompts, 128 tokens

Appends a run to ``experiments/results/bench_hf_generate.jsonl`` (experiments/common.py). Without
a GPU (or without torch / transformers) it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402

IMPLS = ("cupyfa", "cupyfa_varlen", "sdpa", "flash_attention_2")
FRACTIONS = (1.0, 0.19, 0.75, 0.03, 0.5, 0.88, 0.27, 0.59)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="4 layers, prompts up to 256 tokens, 32 new tokens, 2 repeats")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--prompt-max", type=int, default=None, help="longest prompt (default 1024)")
    ap.add_argument("--batch", type=int, default=8, help="prompts (lengths cycle the fractions)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 128)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 16)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 3)")
    ap.add_argument("--decode-steps", type=int, default=10, help="timed single decode steps")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_hf_generate.jsonl")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments with the sweep resolved: ``prompt_max``, ``new_tokens``, ``layers``,
    ``repeats`` (the --quick or full defaults), ``prompt_lens``."""
    args = build_parser().parse_args(argv)
    q = args.quick
    args.prompt_max = args.prompt_max or (256 if q else 1024)
    args.new_tokens = args.new_tokens or (32 if q else 128)
    args.layers = args.layers or (4 if q else 16)
    args.repeats = args.repeats or (2 if q else 3)
    if args.new_tokens < 2:
        raise SystemExit("bench_hf_generate: --new-tokens must be at least 2")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise SystemExit("bench_hf_generate: --hidden must divide by --heads, --heads by "
                         "--kv-heads")
    args.prompt_lens = prompt_lengths(args.prompt_max, args.batch)
    return args


def prompt_lengths(prompt_max: int, batch: int) -> list:
    """Mixed lengths: ``max(1, round(prompt_max * f))`` cycling :data:`FRACTIONS`."""
    return [max(1, round(prompt_max * FRACTIONS[i % len(FRACTIONS)])) for i in range(batch)]


def impl_available(impl: str) -> tuple:
    """``(ok, why_not)``: flash_attention_2 needs the flash_attn package."""
    if impl != "flash_attention_2":
        return True, ""
    try:
        import flash_attn  # noqa: F401
    except Exception as e:
        return False, f"flash_attn does not import ({type(e).__name__}: {str(e)[:120]})"
    return True, ""


def _sync_time(fn):
    """(milliseconds, fn()) of wall time, the device synchronised before and after."""
    import torch
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def build_model(args, attn, device="cuda"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(4096, args.prompt_max + args.new_tokens))
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the GPU (no float32 CPU copy)
    try:
        with torch.device(device):
            model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn)
    finally:
        torch.set_default_dtype(prev)
    return model.to(device=device, dtype=torch.bfloat16).eval()


def inputs(args, device="cuda"):
    import torch
    g = torch.Generator().manual_seed(1)
    b, m = len(args.prompt_lens), args.prompt_max
    ids = torch.zeros(b, m, dtype=torch.long)
    mask = torch.zeros(b, m, dtype=torch.long)
    for i, n in enumerate(args.prompt_lens):
        ids[i, m - n:] = torch.randint(1, args.vocab, (n,), generator=g)
        mask[i, m - n:] = 1
    return ids.to(device), mask.to(device)


def measure(args, impl, model, ids, mask):
    """One impl's timings (the module docstring's fields) and its generated tokens."""
    import torch
    n = args.new_tokens
    gen_kw = dict(attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                  pad_token_id=0)
    with torch.no_grad():
        seq = model.generate(ids, **gen_kw)  # warm-up: compiles, allocator
        ms_gen = [_sync_time(lambda: model.generate(ids, **gen_kw))[0]
                  for _ in range(args.repeats)]
        ms_pre, cache = [], None
        for _ in range(args.repeats):
            ms, out = _sync_time(lambda: model(ids, attention_mask=mask, use_cache=True))
            ms_pre.append(ms)
            cache = out.past_key_values
        rec = {"ms_generate": statistics.median(ms_gen), "ms_prefill": statistics.median(ms_pre)}
        rec["tokens_per_s"] = len(args.prompt_lens) * n / (rec["ms_generate"] / 1e3)
        rec["ms_decode_step_est"] = (rec["ms_generate"] - rec["ms_prefill"]) / (n - 1)
        step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        pos = step_mask.sum(-1, keepdim=True) - 1
        nxt = seq[:, ids.shape[1]:ids.shape[1] + 1]
        # transformers 5.x names the cache argument `cache` (past_key_values deprecated)
        cache_kw = ("cache" if "cache" in inspect.signature(model.forward).parameters
                    else "past_key_values")
        ms_dec = []
        try:
            for _ in range(args.decode_steps + 1):
                ms, _out = _sync_time(lambda: model(nxt, attention_mask=step_mask,
                                                    position_ids=pos, use_cache=True,
                                                    **{cache_kw: cache}))
                ms_dec.append(ms)
                cache.crop(-1)  # drop the step's token (4.x and 5.x: a negative count)
            rec["ms_decode_step"] = statistics.median(ms_dec[1:])
        except Exception as e:  # a transformers version without crop / that kwarg
            rec["ms_decode_step_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return rec, seq[:, ids.shape[1]:]


def run(args, impls, device="cuda") -> list:
    """Every impl in turn (one model at a time), the records; ``agree_with_sdpa`` filled in."""
    import torch
    import transformers

    import cupyflash.hf as hf
    name = hf.register()
    ids, mask = inputs(args, device)
    base = dict(what="hf_generate", batch=len(args.prompt_lens), prompt_lens=args.prompt_lens,
                prompt_max=args.prompt_max, new_tokens=args.new_tokens, layers=args.layers,
                hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                head_dim=args.hidden // args.heads, vocab=args.vocab, dtype="bfloat16",
                transformers=transformers.__version__)
    records, tokens = [], {}
    model = None
    for impl in impls:
        attn = {"cupyfa": name, "cupyfa_varlen": name}.get(impl, impl)
        rec = dict(base, impl=impl)
        if impl.startswith("cupyfa"):
            rec["decode"] = hf.DECODE = "varlen" if impl == "cupyfa_varlen" else "kvcache"
        try:
            del model
            common.free_memory()
            model = build_model(args, attn, device)
            timing, toks = measure(args, impl, model, ids, mask)
            rec.update(timing)
            tokens[impl] = toks
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            model = None
        finally:
            hf.DECODE = "kvcache"
        records.append(rec)
        print(summary_line(rec), flush=True)
    if "sdpa" in tokens:
        for rec in records:
            if rec["impl"] in tokens and rec["impl"] != "sdpa":
                rec["agree_with_sdpa"] = float(
                    (tokens[rec["impl"]] == tokens["sdpa"]).float().mean().item())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return records


def summary_line(rec: dict) -> str:
    if "error" in rec:
        return f"  {rec['impl']:18s} error: {rec['error']}"
    step = rec.get("ms_decode_step")
    return (f"  {rec['impl']:18s} {rec['tokens_per_s']:9.1f} tok/s  generate "
            f"{rec['ms_generate']:8.1f} ms  prefill {rec['ms_prefill']:7.2f} ms  decode step "
            f"{'-' if step is None else f'{step:6.2f}'} ms (est {rec['ms_decode_step_est']:.2f})")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not common.have_gpu():
        print("bench_hf_generate: no CUDA GPU here; nothing to measure")
        return 0
    if not common.have_torch():
        print("bench_hf_generate: torch is not installed; nothing to measure")
        return 0
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        print("bench_hf_generate: transformers is not installed; nothing to measure")
        return 0
    import torch
    if not torch.cuda.is_available():
        print(f"bench_hf_generate: torch {torch.__version__} sees no CUDA device; nothing to "
              "measure")
        return 0
    prov = common.provenance()
    impls, skipped = [], []
    for impl in args.impls:
        ok, why = impl_available(impl)
        if ok:
            impls.append(impl)
        else:
            print(f"bench_hf_generate: skipping {impl}: {why}")
            skipped.append({"what": "skipped", "impl": impl, "reason": why})
    if skipped:
        common.append_results(args.out, skipped)
    print(f"bench_hf_generate: {prov.get('gpu')} commit {prov['commit'][:10]} prompts "
          f"{args.prompt_lens} + {args.new_tokens} tokens -> {args.out}")
    records = run(args, impls)
    n = common.append_results(args.out, records)
    print(f"bench_hf_generate: wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
