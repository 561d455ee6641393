"""cupyflash.hf on the CPU: registration with transformers' attention registry, and the
plumbing of attention_forward (layouts, GQA, bottom-right causal masks in prefill and in decode
steps against the cache, scaling, which cupyflash call each phase uses), padded batches (the
mask -> gathers / cu_seqlens logic, left / right padding and holes, generate() against SDPA),
packed sequences (position_ids restarts, cu_seq_lens kwargs), training through the gathers, and
the error messages; in small Llama / Qwen2 models built from configs, with the cupyflash calls
replaced by a float64 torch reference of the same semantics that leaves the rows outside every
sequence NaN (as the kernels leave them unwritten). ``tests/gpu/test_hf_gpu.py`` and
``tests/gpu/test_torch_gpu.py`` run the real kernels."""
import copy
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cupyflash import hf  # noqa: E402


def _reference_attention(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """(batch, seqlen, heads, d) attention, float64, masks aligned bottom-right; rows that see
    no key give 0 (as the kernels)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if sk == 0:
        return torch.zeros_like(q)
    g = h // hk
    kk = k.repeat_interleave(g, dim=2).double()
    vv = v.repeat_interleave(g, dim=2).double()
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(d)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), kk) * scale
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    left, right = window_size
    if causal:
        right = 0
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        mask &= j <= i + right
    if left >= 0:
        mask &= j >= i - left
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).masked_fill(~mask.any(-1)[:, None], 0.0)  # no visible key: 0
    return torch.einsum("bhij,bjhd->bihd", p, vv).to(q.dtype)


class _FakeOps:
    """Stands in for cupyflash.torch_ops: records which call each phase makes; checks the
    varlen metadata the kernels would trust (validate=False)."""

    def __init__(self):
        self.calls = []
        self.deterministic = []  # the flag of each prefill / varlen call, in order

    def flash_attn_func(self, q, k, v, *, softmax_scale=None, causal=False,
                        window_size=(-1, -1), deterministic=False):
        self.calls.append(("prefill", q.shape[1], k.shape[1]))
        self.deterministic.append(deterministic)
        return _reference_attention(q, k, v, softmax_scale, causal, window_size)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, *, cache_seqlens=None,
                                softmax_scale=None, causal=True, workspace=None):
        self.calls.append(("decode", q.shape[1], k_cache.shape[1]))
        if cache_seqlens is None:
            return _reference_attention(q, k_cache, v_cache, softmax_scale, causal)
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
        rows = []
        for b, n in enumerate(cache_seqlens.tolist()):
            assert 0 <= n <= k_cache.shape[1]
            rows.append(_reference_attention(q[b:b + 1], k_cache[b:b + 1, :n],
                                             v_cache[b:b + 1, :n], softmax_scale, causal))
        return torch.cat(rows)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, *, softmax_scale=None, causal=False,
                               window_size=(-1, -1), validate=True, deterministic=False):
        self.calls.append(("varlen", q.shape[0], k.shape[0], cu_seqlens_q.shape[0] - 1))
        self.deterministic.append(deterministic)
        assert q.dim() == 3 and k.dim() == 3 and v.shape == k.shape
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert cu_seqlens_q.shape == cu_seqlens_k.shape
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert cq[0] == ck[0] == 0 and cq[-1] <= q.shape[0] and ck[-1] <= k.shape[0]
        pieces = []
        for s in range(len(cq) - 1):
            lq, lk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
            assert 0 <= lq <= max_seqlen_q and 0 <= lk <= max_seqlen_k, (s, lq, lk)
            if lq:
                pieces.append(_reference_attention(
                    q[None, cq[s]:cq[s + 1]], k[None, ck[s]:ck[s + 1]], v[None, ck[s]:ck[s + 1]],
                    softmax_scale, causal, window_size)[0])
        tail = q.shape[0] - cq[-1]  # rows of no sequence: never written by the kernel
        pieces.append(torch.full((tail,) + q.shape[1:], float("nan"), dtype=q.dtype))
        return torch.cat(pieces)


@pytest.fixture
def fake(monkeypatch):
    f = _FakeOps()
    monkeypatch.setattr(hf, "torch_ops", f)
    monkeypatch.setattr(hf, "_DECODE_DTYPES", (torch.float32, torch.float64))
    monkeypatch.setattr(hf, "_MEMO", [])
    hf.register()
    return f


def _model(attn, kind="llama", seed=0):
    if kind == "llama":
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model
        cfg = Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256)
    else:  # Qwen2 with a sliding window on its second layer
        from transformers import Qwen2Config as Config
        from transformers import Qwen2ForCausalLM as Model
        cfg = Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                     max_position_embeddings=256, use_sliding_window=True, sliding_window=5,
                     max_window_layers=1)
    torch.manual_seed(seed)
    return Model._from_config(copy.deepcopy(cfg), attn_implementation=attn).eval()


def _pair(kind="llama"):
    ours, ref = _model("cupyfa", kind), _model("sdpa", kind)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _padded_batch(lengths, total, left=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), total, dtype=torch.long)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for b, n in enumerate(lengths):
        sl = slice(total - n, total) if left else slice(0, n)
        ids[b, sl] = torch.randint(1, 128, (n,), generator=g)
        mask[b, sl] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------------
# registration, equal lengths (unchanged path)
# ----------------------------------------------------------------------------------------------
def test_register_adds_the_implementation():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert hf.register() == "cupyfa"
    assert AttentionInterface._global_mapping["cupyfa"] is hf.attention_forward
    assert "cupyfa" in AttentionMaskInterface._global_mapping
    assert hf.register("cupy_attention") == "cupy_attention"
    with pytest.raises(ValueError, match="contains 'flash'"):
        hf.register("cupyflash")


def test_generate_matches_sdpa_with_the_reference_in_place(fake):
    """Greedy generate() with attn_implementation="cupyfa" (float64 reference in place of the
    kernels) gives SDPA's tokens, and its per-step logits equal a teacher-forced SDPA forward
    over the generated sequence: prefill ran the prefill call with all keys, each decode step
    the decode call with one query against the grown cache."""
    ours, ref = _pair()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
              output_logits=True, pad_token_id=0)
    with torch.no_grad():
        g = ours.generate(ids, **kw)
        g_ref = ref.generate(ids, **kw)
        full = ref(g.sequences).logits
    assert torch.equal(g.sequences, g_ref.sequences)
    for step, logits in enumerate(g.logits):
        assert torch.allclose(logits, full[:, 11 + step], atol=1e-4, rtol=1e-4), step
    assert fake.calls[0] == ("prefill", 12, 12)
    decodes = [c for c in fake.calls if c[0] == "decode"]
    assert len(decodes) == 2 * 5 and decodes[-1] == ("decode", 1, 17)  # 2 layers x 5 steps
    assert not [c for c in fake.calls if c[0] == "varlen"]


# ----------------------------------------------------------------------------------------------
# the padding plan: mask -> gathers and cu_seqlens, on the device, no host reads
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_len", [6, 2, 1])
def test_padding_plan(q_len):
    rows = [[0, 0, 1, 1, 1, 1],   # left padding
            [1, 1, 1, 0, 0, 0],   # right padding
            [1, 0, 1, 1, 0, 1],   # holes
            [1, 1, 1, 1, 1, 1],   # none
            [0, 0, 0, 0, 0, 0]]   # all padding
    mask = torch.tensor(rows, dtype=torch.bool)
    plan = hf.padding_plan(mask, q_len)
    kv_len = mask.shape[1]
    exp_cu_q, exp_cu_k = [0], [0]
    for b, r in enumerate(rows):
        real = [j for j in range(kv_len) if r[j]]
        pads = [j for j in range(kv_len) if not r[j]]
        assert plan.k_src[b].tolist() == real + pads
        assert plan.k_src[b][plan.k_dest[b]].tolist() == list(range(kv_len))
        rq = r[kv_len - q_len:]
        real_q = [j for j in range(q_len) if rq[j]]
        assert plan.q_src[b].tolist() == real_q + [j for j in range(q_len) if not rq[j]]
        assert plan.q_src[b][plan.q_dest[b]].tolist() == list(range(q_len))
        m, n = len(real_q), len(real)
        for lq, lk in ((m, n), (q_len - m, 0), (0, kv_len - n)):
            exp_cu_q.append(exp_cu_q[-1] + lq)
            exp_cu_k.append(exp_cu_k[-1] + lk)
    assert plan.k_lens.dtype == torch.int32 and plan.k_lens.tolist() == [4, 3, 4, 6, 0]
    assert plan.cu_seqlens_q.dtype == plan.cu_seqlens_k.dtype == torch.int32
    assert plan.cu_seqlens_q.tolist() == exp_cu_q and exp_cu_q[-1] == 5 * q_len
    assert plan.cu_seqlens_k.tolist() == exp_cu_k and exp_cu_k[-1] == 5 * kv_len
    with pytest.raises(ValueError, match="q_len"):
        hf.padding_plan(mask, 7)
    with pytest.raises(ValueError, match="bool"):
        hf.padding_plan(mask.long(), 1)


def _inputs(b, h, hk, q_len, kv_len, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, q_len, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, kv_len, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, kv_len, d, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("q_len,window", [(7, None), (7, 3), (3, None), (1, None), (1, 3)])
def test_padded_attention_equals_attention_on_the_real_tokens(fake, q_len, window):
    """Each row's real queries attend its real keys only (causal / window bottom-right on the
    real tokens); NaN in every padded key and value reaches no output; padded query rows are 0.
    Prefill and chunks run varlen; a decode step the decode call with per-row lengths (varlen
    with a window)."""
    masks = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 0, 1, 1],
                          [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    q, k, v = _inputs(4, 4, 2, q_len, 7)
    k = k.masked_fill(~masks[:, None, :, None], float("nan"))
    v = v.masked_fill(~masks[:, None, :, None], float("nan"))
    out, w = hf.attention_forward(None, q, k, v, masks, scaling=0.3, sliding_window=window)
    assert w is None and out.shape == (4, q_len, 4, 16)
    qm = masks[:, 7 - q_len:]
    for b in range(4):
        kr, vr = k[b][:, masks[b]].transpose(0, 1), v[b][:, masks[b]].transpose(0, 1)
        qr = q[b][:, qm[b]].transpose(0, 1)
        win = (-1, -1) if window is None else (window - 1, 0)
        ref = _reference_attention(qr[None], kr[None], vr[None], 0.3, True, win)[0]
        assert torch.allclose(out[b][qm[b]], ref, atol=1e-12), b
        assert (out[b][~qm[b]] == 0).all()
    kinds = {c[0] for c in fake.calls}
    assert kinds == ({"decode"} if q_len == 1 and window is None else {"varlen"}), fake.calls


def test_padded_attention_static_cache_and_mask_forms(fake):
    """A mask shorter than the keys (a static cache: slots past it unused, here NaN), an integer
    mask, a longer mask (its last kv_len columns) and GQA 4."""
    q, k, v = _inputs(2, 4, 1, 1, 9, seed=3)
    k[:, :, 6:] = float("nan")
    v[:, :, 6:] = float("nan")
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    out, _ = hf.attention_forward(None, q, k, v, mask)
    for b, first in enumerate((1, 0)):
        ref = _reference_attention(q[b:b + 1].transpose(1, 2), k[b:b + 1, :, first:6].transpose(1, 2),
                                   v[b:b + 1, :, first:6].transpose(1, 2), None, True)
        assert torch.allclose(out[b:b + 1], ref, atol=1e-12)
    q, k, v = _inputs(2, 4, 1, 4, 4, seed=4)
    longer = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    out_long, _ = hf.attention_forward(None, q, k, v, longer)
    out_cut, _ = hf.attention_forward(None, q, k, v, longer[:, 2:])
    assert torch.equal(out_long, out_cut)


def test_padded_gradients_flow_only_through_real_tokens(fake):
    """The gathers are differentiable: gradients equal those of attention on the real tokens
    alone, are 0 at padded positions and finite everywhere."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    q, k, v = (x.requires_grad_() for x in _inputs(2, 2, 1, 5, 5, seed=5))
    out, _ = hf.attention_forward(None, q, k, v, mask)
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(0))
    (out * w).sum().backward()
    for b in range(2):
        qr, kr, vr = (x.detach()[b][:, mask[b]].transpose(0, 1)[None].requires_grad_()
                      for x in (q, k, v))
        ref = _reference_attention(qr, kr, vr, None, True)
        (ref * w[b][mask[b]][None]).sum().backward()
        for x, xr in ((q, qr), (k, kr), (v, vr)):
            g = x.grad[b].transpose(0, 1)
            assert torch.allclose(g[mask[b]], xr.grad[0], atol=1e-12)
            assert (g[~mask[b]] == 0).all()


def test_plan_is_computed_once_per_mask_tensor(fake, monkeypatch):
    """The layers of a forward share the plan of the mask tensor they all receive; an in-place
    write to the mask (a new version) or another tensor makes a new one."""
    built = []
    real = hf.padding_plan
    monkeypatch.setattr(hf, "padding_plan", lambda m, n: built.append(1) or real(m, n))
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    q, k, v = _inputs(2, 2, 2, 3, 3)
    for _ in range(3):
        hf.attention_forward(None, q, k, v, mask)
    assert len(built) == 1
    mask[1, 0] = False
    hf.attention_forward(None, q, k, v, mask)
    hf.attention_forward(None, q, k, v, mask.clone())
    assert len(built) == 3


# ----------------------------------------------------------------------------------------------
# whole models: padded generate(), packed forwards, training steps against SDPA
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_left_padded_generate_matches_sdpa(fake, kind):
    """generate() on a left-padded batch of mixed prompt lengths: SDPA's greedy tokens, and
    per-step logits equal to a teacher-forced SDPA forward over the padded sequences; prefill
    ran varlen, the decode steps the decode call (the Qwen2 sliding-window layer: varlen while
    its window of the cache holds padding, then the dense call: its mask is None)."""
    ours, ref = _pair(kind)
    ids, mask = _padded_batch([9, 3, 6], 9)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
              output_logits=True, pad_token_id=0)
    with torch.no_grad():
        g = ours.generate(ids, attention_mask=mask, **kw)
        g_ref = ref.generate(ids, attention_mask=mask, **kw)
        full_mask = torch.cat([mask, torch.ones(3, 4, dtype=mask.dtype)], 1)
        pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
        full = ref(g.sequences[:, :-1], attention_mask=full_mask, position_ids=pos).logits
    assert torch.equal(g.sequences, g_ref.sequences)
    for step, logits in enumerate(g.logits):
        assert torch.allclose(logits, full[:, 8 + step], atol=1e-4, rtol=1e-4), step
    kinds = [c[0] for c in fake.calls]
    assert kinds[:2] == ["varlen", "varlen"]
    assert kinds.count("decode") == (2 if kind == "llama" else 1) * 4
    assert ("prefill" in kinds) == (kind == "qwen2")


def test_right_padded_forward_matches_sdpa(fake):
    ours, ref = _pair()
    ids, mask = _padded_batch([8, 5, 2], 8, left=False)
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        r = ref(ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.isfinite(a).all()
    assert torch.allclose(a[real], r[real], atol=1e-4, rtol=1e-4)


def _docs(lengths, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return ids, pos, cu


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_forward_equals_the_documents_alone(fake, kind):
    """One row of three documents, marked by position_ids restarts or by cu_seq_lens kwargs:
    each document's logits equal an SDPA forward of that document alone."""
    ours, ref = _pair(kind)
    lengths = [5, 8, 3]
    ids, pos, cu = _docs(lengths)
    with torch.no_grad():
        by_pos = ours(ids, position_ids=pos).logits
        by_cu = ours(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                     max_length_q=8, max_length_k=8).logits
        alone = torch.cat([ref(ids[:, s:e]).logits
                           for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    assert torch.allclose(by_pos, alone, atol=1e-4, rtol=1e-4)
    assert torch.allclose(by_cu, alone, atol=1e-4, rtol=1e-4)
    varlen = [c for c in fake.calls if c[0] == "varlen"]
    assert len(varlen) == 4 and all(c[3] == 3 for c in varlen)  # 2 forwards x 2 layers


def test_position_ids_without_restarts_keep_the_dense_path(fake):
    ours, _ = _pair()
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours(ids, position_ids=torch.arange(6).expand(2, 6))
        ours(ids)
    assert {c[0] for c in fake.calls} == {"prefill"}


def test_deterministic_backward_follows_torch_the_environment_and_the_keyword(fake, monkeypatch):
    """The layers' backward is deterministic under torch.use_deterministic_algorithms(True) or
    FLASH_ATTENTION_DETERMINISTIC=1, a ``deterministic`` keyword overriding both; on every
    path (dense, padded, packed)."""
    ours, _ = _pair()
    ids, mask = _padded_batch([6, 4], 6)
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)

    def flags(**kw):
        fake.deterministic.clear()
        with torch.no_grad():
            ours(ids)                                                   # dense
            ours(ids, attention_mask=mask)                              # padded
            ours(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]] * 2))  # packed
        assert len(fake.deterministic) == 3 * len(ours.model.layers)
        return set(fake.deterministic)

    assert flags() == {False}
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert flags() == {True}
        assert hf.deterministic_backward(False) is False
    finally:
        torch.use_deterministic_algorithms(was)
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    assert flags() == {True}
    assert hf.deterministic_backward(False) is False
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "0")
    assert hf.deterministic_backward(None) is False and hf.deterministic_backward(True) is True


@pytest.mark.parametrize("how", ["padded", "packed"])
def test_training_step_gradients_match_sdpa(fake, how):
    """A loss over a padded batch (labels -100 at the padding) or a packed row: every
    parameter's gradient equals SDPA's (the packed reference: the documents one by one)."""
    ours, ref = _pair()
    ours.train()
    ref.train()
    if how == "padded":
        ids, mask = _padded_batch([7, 4, 2], 7)
        labels = ids.masked_fill(mask == 0, -100)
        ours(ids, attention_mask=mask, labels=labels).loss.backward()
        ref(ids, attention_mask=mask, labels=labels).loss.backward()
    else:
        ids, pos, cu = _docs([4, 6, 3])
        labels = ids.clone()
        labels[0, cu[1:-1].long()] = -100  # no loss across a document boundary
        ours(ids, position_ids=pos, labels=labels).loss.backward()
        # (transformers' masks look for packing only without a cache)
        ref(ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert torch.allclose(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4), name


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------
def test_unsupported_inputs_say_so(fake):
    q = torch.zeros(1, 4, 3, 64)
    with pytest.raises(NotImplementedError, match="2-D"):
        hf.attention_forward(None, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout"):
        hf.attention_forward(None, q, q, q, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="soft-capping"):
        hf.attention_forward(None, q, q, q, None, softcap=30.0)
    with pytest.raises(ValueError, match="attention_mask: batch 2"):
        hf.attention_forward(None, q, q, q, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="3 queries but only 2"):
        hf.attention_forward(None, q, q[:, :, :2], q[:, :, :2], torch.ones(1, 2, dtype=torch.bool))
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="pass both"):
        hf.attention_forward(None, q, q, q, None, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="not together with a padding attention_mask"):
        hf.attention_forward(None, q, q, q, torch.ones(1, 3), cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(TypeError, match="cu_seq_lens_q: expected an integer tensor"):
        hf.attention_forward(None, q, q, q, None, cu_seq_lens_q=cu.float(), cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match="cu_seq_lens_k: 2 entries"):
        hf.attention_forward(None, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu[1:])
    with pytest.raises(TypeError, match="max_length_q: expected an int"):
        hf.attention_forward(None, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                             max_length_q=2.0, max_length_k=2)
    with pytest.raises(ValueError, match="max_length_k: expected a positive int"):
        hf.attention_forward(None, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                             max_length_q=2, max_length_k=0)
    # max lengths given as tensors or missing are read from cu_seqlens
    out, _ = hf.attention_forward(None, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert out.shape == (1, 3, 4, 64) and fake.calls[-1] == ("varlen", 3, 3, 2)
