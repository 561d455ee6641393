"""Host <-> device copies for the GPU tests that keep every bit (NaN payloads of fp16/bf16 too)."""
import cupy
import numpy as np


def to_device(x):
    """Host array -> CuPy array of the same dtype; 16-bit floats travel as their bits."""
    if x is None:
        return None
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize == 2 and x.dtype != np.int16:  # fp16/bf16 bits, NaN payloads kept
        return cupy.asarray(x.view(np.uint16)).view(x.dtype)
    return cupy.asarray(x)


def to_host(x):
    """CuPy array -> host array of the same dtype (16-bit floats through their bits)."""
    if x.dtype.itemsize == 2:
        return cupy.asnumpy(x.view(cupy.uint16)).view(x.dtype)
    return cupy.asnumpy(x)
