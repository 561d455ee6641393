"""The optional dependencies, imported where a call needs them, with an error that says what to
install.

``pip install cupyflash`` installs NumPy only: the reference (:mod:`cupyflash.reference`), the
I/O model and the checks work with it. Everything that compiles or launches a kernel needs CuPy
(``cupy-cuda13x`` or ``cupy-cuda12x``) and the NVRTC library (``nvidia-cuda-nvrtc``);
``explain()`` too, since it compiles the kernel for its ptxas report. bfloat16 host arrays need
``ml_dtypes``. The extras ``cuda13`` and ``cuda12`` install all of them; ``cupyflash.testing``
needs ``hypothesis``.

Each function here imports its module once and returns it, or raises :class:`MissingDependency`
(an ``ImportError``; ``.name`` is the module) naming the package that provides it and the pip
command that installs it, with the original error chained.
"""
from __future__ import annotations

import importlib

__all__ = ["MissingDependency", "CUDA_EXTRAS_HINT", "cupy", "nvrtc", "nvrtc_failure", "cublas",
           "ml_dtypes", "hypothesis_strategies"]

#: The install line of every CUDA-side message.
CUDA_EXTRAS_HINT = ("pip install 'cupyflash[cuda13]' (CUDA 13 driver) or "
                    "'cupyflash[cuda12]' (CUDA 12 driver); from a checkout: "
                    "pip install -e '.[cuda13]'")


class MissingDependency(ImportError):
    """An optional dependency of cupyflash is not installed (or does not import)."""


def _missing(module: str, package: str, need: str, hint: str, err: BaseException):
    return MissingDependency(
        f"{need} needs {package}, which could not be imported ({type(err).__name__}: {err}); "
        f"install it with {hint}", name=module)


_CUPY_PACKAGE = "CuPy (the package cupy-cuda13x or cupy-cuda12x)"


def cupy(need: str = "cupyflash's GPU path"):
    """The ``cupy`` module.

    Raises
    ------
    MissingDependency
        CuPy is not installed (or its import failed): names ``cupy-cuda13x`` /
        ``cupy-cuda12x`` and :data:`CUDA_EXTRAS_HINT`.
    """
    try:
        import cupy as module
    except ImportError as e:
        raise _missing("cupy", _CUPY_PACKAGE, need, CUDA_EXTRAS_HINT, e) from e
    return module


def nvrtc(need: str = "compiling a kernel"):
    """CuPy's NVRTC binding, ``cupy_backends.cuda.libs.nvrtc`` (the NVRTC library itself loads
    on its first call: :func:`nvrtc_failure` words that error).

    Raises
    ------
    MissingDependency
        CuPy is not installed.
    """
    return _cupy_lib("nvrtc", need)


def _cupy_lib(name: str, need: str):
    """``cupy_backends.cuda.libs.<name>``, or MissingDependency naming CuPy's package."""
    try:
        return importlib.import_module(f"cupy_backends.cuda.libs.{name}")
    except ImportError as e:
        raise _missing("cupy_backends", _CUPY_PACKAGE, need, CUDA_EXTRAS_HINT, e) from e


def nvrtc_failure(err: BaseException, need: str = "compiling a kernel") -> MissingDependency:
    """The error to raise (``from err``) when the first NVRTC call of a process failed for a
    reason other than a compile error: CuPy is there but the NVRTC shared library
    (``libnvrtc.so``) could not be found or loaded."""
    return MissingDependency(
        f"{need} needs the NVRTC library (the package nvidia-cuda-nvrtc, or a CUDA toolkit), "
        f"which CuPy could not load ({type(err).__name__}: {str(err).splitlines()[0]}); install "
        f"it with {CUDA_EXTRAS_HINT}, or pip install 'nvidia-cuda-nvrtc==13.0.*' "
        f"(nvidia-cuda-nvrtc-cu12 for CUDA 12)", name="nvrtc")


def cublas(need: str = "the materialising baseline"):
    """CuPy's cuBLAS binding, ``cupy_backends.cuda.libs.cublas``.

    Raises
    ------
    MissingDependency
        CuPy is not installed.
    """
    return _cupy_lib("cublas", need)


def ml_dtypes(need: str = "bfloat16 host arrays"):
    """The ``ml_dtypes`` module (NumPy's bfloat16).

    Raises
    ------
    MissingDependency
        ml_dtypes is not installed: names it, ``pip install ml_dtypes`` and the CUDA extras
        (which include it).
    """
    try:
        import ml_dtypes as module
    except ImportError as e:
        raise _missing("ml_dtypes", "ml_dtypes", need,
                       f"pip install ml_dtypes (the extras cuda13 and cuda12 include it: "
                       f"{CUDA_EXTRAS_HINT})", e) from e
    return module


def hypothesis_strategies(need: str = "cupyflash.testing"):
    """``hypothesis.strategies``.

    Raises
    ------
    MissingDependency
        Hypothesis is not installed: names ``pip install hypothesis`` (the ``test`` extra
        includes it).
    """
    try:
        from hypothesis import strategies as module
    except ImportError as e:
        raise _missing("hypothesis", "Hypothesis (the package hypothesis)", need,
                       "pip install hypothesis (or the test extra: pip install "
                       "'cupyflash[test]', which also installs the CUDA 13 packages)", e) from e
    return module
