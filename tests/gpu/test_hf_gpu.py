"""cupyflash.hf on a GPU (issue 36): padded batches (left padding, mixed prompt lengths) in
generate(), packed rows (position_ids restarts, cu_seq_lens kwargs), padded and packed training
steps, against SDPA, in small Llama and Qwen2 (GQA, a sliding-window layer) decoders built from
configs (random weights, no download); a padded decode step and a padded prefill captured in a
CUDA graph replay with new masks and contents (no host synchronisation on the padded path).

Tolerances follow tests/gpu/test_torch_gpu.py's HF test: bf16 results are compared with a
float32 SDPA model and must be within 2x SDPA's own bf16 error plus 2 bf16 ulp of the scale.

Run: ``python -m pytest -q -m gpu tests/gpu/test_hf_gpu.py``.
"""

import pytest

pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cupyflash import hf  # noqa: E402
from hf_models import same_weight_models  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_guard_records")]

if not torch.cuda.is_available():  # CuPy may see a GPU that this torch build cannot use
    pytest.skip("torch without CUDA", allow_module_level=True)

EPS = 2.0 ** -8  # bfloat16
VOCAB = 1024




def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _config(kind):
    if kind == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=512)  # head_dim 64, GQA 4
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=512, use_sliding_window=True, sliding_window=32,
                       max_window_layers=1)  # layer 1: a 32-token sliding window


def _models(kind, train=False):
    """ours (cupyflash, bf16), sdpa (bf16), fp32 (SDPA, float32), the same weights."""
    return same_weight_models(_config(kind), hf.register(), train)


def _left_padded(lengths, seed=1):
    g = torch.Generator(device=_dev()).manual_seed(seed)
    total = max(lengths)
    ids = torch.zeros(len(lengths), total, dtype=torch.long, device=_dev())
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, total - n:] = torch.randint(1, VOCAB, (n,), generator=g, device=_dev())
        mask[b, total - n:] = 1
    return ids, mask


def _check(ours, sdpa, fp32, what):
    scale = fp32.abs().max().item()
    err = (ours.float() - fp32).abs().max().item()
    err_sdpa = (sdpa.float() - fp32).abs().max().item()
    assert err <= 2 * err_sdpa + 2 * EPS * scale, (what, err, err_sdpa, scale)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_left_padded_generate_matches_sdpa(kind):
    """generate() on 4 left-padded prompts of 64, 17, 40 and 5 tokens, 24 new tokens: each
    step's logits (the prefill's and every decode step's) against a float32 SDPA forward over
    the sequence generated so far (with its mask), each token the argmax of its step's logits;
    a plain padded forward over the same sequences likewise at every real position."""
    models = _models(kind)
    ids, mask = _left_padded([64, 17, 40, 5])
    new = 24
    models["ours"].generation_config.eos_token_id = None  # no early stop: argmax every step
    with torch.no_grad():
        g = models["ours"].generate(ids, attention_mask=mask, max_new_tokens=new,
                                    do_sample=False, pad_token_id=0,
                                    return_dict_in_generate=True, output_logits=True)
        seq = g.sequences[:, :-1]
        full_mask = torch.cat([mask, torch.ones_like(mask[:, :new - 1])], 1)
        pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
        fp32 = models["fp32"](seq, attention_mask=full_mask, position_ids=pos).logits.float()
        sdpa = models["sdpa"](seq, attention_mask=full_mask, position_ids=pos).logits.float()
        ours_fwd = models["ours"](seq, attention_mask=full_mask, position_ids=pos).logits
    assert len(g.logits) == new
    for step, logits in enumerate(g.logits):  # step 0: prefill; then one decode step each
        p = 63 + step
        _check(logits, sdpa[:, p], fp32[:, p], f"step {step}")
        assert torch.equal(g.sequences[:, 64 + step], logits.argmax(-1)), step
    real = full_mask.bool()
    _check(ours_fwd[real], sdpa[real], fp32[real], "padded forward")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_forward_equals_the_documents_alone(kind):
    """One row of four documents (position_ids restarts, then cu_seq_lens kwargs): the logits
    of each document as float32 SDPA gives for the document alone."""
    models = _models(kind)
    lengths = [100, 7, 64, 33]
    g = torch.Generator(device=_dev()).manual_seed(3)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=g, device=_dev())
    pos = torch.cat([torch.arange(n, device=_dev()) for n in lengths])[None]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                      device=_dev())
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    with torch.no_grad():
        by_pos = models["ours"](ids, position_ids=pos).logits
        by_cu = models["ours"](ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                               max_length_q=max(lengths), max_length_k=max(lengths)).logits
        fp32 = torch.cat([models["fp32"](ids[:, s:e]).logits for s, e in bounds], 1).float()
        sdpa = torch.cat([models["sdpa"](ids[:, s:e]).logits for s, e in bounds], 1).float()
    _check(by_pos, sdpa, fp32, "position_ids")
    _check(by_cu, sdpa, fp32, "cu_seq_lens")


def _grad_errors(models, run):
    """Per parameter: the relative L2 error of ours' and SDPA's bf16 gradients against float32."""
    for m in models.values():
        m.zero_grad(set_to_none=True)
        run(m).loss.backward()
    out = []
    for (name, p), p_sdpa, p32 in zip(models["ours"].named_parameters(),
                                      models["sdpa"].parameters(), models["fp32"].parameters()):
        g32 = p32.grad.float()
        norm = g32.norm().item() + 1e-30
        out.append((name, (p.grad.float() - g32).norm().item() / norm,
                    (p_sdpa.grad.float() - g32).norm().item() / norm))
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("how", ["padded", "packed"])
def test_training_step_gradients_match_sdpa(kind, how):
    """One loss.backward() on a left-padded batch (labels -100 at the padding) or on a packed
    row (SDPA: the same row, transformers' packed-sequence mask, use_cache=False): every
    parameter gradient is finite and as close to float32's as SDPA's bf16 gradient is."""
    models = _models(kind, train=True)
    if how == "padded":
        ids, mask = _left_padded([96, 30, 61, 9], seed=4)
        labels = ids.masked_fill(mask == 0, -100)

        def run(m):
            return m(ids, attention_mask=mask, labels=labels)
    else:
        lengths = [50, 13, 70, 27]
        g = torch.Generator(device=_dev()).manual_seed(5)
        ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=g, device=_dev())
        pos = torch.cat([torch.arange(n, device=_dev()) for n in lengths])[None]
        labels = ids.clone()
        labels[0, torch.tensor(lengths[:-1]).cumsum(0).to(_dev())] = -100

        def run(m):
            return m(ids, position_ids=pos, labels=labels, use_cache=False)
    for name, err, err_sdpa in _grad_errors(models, run):
        assert err == err and err <= 2 * err_sdpa + 4 * EPS, (name, err, err_sdpa)


def _attention_inputs(b=4, h=8, hk=2, q_len=1, kv_len=300, d=128, seed=0):
    g = torch.Generator(device=_dev()).manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device=_dev()).to(torch.bfloat16)
    return r(b, h, q_len, d), r(b, hk, kv_len, d), r(b, hk, kv_len, d)


def _mask(lengths, kv_len, left=True):
    m = torch.zeros(len(lengths), kv_len, dtype=torch.bool, device=_dev())
    for b, n in enumerate(lengths):
        if left:
            m[b, kv_len - n:] = True
        else:
            m[b, :n] = True
    return m


def _reference(q, k, v, mask, window=None):
    """float32 SDPA per row on its real tokens (bottom-right causal), padded query rows 0."""
    b, h, q_len, d = q.shape
    out = torch.zeros(b, q_len, h, d, device=q.device)
    qm = mask[:, mask.shape[1] - q_len:]
    for i in range(b):
        qr, kr, vr = q[i][:, qm[i]].float(), k[i][:, mask[i]].float(), v[i][:, mask[i]].float()
        kr = kr.repeat_interleave(h // k.shape[1], 0)
        vr = vr.repeat_interleave(h // k.shape[1], 0)
        nq, nk = qr.shape[1], kr.shape[1]
        row = torch.arange(nq, device=q.device)[:, None] + nk - nq
        col = torch.arange(nk, device=q.device)[None]
        allowed = col <= row
        if window is not None:
            allowed &= col > row - window
        o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=allowed)
        out[i][qm[i]] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("decode", ["kvcache", "varlen"])
@pytest.mark.parametrize("q_len,window", [(1, None), (1, 64), (300, None), (300, 64)])
def test_padded_attention_against_sdpa(monkeypatch, decode, q_len, window):
    """attention_forward on left-, right- and unpadded rows, prefill and decode, both decode
    kernels, with and without a window: each row's real tokens as float32 SDPA on those alone,
    padded query rows 0."""
    monkeypatch.setattr(hf, "DECODE", decode)
    q, k, v = _attention_inputs(q_len=q_len)
    mask = torch.cat([_mask([300, 17], 300), _mask([1, 250], 300, left=False)])
    out, _ = hf.attention_forward(None, q, k, v, mask, sliding_window=window)
    ref = _reference(q, k, v, mask, window)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() <= 4 * EPS * ref.abs().max().item()


def _capture(fn):
    """fn() warmed up on a side stream, then captured; returns (graph, its output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("q_len", [1, 300])
def test_padded_step_captured_in_a_cuda_graph(q_len):
    """A padded decode step (split-KV kernel, per-row lengths from the mask) and a padded
    prefill (varlen) are captured by torch.cuda.graph (a host synchronisation would make the
    capture fail) and replay with new masks and new q, k, v: the eager result each time."""
    q, k, v = _attention_inputs(q_len=q_len, seed=1)
    mask = _mask([300, 17, 120, 1], 300)
    graph, out = _capture(lambda: hf.attention_forward(None, q, k, v, mask)[0])
    for seed, lengths in ((2, [5, 300, 64, 299]), (3, [1, 2, 3, 4])):
        q2, k2, v2 = _attention_inputs(q_len=q_len, seed=seed)
        for x, y in ((q, q2), (k, k2), (v, v2)):
            x.copy_(y)
        mask.copy_(_mask(lengths, 300))
        graph.replay()
        torch.cuda.synchronize()
        eager, _ = hf.attention_forward(None, q, k, v, mask)
        scale = eager.float().abs().max().item()
        assert (out.float() - eager.float()).abs().max().item() <= EPS * scale, lengths


def test_padded_forward_needs_no_torch_synchronisation():
    """With torch's sync debug mode set to "error", the padded prefill and decode paths (after
    a warm-up call) run no synchronising torch operation (.item(), nonzero, host copies)."""
    for q_len in (1, 300):
        q, k, v = _attention_inputs(q_len=q_len, seed=6)
        mask = _mask([300, 17, 120, 1], 300)
        hf.attention_forward(None, q, k, v, mask)
        torch.cuda.set_sync_debug_mode("error")
        try:
            hf.attention_forward(None, q, k, v, mask.clone())
        finally:
            torch.cuda.set_sync_debug_mode("default")
