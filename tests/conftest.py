"""The hypothesis profiles every test runs under ("ci" unless HYPOTHESIS_PROFILE names another); the
shared strategies are in tests/support/strategies.py."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

# vLLM picks its platform once, at the first import of its model code, which collection may do in any
# test module (importorskip): on a machine without CUDA it has to be told "cpu" before that.
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("ci"), max_examples=500, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
