"""Peak dense matmul FLOP/s per JAX device, the denominator of MFU (vit_jax/chrono.py).

    flops_per_device, source = device_peaks.resolve_peak('bfloat16')

A value given by the user wins; else the table below (TPU, NVIDIA GPU), keyed by
jax.devices()[0].device_kind; else, on CPU, a matmul timed at start-up.

What "peak" means here:
  * Dense figures: the vendors' spec sheets state GPU tensor-core rates with 2:4 structured
    sparsity and say the dense rate is half of that; the table holds the dense rate.
  * Per JAX device, not per chip. TPU v2 and v3 show each TensorCore as one JAX device (two
    per chip), so they get half the chip figure; TPU v4 and v5p join their two TensorCores
    into one device (megacore), and v5e/v6e chips have one TensorCore, so they get the chip.
  * 'float32' is the rate a float32 model's dots run at under JAX's default matmul
    precision, which is what vit_jax trains with: on TPU one bf16 pass of the MXU (so the
    bf16 figure), on A100/H100/H200 TF32 tensor cores (jax-ml/jax#18934: DEFAULT precision
    with float32 operands is TF32 there). Against the plain FP32 CUDA-core rate (19.5 / 67
    TFLOP/s) a float32 run would read up to 8x too high, above 100% MFU. A run that asks
    for precision='highest' gets a lower ceiling than the table says.
"""
import functools
import math
import time

import jax
import jax.numpy as jnp

_TERA = 1e12

# device_kind (exact) -> (bf16, float32) dense FLOP/s per JAX device. Sources:
#   Cloud TPU system-architecture pages, "peak compute per chip (bf16)": v2 45 TFLOP/s
#   (180 per 4-chip board), v3 123, v4 275, v5e 197, v5p 459, v6e (Trillium) 918.
_TPU = {
    'TPU v2': 45 / 2,  # two JAX devices (TensorCores) per chip
    'TPU v3': 123 / 2,  # two JAX devices (TensorCores) per chip
    'TPU v4': 275,
    'TPU v5 lite': 197,  # v5e
    'TPU v5': 459,  # v5p (jax names it 'TPU v5'; 'TPU v5p' is accepted too)
    'TPU v5p': 459,
    'TPU v6 lite': 918,  # v6e, Trillium
}
# NVIDIA data sheets (dense = the "with sparsity" figure / 2), TFLOP/s (bf16, TF32):
#   A100 (SXM4 and PCIe, 40/80 GB): BF16 312, TF32 156.
#   H100 SXM5: BF16 1,979 / 2, TF32 989 / 2.   H100 PCIe: 1,513 / 2, 756 / 2.
#   H100 NVL: 1,671 / 2, 835 / 2.   H200 SXM: as H100 SXM.   H200 NVL: as H100 NVL.
# Matched on the CUDA device name jax reports, e.g. 'NVIDIA A100-SXM4-40GB',
# 'NVIDIA A100 80GB PCIe', 'NVIDIA H100 80GB HBM3' (SXM5), 'NVIDIA H100 PCIe',
# 'NVIDIA H100 NVL', 'NVIDIA H200', 'NVIDIA H200 NVL': the first rule whose words all occur
# in it (case aside) gives the peaks.
_GPU = (
    (('A100',), (312, 156)),
    (('H100', 'PCIe'), (1513 / 2, 756 / 2)),
    (('H100', 'NVL'), (1671 / 2, 835 / 2)),
    (('H100',), (1979 / 2, 989 / 2)),
    (('H200', 'NVL'), (1671 / 2, 835 / 2)),
    (('H200',), (1979 / 2, 989 / 2)),
)
_PEAK_COLUMNS = ('bfloat16', 'float32')  # the order of each row's two peaks

# The CPU measurement: a square matmul of this side, repeated at least _CPU_RUNS times and
# for at least _CPU_SECONDS (2048: 17.2 GFLOP, 25-110 ms on a 2-core AVX-512 host).
_CPU_SIDE = 2048
_CPU_RUNS = 3
_CPU_SECONDS = 0.25


def _check_dtype(dtype):
  if dtype not in _PEAK_COLUMNS:
    raise ValueError(f'dtype {dtype!r} has no peak FLOP/s: use one of {", ".join(_PEAK_COLUMNS)}')


def peak_flops(device_kind, dtype):
  """Peak dense matmul FLOP/s of one JAX device of `device_kind`; None if not in the table."""
  _check_dtype(dtype)
  column = _PEAK_COLUMNS.index(dtype)
  if device_kind in _TPU:
    return _TPU[device_kind] * _TERA
  kind = device_kind.upper()
  for required, peaks in _GPU:
    if all(word.upper() in kind for word in required):
      return peaks[column] * _TERA
  return None


@functools.lru_cache(maxsize=None)
def measure_cpu_peak(dtype):
  """FLOP/s of a jitted square matmul in `dtype` on this host: the whole process's rate.

  bfloat16: bf16 operands with float32 accumulation (the models' dots, models/precision.py);
  float32: float32 throughout. The best of at least 3 runs over at least 0.25 s after a
  warm-up, with the XLA:CPU flags of this process. All local CPU devices share the host's cores (one
  matmul already uses them all), so resolve_peak divides this by their number.
  """
  _check_dtype(dtype)
  n = _CPU_SIDE
  operand = jnp.bfloat16 if dtype == 'bfloat16' else jnp.float32
  matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  a = jnp.ones((n, n), operand)
  b = jnp.full((n, n), 0.5, operand)
  jax.block_until_ready(matmul(a, b))  # compile and warm up
  times = []
  deadline = time.perf_counter() + _CPU_SECONDS
  while len(times) < _CPU_RUNS or time.perf_counter() < deadline:
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, b))
    times.append(time.perf_counter() - start)
  return 2 * n**3 / min(times)


# Where MFU still reads over 100% (no step can do that) after the peak's timings, the loop
# and the benchmarks time it again up to this many times (each ~0.3 s) before they warn.
CPU_PEAK_RETIMES = 5


def better_cpu_peak(dtype, earlier):
  """The better of `earlier` (resolve_peak's measurement, per device) and the same matmul
  timed again now. A shared host's speed swings by a fifth or more for seconds at a time: one
  window timed in a slow spell put a float32 ViT-B/16 step's MFU at 101-109% (benchmarks/
  README.md, seventieth session); two windows apart (the loop's: before and after compiling)
  both fall in one less often, and the best of them is nearer what the cores can do."""
  return max(earlier, measure_cpu_peak.__wrapped__(dtype) / jax.local_device_count())


# No device computes under a GFLOP/s: a smaller given peak is a unit slip (TFLOP/s typed).
_MIN_GIVEN_PEAK = 1e9


def validate_given(given):
  """A one-line ValueError if `given` (config.peak_flops_per_device) cannot be a device's
  peak in FLOP/s: negative, not finite, or so small that it must be in other units."""
  if not (given == 0 or _MIN_GIVEN_PEAK <= given < math.inf):
    raise ValueError(f'peak_flops_per_device {given:g} is not a peak in FLOP/s per device: set '
                     '--config.peak_flops_per_device to FLOP/s (e.g. 2.75e14 for 275 TFLOP/s), '
                     'or 0 for the device table or, on CPU, a measurement')


def resolve_peak(dtype, given=0.0):
  """(peak FLOP/s per JAX device or None, where it came from).

  `given` > 0 (FLOP/s per device, from the config) wins: source 'given'. Else the table:
  'table:<device_kind>'. Else on CPU the measured rate over the local devices: 'measured'.
  Else (None, 'unknown:<device_kind>'): MFU is not reported.
  """
  if given and given > 0:
    return float(given), 'given'
  device = jax.devices()[0]
  peak = peak_flops(device.device_kind, dtype)
  if peak is not None:
    return peak, f'table:{device.device_kind}'
  if device.platform == 'cpu':
    return measure_cpu_peak(dtype) / jax.local_device_count(), 'measured'
  return None, f'unknown:{device.device_kind}'
