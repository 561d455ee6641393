"""Does a small Llama-style model train the same with cupyflash attention as with SDPA?

A Llama model built from a ``LlamaConfig`` (nothing downloaded; default: hidden 512, 6 layers,
8 query heads and 2 KV heads (GQA), head dim 64, MLP 1536, vocab 4096, 2048 positions; 22M
parameters) gets random weights from ``--seed`` and is trained as a causal LM for ``--steps``
steps (default 300; ``--quick`` 30) on batches of 8 x 1024 tokens, once per attention
implementation, every run from the same initial weights on the same batches:

* ``sdpa``: ``attn_implementation="sdpa"`` (transformers' own; torch picks the backend, most
  likely its FlashAttention-2 kernel for these shapes; not queried): the reference;
* ``cupyflash``: ``attn_implementation="cupyfa"`` after ``cupyflash.hf.register()``;
* ``sdpa_alt``: torch SDPA forced onto another backend (memory-efficient on CUDA, math on the
  CPU; K/V heads repeated for GQA), through an attention function this script registers as
  ``sdpa_alt``. Its distance from ``sdpa`` is the bf16 noise floor: what two correct attention
  kernels that round differently do to the same training run.

Precision (``--precision``): ``bf16`` (default) keeps the model's parameters and activations in
bfloat16 and fp32 master weights with fp32 AdamW states beside them (each step: bf16 gradients
-> fp32, clip, AdamW on the fp32 weights, copy back rounded to bf16): the bf16 recipe of
Megatron-LM and DeepSpeed, and how a model loaded with ``dtype=torch.bfloat16`` meets a
FlashAttention kernel (fp16/bf16 inputs only). ``autocast``: fp32 parameters under
``torch.autocast(dtype=torch.bfloat16)`` (PyTorch AMP, HF Trainer's ``bf16=True``); there the
attention function receives float32 q/k (RoPE's cos/sin come in the residual stream's float32
and promote them) beside a bfloat16 v: SDPA's autocast rule casts all three to bf16,
transformers' FlashAttention integration does the same by hand, ``cupyflash.hf`` (as of this
script) passes them on as they are.

Data: a fixed, seeded token stream with structure to learn. A sparse Markov chain over the vocab
(each token has ``--successors`` 8 possible successors with Dirichlet(1) probabilities; entropy
rate H about 1.7 nats) generates a walk of ``--period`` tokens (default seqlen / 2) per sequence,
and the sequence is that walk repeated. The first half is learnt as bigrams (MLP work), the
second half only by attending back ``period`` tokens (attention work: a copy/induction head), so
the loss falls from ln(vocab) = 8.3 towards ``loss_floor`` = (period - 1) H / (seqlen - 1) (~0.9)
and the attention's gradients matter. Batch ``i`` is drawn from its own seed (``--seed``,
``i``): a ``--quick`` run trains on the first batches of a full one.

Optimiser: AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on the matrices and embeddings,
none on the norms), lr 1e-3 with ``--warmup`` 20 linear warm-up steps then cosine decay to 10%,
gradient clipping at 1.0 (``grad_norm`` is the norm before clipping). Every step synchronises
(the loss is read back), so ``step_ms`` is the step's wall time; ``tokens_per_s`` = tokens per
step / median ``step_ms`` (the first step, with the kernels' JIT compile, is ``first_step_ms``).

Agreement criterion (``compare`` records): with ``ma`` the trailing ``--ma-window`` (10)-step
moving average of the per-step loss, a run agrees with ``sdpa`` when it completed every step and
``|ma_run - ma_sdpa| <= --tol (0.02) * ma_sdpa`` at every step from the window's last on. Each
record also gives ``max_abs_loss_diff`` (raw per-step losses), the final losses, and for
cupyflash the same statistic of ``sdpa_alt`` (``noise_max_ma_rel_diff``) with
``within_2x_noise``: cupyflash's ``max_ma_rel_diff`` at most twice the noise floor's.

Results (``--out``, default ``experiments/results/train_llama.jsonl``; one run header, see
experiments/common.py): one ``what="train"`` record per training run, its per-step lists in one
record (``loss``, ``grad_norm``, ``lr``, ``step_ms``; index = step), with ``impl``,
``attn_implementation``, ``precision``, ``model`` / ``data`` / ``optim`` (the settings),
``steps``, ``steps_done``, ``tokens_per_s``, ``median_step_ms``, ``first_step_ms``,
``peak_mem_bytes``, ``wall_s`` and, when the run raised, ``error`` ("Type: message"),
``failed_step`` and ``failed_phase`` (forward / backward / optimizer) with the losses up to there
(a forward that ran before a backward raised still gives that step's loss); then one
``what="compare"`` record per run against ``sdpa``. ``python experiments/plot.py --only
train_llama`` draws ``figures/train_llama.png`` from the last run in the file.

    python experiments/train_llama.py                  # 3 runs x 300 steps (estimated 1-3 min
                                                       # on an H200; not yet run there)
    python experiments/train_llama.py --quick          # 3 runs x 30 steps (estimated < 1 min)
    python experiments/train_llama.py --runs sdpa cupyflash --precision autocast

Without a CUDA GPU it says so, trains a tiny model (hidden 64, 2 layers, 4 x 64 tokens) for a
few SDPA steps on the CPU (nothing written) and exits 0; ``--device cpu`` runs the whole
experiment on the CPU at the sizes given and writes its records (the CPU tests do, tiny).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402

NO_GPU_LINE = ("no CUDA GPU found: running the CPU parts (a tiny Llama's SDPA training steps on "
               "the CPU; nothing written)")
RUNS = ("sdpa", "cupyflash", "sdpa_alt")
REFERENCE = "sdpa"
NOISE = "sdpa_alt"
ALT_NAME = "sdpa_alt"  # the attention function this script registers for the noise-floor run

#: the model of the experiment (``--hidden`` etc. override)
MODEL = dict(vocab=4096, hidden=512, layers=6, heads=8, kv_heads=2, head_dim=64,
             intermediate=1536, max_positions=2048)
#: the model and batch of the no-GPU smoke run (and of the CPU tests)
TINY = dict(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
            max_positions=128, batch=4, seqlen=64)


# ------------------------------------------------------------------------------------------------
# Model and data
# ------------------------------------------------------------------------------------------------
def llama_config(vocab=MODEL["vocab"], hidden=MODEL["hidden"], layers=MODEL["layers"],
                 heads=MODEL["heads"], kv_heads=MODEL["kv_heads"], head_dim=MODEL["head_dim"],
                 intermediate=MODEL["intermediate"], max_positions=MODEL["max_positions"]):
    """A ``transformers.LlamaConfig`` for training from scratch: no dropout, no cache, untied
    embeddings, transformers' defaults otherwise (RMSNorm, SiLU MLP, RoPE)."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=max_positions, attention_dropout=0.0,
                       use_cache=False, tie_word_embeddings=False)


def build_model(config, seed: int, attn_implementation: str = "sdpa"):
    """A ``LlamaForCausalLM`` of ``config`` with transformers' random initialisation drawn after
    ``torch.manual_seed(seed)``: float32, on the CPU, in training mode."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.float().train()


def initial_state(config, seed: int) -> dict:
    """The initial weights of every run: :func:`build_model`'s, float32 CPU copies."""
    model = build_model(config, seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class MarkovStream:
    """The fixed token stream (see the module docstring): a sparse Markov chain over ``vocab``
    tokens (``successors`` successors per token, Dirichlet(1) probabilities, both from
    ``seed``); :meth:`batch` ``i`` is ``batch`` walks of ``period`` tokens from uniform random
    starts, each repeated to ``seqlen`` tokens, drawn from the seed (``seed``, ``i``)."""

    def __init__(self, vocab: int, seqlen: int, batch: int, seed: int = 0, successors: int = 8,
                 period: int | None = None):
        self.vocab, self.seqlen, self.batch_size, self.seed = vocab, seqlen, batch, seed
        self.period = min(seqlen, period or max(1, seqlen // 2))
        rng = np.random.default_rng([seed, 0])
        self.succ = rng.integers(0, vocab, size=(vocab, successors))
        self.probs = rng.dirichlet(np.ones(successors), size=vocab)
        self.cdf = np.cumsum(self.probs, axis=1)
        self.cdf[:, -1] = 1.0

    def batch(self, i: int) -> np.ndarray:
        """Batch ``i``: int64 (batch, seqlen)."""
        rng = np.random.default_rng([self.seed, 1, i])
        b, p = self.batch_size, self.period
        walk = np.empty((b, p), np.int64)
        cur = rng.integers(0, self.vocab, size=b)
        walk[:, 0] = cur
        u = rng.random((b, p - 1))
        rows = np.arange(b)
        for t in range(1, p):
            j = np.minimum((u[:, t - 1, None] >= self.cdf[cur]).sum(axis=1), self.succ.shape[1] - 1)
            cur = self.succ[cur, j]
            walk[rows, t] = cur
        reps = -(-self.seqlen // p)
        return np.tile(walk, (1, reps))[:, :self.seqlen]

    def entropy_rate(self, iters: int = 200) -> float:
        """The chain's entropy rate (nats per token) under its stationary distribution (power
        iteration from uniform)."""
        pi = np.full(self.vocab, 1.0 / self.vocab)
        for _ in range(iters):
            pi = np.bincount(self.succ.ravel(), weights=(pi[:, None] * self.probs).ravel(),
                             minlength=self.vocab)
        # a token listed twice among a row's successors: merge its probabilities
        h = 0.0
        for i in np.flatnonzero(pi > 0):
            q = np.bincount(self.succ[i], weights=self.probs[i])
            q = q[q > 0]
            h -= pi[i] * float((q * np.log(q)).sum())
        return float(h)

    def loss_floor(self) -> float:
        """The mean cross-entropy of the ideal predictor over the ``seqlen - 1`` targets of a
        sequence: the walk's ``period - 1`` transitions at the entropy rate, the repeats free."""
        return (self.period - 1) * self.entropy_rate() / (self.seqlen - 1)

    def describe(self) -> dict:
        return {"kind": "markov_repeat", "vocab": self.vocab, "batch": self.batch_size,
                "seqlen": self.seqlen, "period": self.period, "successors": self.succ.shape[1],
                "seed": self.seed, "entropy_rate": round(self.entropy_rate(), 4),
                "loss_floor": round(self.loss_floor(), 4)}


# ------------------------------------------------------------------------------------------------
# Attention implementations
# ------------------------------------------------------------------------------------------------
def _sdpa_alt_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention signature: torch SDPA on another backend than the default one
    (memory-efficient on CUDA, math on the CPU), K/V heads repeated for GQA."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if attention_mask is not None:
        raise NotImplementedError("sdpa_alt: no attention masks (train without padding)")
    g = query.shape[1] // key.shape[1]
    if g > 1:
        key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and query.shape[2] > 1
    backend = (SDPBackend.EFFICIENT_ATTENTION if query.is_cuda else SDPBackend.MATH)
    with sdpa_kernel([backend]):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def attn_implementation(run: str) -> str:
    """The ``attn_implementation`` name of a run, registering it with transformers first
    (``cupyflash.hf.register()`` for cupyflash; may raise where cupyflash cannot import)."""
    if run == "sdpa":
        return "sdpa"
    if run == "sdpa_alt":
        from transformers import AttentionInterface
        AttentionInterface.register(ALT_NAME, _sdpa_alt_forward)
        return ALT_NAME
    if run == "cupyflash":
        import cupyflash.hf
        return cupyflash.hf.register()
    raise ValueError(f"unknown run {run!r}; expected one of {RUNS}")


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------
def lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio * lr`` at the last
    step."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - 1 - warmup)
    frac = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _param_groups(params, names, weight_decay):
    decay = [p for p, n in zip(params, names) if p.ndim >= 2]
    no_decay = [p for p, n in zip(params, names) if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:600]}"


def train_run(run: str, config, init: dict, stream: MarkovStream, steps: int, *,
              device: str = "cpu", precision: str = "bf16", lr: float = 1e-3,
              warmup: int = 20, min_lr_ratio: float = 0.1, weight_decay: float = 0.1,
              clip: float = 1.0, log_every: int = 0) -> dict:
    """Train a fresh model (weights ``init``) for ``steps`` steps on ``stream``'s batches
    0..steps-1 with the attention of ``run``; returns the ``what="train"`` record (see the
    module docstring). An exception in any phase ends the run and is recorded, not raised."""
    import torch
    rec = {"what": "train", "impl": run, "precision": precision, "device": device,
           "steps": steps, "steps_done": 0, "loss": [], "grad_norm": [], "lr": [],
           "step_ms": [], "tokens_per_step": stream.batch_size * stream.seqlen}
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    phase, step, pending = "setup", 0, None
    t_run = time.perf_counter()
    model = opt = None
    try:
        name = attn_implementation(run)
        rec["attn_implementation"] = name
        if run == "sdpa_alt":
            rec["sdpa_backend"] = "efficient" if cuda else "math"
        model = build_model(config, 0, name)
        model.load_state_dict(init)
        params = [p for _, p in model.named_parameters()]
        names = [n for n, _ in model.named_parameters()]
        if precision == "bf16":
            model.to(device=device, dtype=torch.bfloat16)
            master = [init[n].to(device=device, dtype=torch.float32).clone() for n in names]
            opt_params = master
        elif precision == "autocast":
            model.to(device=device)
            master, opt_params = None, params
        else:
            raise ValueError(f"precision: expected bf16 or autocast, got {precision!r}")
        opt = torch.optim.AdamW(_param_groups(opt_params, names, weight_decay), lr=lr,
                                betas=(0.9, 0.95), eps=1e-8)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for step in range(steps):
            ids = torch.from_numpy(stream.batch(step)).to(device)
            cur_lr = lr_at(step, steps, lr, warmup, min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = cur_lr
            sync()
            t0 = time.perf_counter()
            phase = "forward"
            if precision == "autocast":
                with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss_value = float(loss.detach().float())  # synchronises
            pending = loss_value
            phase = "backward"
            loss.backward()
            phase = "optimizer"
            if master is not None:
                for m, p in zip(master, params):
                    m.grad = None if p.grad is None else p.grad.float()
                    p.grad = None
            gn = torch.nn.utils.clip_grad_norm_(opt_params, clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if master is not None:
                with torch.no_grad():
                    for m, p in zip(master, params):
                        p.copy_(m)
            gn = float(gn)
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            rec["loss"].append(loss_value)
            pending = None
            rec["grad_norm"].append(gn)
            rec["lr"].append(cur_lr)
            rec["step_ms"].append(ms)
            rec["steps_done"] = step + 1
            if not (math.isfinite(loss_value) and math.isfinite(gn)):
                raise FloatingPointError(f"loss {loss_value}, grad norm {gn} at step {step}")
            if log_every and (step % log_every == 0 or step == steps - 1):
                print(f"  {run:<10} step {step:>4}  loss {loss_value:8.4f}  grad norm "
                      f"{gn:7.3f}  lr {cur_lr:.2e}  {ms:8.1f} ms", flush=True)
    except Exception as e:  # record it and let the other runs go on
        rec.update(error=_error_text(e), failed_step=step, failed_phase=phase)
        if pending is not None:  # the failed step's forward ran: keep its loss
            rec["loss"].append(pending)
        tb = traceback.format_exc().strip().splitlines()
        rec["traceback_tail"] = tb[-6:]
        print(f"  {run}: {phase} of step {step} raised {rec['error'][:300]}", flush=True)
    times = rec["step_ms"]
    if times:
        rec["first_step_ms"] = times[0]
        steady = times[1:] or times
        rec["median_step_ms"] = statistics.median(steady)
        rec["tokens_per_s"] = rec["tokens_per_step"] / (rec["median_step_ms"] / 1e3)
    if cuda:
        rec["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated())
    rec["wall_s"] = time.perf_counter() - t_run
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return rec


# ------------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------------
def moving_average(xs, window: int) -> list:
    """Trailing moving average: element ``t`` is the mean of ``xs[max(0, t-window+1):t+1]``."""
    out, acc = [], 0.0
    for t, x in enumerate(xs):
        acc += x
        if t >= window:
            acc -= xs[t - window]
        out.append(acc / min(t + 1, window))
    return out


def criterion_text(window: int, tol: float) -> str:
    return (f"completed every step, and the trailing {window}-step moving average of the loss "
            f"within {tol:.0%} (relative) of sdpa's at every step from step {window - 1} on")


def compare(run: dict, ref: dict, window: int = 10, tol: float = 0.02) -> dict:
    """The ``what="compare"`` record of ``run`` against ``ref`` (two ``train`` records): the
    statistics over the steps both have, and ``agree`` (the module docstring's criterion; None
    when either run has fewer steps than asked, e.g. it raised)."""
    n = min(len(run["loss"]), len(ref["loss"]))
    out = {"what": "compare", "impl": run["impl"], "ref": ref["impl"], "ma_window": window,
           "tol": tol, "criterion": criterion_text(window, tol), "steps": run["steps"],
           "steps_compared": n, "tokens_per_s": run.get("tokens_per_s"),
           "tokens_per_s_ref": ref.get("tokens_per_s")}
    if out["tokens_per_s"] and out["tokens_per_s_ref"]:
        out["speed_ratio"] = out["tokens_per_s"] / out["tokens_per_s_ref"]
    if run.get("error"):
        out["error"] = run["error"]
    if ref.get("error"):
        out["ref_error"] = ref["error"]
    if n == 0:
        out["agree"] = None
        return out
    a, b = run["loss"][:n], ref["loss"][:n]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    i = int(np.argmax(diffs))
    out.update(max_abs_loss_diff=diffs[i], max_abs_loss_diff_step=i,
               first_loss=a[0], first_loss_ref=b[0], first_loss_diff=a[0] - b[0],
               final_loss=a[-1], final_loss_ref=b[-1])
    ma, mb = moving_average(a, window), moving_average(b, window)
    out.update(final_ma=ma[-1], final_ma_ref=mb[-1],
               final_ma_rel_diff=abs(ma[-1] - mb[-1]) / mb[-1])
    if n >= window:
        rel = [abs(x - y) / y for x, y in zip(ma[window - 1:], mb[window - 1:])]
        j = int(np.argmax(rel))
        out.update(max_ma_rel_diff=rel[j], max_ma_rel_diff_step=j + window - 1)
    complete = (len(run["loss"]) == run["steps"] and len(ref["loss"]) == ref["steps"]
                and run["steps_done"] == run["steps"] and not run.get("error")
                and not ref.get("error"))
    if not complete or n < window:
        out["agree"] = None
    else:
        out["agree"] = bool(out["max_ma_rel_diff"] <= tol)
    return out


def comparisons(records: list, window: int, tol: float) -> list:
    """``compare`` records of every run against ``sdpa``; cupyflash's also carry the noise
    floor (``sdpa_alt`` against ``sdpa``)."""
    by = {r["impl"]: r for r in records}
    if REFERENCE not in by:
        return []
    out = [compare(r, by[REFERENCE], window, tol) for r in records if r["impl"] != REFERENCE]
    noise = next((c for c in out if c["impl"] == NOISE), None)
    for c in out:
        if c["impl"] == NOISE or noise is None or noise.get("max_ma_rel_diff") is None:
            continue
        c["noise_max_ma_rel_diff"] = noise["max_ma_rel_diff"]
        c["noise_max_abs_loss_diff"] = noise.get("max_abs_loss_diff")
        if c.get("max_ma_rel_diff") is not None and c.get("agree") is not None:
            c["within_2x_noise"] = bool(c["max_ma_rel_diff"] <= 2 * noise["max_ma_rel_diff"])
    return out


def _fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def print_summary(records: list, comps: list) -> None:
    print(f"\n{'run':<11}{'steps':>7}{'first loss':>12}{'final loss':>12}{'final ma':>10}"
          f"{'tokens/s':>12}{'median ms':>11}{'peak GiB':>10}  error")
    for r in records:
        loss = r["loss"]
        ma = moving_average(loss, 10)[-1] if loss else None
        peak = r.get("peak_mem_bytes")
        print(f"{r['impl']:<11}{r['steps_done']:>7}{_fmt(loss[0] if loss else None):>12}"
              f"{_fmt(loss[-1] if loss else None):>12}{_fmt(ma):>10}"
              f"{_fmt(r.get('tokens_per_s'), ',.0f'):>12}{_fmt(r.get('median_step_ms'), '.1f'):>11}"
              f"{_fmt(peak / 2**30 if peak else None, '.2f'):>10}  {r.get('error', '')[:100]}")
    for c in comps:
        verdict = {True: "AGREE", False: "DIFFER", None: "not judged"}[c["agree"]]
        print(f"\n{c['impl']} vs {c['ref']} over {c['steps_compared']} steps: max |loss diff| "
              f"{_fmt(c.get('max_abs_loss_diff'))} "
              f"(step {c.get('max_abs_loss_diff_step', '-')}), max rel. diff of the "
              f"{c['ma_window']}-step moving average {_fmt(c.get('max_ma_rel_diff'), '.3%')} "
              f"(step {c.get('max_ma_rel_diff_step', '-')}), final loss "
              f"{_fmt(c.get('final_loss'))} vs {_fmt(c.get('final_loss_ref'))}: {verdict}")
        if c.get("noise_max_ma_rel_diff") is not None:
            print(f"  noise floor ({NOISE} vs {REFERENCE}): max moving-average rel. diff "
                  f"{c['noise_max_ma_rel_diff']:.3%}; within 2x the noise: "
                  f"{c.get('within_2x_noise', '-')}")
        if c.get("error"):
            print(f"  {c['impl']} raised: {c['error'][:300]}")
    if comps:
        print(f"\ncriterion: {criterion_text(comps[0]['ma_window'], comps[0]['tol'])}")


# ------------------------------------------------------------------------------------------------
def run_experiment(args, device: str, on_record=None) -> tuple[list, list]:
    """Every run of ``args.runs`` on ``device``; returns (train records, compare records).
    ``on_record(record)`` is called with each train record as its run ends."""
    import transformers
    cfg_kw = {k: getattr(args, k) for k in MODEL}
    config = llama_config(**cfg_kw)
    stream = MarkovStream(args.vocab, args.seqlen, args.batch, seed=args.seed,
                          successors=args.successors, period=args.period)
    init = initial_state(config, args.seed)
    nparams = sum(v.numel() for v in init.values())
    data = stream.describe()
    model = dict(cfg_kw, params=nparams, seed=args.seed)
    optim = dict(name="AdamW", lr=args.lr, betas=[0.9, 0.95], eps=1e-8,
                 weight_decay=args.weight_decay, warmup=args.warmup,
                 schedule="linear warm-up, cosine to min_lr_ratio", min_lr_ratio=args.min_lr_ratio,
                 clip=args.clip)
    print(f"model: Llama, {args.layers} layers, hidden {args.hidden}, {args.heads} q / "
          f"{args.kv_heads} kv heads x {args.head_dim}, MLP {args.intermediate}, vocab "
          f"{args.vocab}: {nparams / 1e6:.1f}M parameters; {args.precision}; {device}")
    print(f"data: {args.batch} x {args.seqlen} tokens per step, Markov walks of {stream.period} "
          f"tokens repeated (entropy rate {data['entropy_rate']:.3f} nats, loss floor "
          f"{data['loss_floor']:.3f}, ln(vocab) {math.log(args.vocab):.3f}); {args.steps} steps",
          flush=True)
    records = []
    log_every = max(1, args.steps // 10)
    for run in args.runs:
        print(f"run {run}:", flush=True)
        rec = train_run(run, config, init, stream, args.steps, device=device,
                        precision=args.precision, lr=args.lr, warmup=args.warmup,
                        min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
                        clip=args.clip, log_every=log_every)
        rec.update(model=model, data=data, optim=optim, transformers=transformers.__version__)
        records.append(rec)
        if on_record is not None:
            on_record(rec)
    return records, comparisons(records, args.ma_window, args.tol)


def run_cpu_smoke(args) -> int:
    """No GPU: a tiny model's SDPA (and sdpa_alt) steps on the CPU; prints, writes nothing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"train_llama: {e}; install torch and transformers for the CPU parts")
        return 0
    steps = 3 if args.quick else 6
    tiny = argparse.Namespace(**{**vars(args), **TINY, "steps": steps, "warmup": 0,
                                 "lr": 3e-3, "runs": ["sdpa", "sdpa_alt"], "period": None})
    records, comps = run_experiment(tiny, "cpu")
    print_summary(records, comps)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the records and criterion.")
    ap.add_argument("--quick", action="store_true", help="30 steps (unless --steps)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 300)")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS,
                    help="runs, in order (sdpa is the reference of the comparison)")
    ap.add_argument("--precision", choices=["bf16", "autocast"], default="bf16",
                    help="bf16: bf16 model, fp32 master weights and AdamW states (default); "
                         "autocast: fp32 model under torch.autocast(bfloat16)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=1024)
    for k, v in MODEL.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    ap.add_argument("--period", type=int, default=None,
                    help="tokens per Markov walk, repeated to seqlen (default seqlen / 2)")
    ap.add_argument("--successors", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--ma-window", type=int, default=10)
    ap.add_argument("--tol", type=float, default=0.02)
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="auto: CUDA if torch sees a GPU, else the no-GPU smoke run")
    ap.add_argument("--out", type=Path, default=RESULTS / "train_llama.jsonl")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 30 if args.quick else 300
    if args.steps < 1 or args.batch < 1 or args.seqlen < 2:
        ap.error("--steps, --batch: expected >= 1; --seqlen: expected >= 2")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads}: expected a multiple of --kv-heads {args.kv_heads}")
    if args.seqlen > args.max_positions:
        ap.error(f"--seqlen {args.seqlen} exceeds --max-positions {args.max_positions}")
    args.warmup = min(args.warmup, args.steps // 5)
    device = args.device
    if device == "auto":
        try:
            import torch
            device = "cuda" if torch.cuda.is_available() else "none"
        except ImportError:
            device = "none"
    if device == "none":
        print(NO_GPU_LINE, flush=True)
        return run_cpu_smoke(args)
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"train_llama: {e}: this experiment needs transformers (pip install transformers)")
        return 1
    prov = common.provenance()
    if device == "cpu":  # trained on the host: the provenance names the code, host and torch
        prov = {k: v for k, v in prov.items()
                if k in ("commit", "dirty", "git_head", "date", "host_python", "torch")}
        prov["machine"] = "cpu"
    # each run's record is appended as the run ends: a run killed by a time limit keeps the
    # runs before it
    records, comps = run_experiment(
        args, device, on_record=lambda r: common.append_results(args.out, r, provenance=prov))
    print_summary(records, comps)
    common.append_results(args.out, comps, provenance=prov)
    print(f"\nwrote {len(records) + len(comps)} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
