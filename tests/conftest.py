"""Test set-up before jax starts: 8 simulated CPU devices, vit_jax's XLA:CPU flags, quiet TF."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The suite runs with the XLA:CPU flags the training CLI adds (vit_jax/xla_cpu_flags.py).
from vit_jax import xla_cpu_flags  # noqa: E402

xla_cpu_flags.apply()
