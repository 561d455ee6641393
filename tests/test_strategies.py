"""The public strategies of :mod:`cupyflash.testing` check their arguments when they are built.

A wrong argument raises TypeError (wrong type) or ValueError (out of range) at once, the message
starting with the argument's name, instead of being accepted silently (``dtypes=('int8',)``) or
failing later inside Hypothesis without naming it.
"""
import numpy as np
import pytest
from hypothesis import find

from cupyflash import testing as T

BAD = {
    # dtypes
    "dtypes int8": (lambda: T.attention_cases(dtypes=("int8",)), ValueError, "dtypes"),
    "dtypes a string": (lambda: T.attention_cases(dtypes="float16"), TypeError, "dtypes"),
    "dtypes empty": (lambda: T.varlen_cases(dtypes=()), ValueError, "dtypes"),
    "dtypes unknown name": (lambda: T.kvcache_cases(dtypes=("half",)), ValueError, "dtypes"),
    "dtypes not iterable": (lambda: T.magnitude_cases(dtypes=3), TypeError, "dtypes"),
    "dtypes() int8": (lambda: T.dtypes(("float32", "int8")), ValueError, "names"),
    # basic strategies
    "headdims above 256": (lambda: T.headdims(512), ValueError, "max_value"),
    "headdims none in range": (lambda: T.headdims(60, 57), ValueError, "max_value"),
    "headdims min > max": (lambda: T.headdims(16, 32), ValueError, "min_value"),
    "headdims negative min": (lambda: T.headdims(16, -8), ValueError, "min_value"),
    "headdims float": (lambda: T.headdims(64.0), TypeError, "max_value"),
    "head_counts 0 kv heads": (lambda: T.head_counts(0), ValueError, "max_nheads_k"),
    "head_counts group bool": (lambda: T.head_counts(2, True), TypeError, "max_group"),
    "seqlens negative": (lambda: T.seqlens(-1), ValueError, "max_value"),
    "seqlens min > max": (lambda: T.seqlens(4, 8), ValueError, "min_value"),
    "seqlens block 0": (lambda: T.seqlens(64, 0, (16, 0)), ValueError, "block_sizes[1]"),
    "seqlens blocks a string": (lambda: T.seqlens(64, 0, "16"), TypeError, "block_sizes"),
    "window_sizes negative": (lambda: T.window_sizes(-2), ValueError, "max_value"),
    "segment_lengths min > max": (lambda: T.segment_lengths(2, 8, 3), ValueError, "min_batch"),
    "segment_lengths negative len": (lambda: T.segment_lengths(max_len=-1), ValueError,
                                     "max_len"),
    # attention_cases
    "attention batch 0": (lambda: T.attention_cases(max_batch=0), ValueError, "max_batch"),
    "attention seqlen negative": (lambda: T.attention_cases(max_seqlen_q=-4), ValueError,
                                  "max_seqlen_q"),
    "attention min_seqlen > max": (lambda: T.attention_cases(min_seqlen=10, max_seqlen_k=5),
                                   ValueError, "min_seqlen"),
    "attention headdim 12": (lambda: T.attention_cases(max_headdim=4), ValueError,
                             "max_headdim"),
    "attention headdim 512": (lambda: T.attention_cases(max_headdim=512), ValueError,
                              "max_headdim"),
    "attention group 0": (lambda: T.attention_cases(max_group=0), ValueError, "max_group"),
    "attention causal int": (lambda: T.attention_cases(causal=1), TypeError, "causal"),
    "attention windows None": (lambda: T.attention_cases(windows=None), TypeError, "windows"),
    "attention scale 0": (lambda: T.attention_cases(scale=0.0), ValueError, "scale"),
    "attention scale nan": (lambda: T.attention_cases(scale=float("nan")), ValueError, "scale"),
    "attention scale str": (lambda: T.attention_cases(scale="1"), TypeError, "scale"),
    # varlen_cases
    "varlen batch 0": (lambda: T.varlen_cases(max_batch=0), ValueError, "max_batch"),
    "varlen len negative": (lambda: T.varlen_cases(max_len=-1), ValueError, "max_len"),
    "varlen nheads_k float": (lambda: T.varlen_cases(max_nheads_k=2.5), TypeError,
                              "max_nheads_k"),
    # kvcache_cases
    "kvcache paged str": (lambda: T.kvcache_cases(paged="yes"), TypeError, "paged"),
    "kvcache seqlen_q 0": (lambda: T.kvcache_cases(max_seqlen_q=0), ValueError,
                           "max_seqlen_q"),
    "kvcache new negative": (lambda: T.kvcache_cases(max_seqlen_new=-1), ValueError,
                             "max_seqlen_new"),
    "kvcache pages 0": (lambda: T.kvcache_cases(max_pages_per_seq=0), ValueError,
                        "max_pages_per_seq"),
    "kvcache page size 0": (lambda: T.kvcache_cases(page_sizes=(0, 16)), ValueError,
                            "page_sizes[0]"),
    "kvcache page sizes empty": (lambda: T.kvcache_cases(page_sizes=()), ValueError,
                                 "page_sizes"),
    "kvcache no page fits": (lambda: T.kvcache_cases(page_sizes=(256,), max_seqlen_cache=64),
                             ValueError, "page_sizes"),
    "kvcache capacity 0": (lambda: T.kvcache_cases(max_seqlen_cache=0), ValueError,
                           "max_seqlen_cache"),
    "kvcache poison None": (lambda: T.kvcache_cases(poison=None), TypeError, "poison"),
    # magnitude_cases
    "magnitude headdim 12": (lambda: T.magnitude_cases(headdims_from=(8, 12)), ValueError,
                             "headdims_from[1]"),
    "magnitude headdims empty": (lambda: T.magnitude_cases(headdims_from=()), ValueError,
                                 "headdims_from"),
    "magnitude seqlen_k 0": (lambda: T.magnitude_cases(max_seqlen_k=0), ValueError,
                             "max_seqlen_k"),
    "magnitude too large": (lambda: T.magnitude_cases(max_magnitude=1e40), ValueError,
                            "max_magnitude"),
    "magnitude too small": (lambda: T.magnitude_cases(max_magnitude=0.001), ValueError,
                            "max_magnitude"),
    # helpers
    "contiguous_to_paged page 0": (lambda: T.contiguous_to_paged(
        np.zeros((1, 4, 1, 8)), 0, np.random.default_rng(0)), ValueError, "page_size"),
    "magnitude_tolerance dtype": (lambda: T.magnitude_tolerance(
        np.zeros((1, 1, 1, 8)), np.zeros((1, 1, 1, 8)), np.zeros((1, 1, 1, 8)), "int8",
        softmax_scale=1.0), ValueError, "dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD), ids=str)
def test_bad_strategy_argument_raises_when_built(case):
    build, exc, name = BAD[case]
    with pytest.raises(exc) as info:
        build()  # building only: nothing is drawn
    assert str(info.value).startswith(name + ":"), str(info.value)


def test_good_arguments_still_draw():
    """Valid arguments in every accepted form (tuples, lists, NumPy dtypes and ints) build and
    draw what they promise."""
    c = find(T.attention_cases(dtypes=[np.float32], max_batch=np.int64(1), max_headdim=8,
                               causal=True, windows=False), lambda c: True)
    assert c.q.dtype == np.float32 and c.q.shape[0] == 1 and c.q.shape[-1] == 8 and c.causal
    assert find(T.dtypes(), lambda d: d == "bfloat16") == "bfloat16"
    assert find(T.headdims(64, 57), lambda d: True) == 64
    assert find(T.seqlens(5, 5, ()), lambda n: True) == 5
    c = find(T.kvcache_cases(paged=True, page_sizes=[64], max_seqlen_cache=64),
             lambda c: True)
    assert c.page_size == 64
    c = find(T.magnitude_cases(headdims_from=[16], max_magnitude=0.01), lambda c: True)
    assert c.q.shape[-1] == 16
    assert find(T.varlen_cases(max_len=0), lambda c: True).q.shape[0] == 0
    assert find(T.segment_lengths(0, 3, 0), lambda x: True) == []
