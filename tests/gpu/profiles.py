"""Example counts that follow the Hypothesis profile (``HYPOTHESIS_PROFILE``, tests/conftest.py).

A test that sets its own ``max_examples`` would otherwise keep that count under ``thorough`` and
escape the soak run (``experiments/gpu_suite.py --soak``).
"""
import os

from hypothesis import settings


def examples(n: int) -> int:
    """``n`` examples under ``ci``; a sixth (at least 5) under ``dev``; the profile's count
    (1000) under ``thorough``."""
    profile = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    return {"dev": max(5, n // 6), "thorough": settings().max_examples}.get(profile, n)
