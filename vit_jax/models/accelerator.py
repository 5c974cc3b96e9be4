"""Which accelerator the models compile for, where a choice of theirs depends on it."""
import jax


def cuda_capability():
  """The default backend's CUDA compute capability (9.0 for an H100), 0 where it is not an
  NVIDIA GPU."""
  if jax.default_backend() != 'gpu':
    return 0.0
  try:
    return float(jax.local_devices()[0].compute_capability)
  except (AttributeError, TypeError, ValueError):  # not CUDA (ROCm)
    return 0.0


def is_ampere_or_later_nvidia_gpu():
  """An NVIDIA GPU with bf16 tensor cores and cuDNN's flash attention: Ampere (8.0), Hopper
  and later; not Colab's T4 (7.5)."""
  return cuda_capability() >= 8.0
