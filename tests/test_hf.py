"""cupyflash.hf on the CPU: registration with transformers' attention registry, and the
plumbing of attention_forward (layouts, GQA, bottom-right causal masks in prefill and in decode
steps against the cache, scaling, which cupyflash call each phase uses) in a small Llama built
from a config, with the cupyflash calls replaced by a float64 torch reference of the same
semantics. ``tests/gpu/test_torch_gpu.py`` runs the real kernels."""
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cupyflash import hf  # noqa: E402


def _reference_attention(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """(batch, seqlen, heads, d) attention, float64, masks aligned bottom-right."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
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
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), vv).to(q.dtype)


class _FakeOps:
    """Stands in for cupyflash.torch_ops: records which call each phase makes."""

    def __init__(self):
        self.calls = []

    def flash_attn_func(self, q, k, v, *, softmax_scale=None, causal=False,
                        window_size=(-1, -1)):
        self.calls.append(("prefill", q.shape[1], k.shape[1]))
        return _reference_attention(q, k, v, softmax_scale, causal, window_size)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, *, softmax_scale=None, causal=True):
        self.calls.append(("decode", q.shape[1], k_cache.shape[1]))
        return _reference_attention(q, k_cache, v_cache, softmax_scale, causal)


def _model(attn):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn).eval()


def test_register_adds_the_implementation():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert hf.register() == "cupyfa"
    assert AttentionInterface._global_mapping["cupyfa"] is hf.attention_forward
    assert "cupyfa" in AttentionMaskInterface._global_mapping
    assert hf.register("cupy_attention") == "cupy_attention"
    with pytest.raises(ValueError, match="contains 'flash'"):
        hf.register("cupyflash")


def test_generate_matches_sdpa_with_the_reference_in_place(monkeypatch):
    """Greedy generate() with attn_implementation="cupyfa" (float64 reference in place of the
    kernels) gives SDPA's tokens, and its per-step logits equal a teacher-forced SDPA forward
    over the generated sequence: prefill ran the prefill call with all keys, each decode step
    the decode call with one query against the grown cache."""
    fake = _FakeOps()
    monkeypatch.setattr(hf, "torch_ops", fake)
    monkeypatch.setattr(hf, "_DECODE_DTYPES", (torch.float32,))
    hf.register()
    ours, ref = _model("cupyfa"), _model("sdpa")
    ref.load_state_dict(ours.state_dict())
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


def test_unsupported_inputs_say_so():
    q = torch.zeros(1, 4, 3, 64)
    with pytest.raises(NotImplementedError, match="padded batches"):
        hf.attention_forward(None, q, q, q, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout"):
        hf.attention_forward(None, q, q, q, None, dropout=0.1)
