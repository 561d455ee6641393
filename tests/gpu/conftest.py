"""GPU test setup: skip cleanly without a CUDA device; optionally compile every kernel up front.

Run with ``pytest -m gpu tests/gpu`` (``setup.cfg`` deselects ``gpu`` by default). Without CuPy or
without a visible device every test here is reported as skipped, never as an error.

``CUPYFLASH_GPU_COUNTS=path.json`` writes the outcome counts (passed, failed, error, skipped,
xfailed, xpassed) and the failing node ids there at the end of the run, for
``experiments/gpu_suite.py`` (which may equally read ``--junitxml``).

``CUPYFLASH_GPU_PRECOMPILE=1`` (default) compiles the prefill specialisations the suite can
reach in a thread pool before the first test (NVRTC releases the GIL), so Hypothesis examples
measure kernels, not compiles; ``0`` compiles lazily instead.
"""
import json
import os

import pytest


def _device_count() -> int:
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device
        return 0


HAVE_GPU = _device_count() > 0


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (cupy sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def clean_guard_records():
    """The test starts and ends without an unreported device-side check error
    (:func:`cupyflash.core.guard.check_errors`)."""
    from cupyflash.core import guard
    guard.check_errors()
    yield
    guard.check_errors()


@pytest.fixture(scope="session")
def gpu():
    """The current ``cupy.cuda.Device``; skips the test when there is none."""
    if not HAVE_GPU:
        pytest.skip("needs a CUDA device (cupy sees none)")
    import cupy
    return cupy.cuda.Device()


@pytest.fixture(scope="session")
def precompiled(gpu):
    """Compile every prefill specialisation once, in parallel (seconds of wall time recorded)."""
    if os.environ.get("CUPYFLASH_GPU_PRECOMPILE", "1") == "0":
        return {}
    from cupyflash.core import jit
    from cupyflash.forward import kernels as prefill
    with gpu:
        return jit.get_kernels(prefill.all_specs())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    path = os.environ.get("CUPYFLASH_GPU_COUNTS")
    if not path:
        return
    stats = terminalreporter.stats
    keys = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    counts = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") in
                      ("call", "setup", "teardown", None)]) for k in keys}
    failures = [r.nodeid for k in ("failed", "error") for r in stats.get(k, [])
                if hasattr(r, "nodeid")]
    with open(path, "w") as f:
        json.dump({"have_gpu": HAVE_GPU, "exitstatus": int(exitstatus), "counts": counts,
                   "failures": failures}, f, indent=1)
