"""Shared pytest setup: Hypothesis profiles and the ``gpu`` marker.

Profiles (``HYPOTHESIS_PROFILE=ci|dev|thorough``, default ``ci``):
``ci`` bounded examples, no deadline, prints reproduction blobs; ``dev`` fewer examples for quick
iteration; ``thorough`` many examples for a soak run.
"""
import os

from hypothesis import HealthCheck, Verbosity, settings

settings.register_profile("ci", max_examples=40, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=10, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None, print_blob=True,
                          verbosity=Verbosity.normal,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
