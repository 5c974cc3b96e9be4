"""Test set-up: 8 simulated CPU devices before jax starts, quiet TensorFlow."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long runs, not in the default suite (run with -m slow)")
