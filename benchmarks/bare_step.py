"""The JAX side of the benchmarks: devices and XLA:CPU flags as the CLI sets them, the real
vit_jax training step (make_train_step + make_optimizer('sgd')) compiled once, and what is
measured around it (peaks, planned memory, machine).

Used by train_step.py, vs_pytorch.py, loop.py and block_breakdown.py so that all time the
same thing. Call `setup` before the first JAX computation. (harness.py holds what needs no
JAX: the PyTorch worker of vs_pytorch.py imports only that, so its RSS is its own.)
"""
import gc
import os
import sys
import time

import harness  # noqa: F401  (puts the repo on sys.path)
import jax
import numpy as np

from vit_jax import config_checks
from vit_jax import device_peaks
from vit_jax import flops as vflops
from vit_jax import host_allocator
from vit_jax import host_memory
from vit_jax import model_flags
from vit_jax import models
from vit_jax import optim
from vit_jax import sharding
from vit_jax import step as step_lib
from vit_jax import xla_cpu_flags
from vit_jax.configs import common as common_config
from vit_jax.models import remat as remat_lib


def setup(devices=1, dtypes=('float32',)):
  """`devices` CPU devices, vit_jax's XLA:CPU flags for `dtypes` (as the training CLI adds
  them for its dtype; VIT_JAX_XLA_CPU_FLAGS=0 leaves them out), TensorFlow quiet. XLA reads
  its flags once per process, so dtypes whose flags differ cannot be timed in one process
  as the CLI runs them: one line and exit."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  os.environ['XLA_FLAGS'] = ' '.join(f for f in os.environ.get('XLA_FLAGS', '').split()
                                     if not f.startswith('--xla_force_host_platform_device_count'))
  wanted = {d: xla_cpu_flags.pending(dtype=d) for d in dtypes}
  if len({tuple(f) for f in wanted.values()}) > 1:
    sys.exit(f'the CLI runs {" and ".join(wanted)} under different XLA:CPU flags '
             f'({wanted}, vit_jax/xla_cpu_flags.py): pass one --dtypes per run, or set '
             'VIT_JAX_XLA_CPU_FLAGS=0 (XLA defaults for all) or XLA_FLAGS yourself')
  xla_cpu_flags.apply(dtype=dtypes[0])
  jax.config.update('jax_num_cpu_devices', devices)


def overrides(items):
  """Repeated --override name=value flags -> {name: value} (vit_jax.model_flags' parser); a
  malformed one is a one-line exit."""
  try:
    return model_flags.parse_overrides(','.join(items or ()))
  except ValueError as e:
    sys.exit(f'{os.path.basename(sys.argv[0])}: --override: {e}')


def machine_info():
  """What JAX runs on in this process (harness.write_json adds the host: CPU, date, ...)."""
  dev = jax.devices()[0]
  return {
      'platform': dev.platform,
      'device_kind': getattr(dev, 'device_kind', ''),
      'device_count': jax.device_count(),
      'jax': jax.__version__,
      'xla_flags': os.environ.get('XLA_FLAGS', ''),
      'host_allocator': host_allocator.describe(),
      'gpu_memory': gpu_memory() if dev.platform == 'gpu' else '',
  }


def gpu_memory():
  """How JAX takes a GPU's memory in this process; it changed the step's speed on an H200."""
  value = os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', '')
  if value.lower() in ('false', '0'):
    return 'not preallocated (XLA_PYTHON_CLIENT_PREALLOCATE=false)'
  if value:
    return f'preallocated (XLA_PYTHON_CLIENT_PREALLOCATE={value})'
  return "preallocated (JAX's default, as vit-train runs)"


def peak_per_device(dtype, given=0.0, remeasure=False, earlier=0.0):
  """(FLOP/s per device, where from), as the loop's MFU gets it (vit_jax.device_peaks).
  `remeasure`: on CPU the matmul timed again, and the best of that, `earlier` (the best of
  this process's timings so far) and the start-up timing taken, as the loop takes the better
  of its two (the benchmarks time it again each round): a host's slow spell in one window
  puts MFU over 100% (benchmarks/README.md, seventieth session)."""
  peak, source = device_peaks.resolve_peak(dtype, given)
  if remeasure and source == 'measured':
    peak = device_peaks.better_cpu_peak(dtype, max(peak, earlier))
  return peak, source


def device_peak_memory_gib():
  """Accelerator peak bytes in use, where the backend reports it (not on CPU)."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  if not stats or 'peak_bytes_in_use' not in stats:
    return None
  return stats['peak_bytes_in_use'] / 2**30


def compiled_memory_gib(compiled):
  """XLA's planned memory of a compiled step: arguments + outputs + temporaries - aliased."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if m is None:
    return None
  total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
           - m.alias_size_in_bytes)
  return total / 2**30


def _xla_flops(compiled):
  """The FLOPs XLA's cost analysis gives a compiled program (as vit_jax.flops.xla_flops)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost['flops']) if cost and 'flops' in cost else None


def make_config(model_name, batch, *, dtype='float32', remat=False, accum_steps=1, mesh=1,
                image_size=224, model_overrides=None):
  """A common.py config for SGD momentum 0.9 + global-norm clip 1 (Table 4's step)."""
  c = common_config.get_config()
  c.model_name = model_name
  for k, v in (model_overrides or {}).items():
    c.model[k] = v
  c.dtype = dtype
  c.remat = remat
  c.accum_steps = accum_steps
  c.mesh_data = mesh
  c.image_size = image_size
  c.batch_size = batch
  c.optimizer = 'sgd'
  c.momentum = 0.9
  c.grad_clip_norm = 1.0
  c.base_lr = 0.01
  c.lr_decay = 'cosine'
  c.warmup_steps = 10
  c.total_steps = 10_000
  c.weight_decay = 0.0
  _check(c)
  return c


# vit-train's words for a field, and the benchmark flag that sets it.
_FLAG_OF_FIELD = {
    '--config.model_name': '--models',
    '--config.image_size': '--image_size',
    '--config.dtype': '--dtypes',
    '--config.remat': '--remat',
    '--config.model.': '--override ',
    '--config.accum_steps': '--accum_steps',
    '--config.batch_size': '--batch',
    '--config.mesh_data': '--mesh',
}


def _check(config):
  """vit-train's start-up checks of the config (a model, size, dtype or remat a benchmark
  flag got wrong): one line naming the benchmark's flag, not a traceback from the model."""
  try:
    models.get_variant(config.model_name, **config.model)  # its words for a name or a field
    remat_lib.policy_name(config.remat)
    config_checks.validate_before_devices(config)
    if config.batch_size % config.mesh_data:  # vit-train checks it against its devices
      raise ValueError(f'--batch {config.batch_size} does not split over --mesh '
                       f'{config.mesh_data} devices: give a multiple of --mesh')
  except ValueError as e:
    message = str(e).splitlines()[0]
    for field, flag in _FLAG_OF_FIELD.items():
      message = message.replace(field, flag)
    sys.exit(f'{os.path.basename(sys.argv[0])}: {config.model_name}: {message}')


class BareStep:
  """Compiled train step on a random device-resident batch (no input pipeline)."""

  def __init__(self, config, num_classes=1000, pause_s=0.0, heap_wait=True, keep_stablehlo=False):
    self.config = config
    self.pause_s = pause_s  # idle after each step, untimed
    self.num_classes = num_classes
    total = optim.total_steps(config)
    schedule = optim.learning_rate_schedule(config, total)
    tx = optim.make_optimizer(config, total)
    model = models.from_config(config, num_classes)
    mesh = sharding.make_mesh(config)
    self.mesh = mesh
    batch_sh = sharding.data_sharding(mesh)
    repl = sharding.replicated(mesh)
    size = config.image_size
    # The loop's own state set-up (initialised: no checkpoint manager).
    self.state, state_sh = step_lib.create_train_state(config, model, tx, mesh, num_classes)
    self.num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state['params']))
    rng = np.random.default_rng(0)
    b = config.batch_size
    batch = {
        'image': rng.uniform(-1, 1, (b, size, size, 3)).astype(np.float32),
        'label': rng.integers(0, num_classes, (b,)).astype(np.int32)
    }
    self.batch = jax.device_put(batch, batch_sh)
    self.rng = jax.device_put(jax.random.PRNGKey(0), repl)
    jitted = step_lib.jit(model, tx, schedule, config, mesh, (state_sh, batch_sh, repl))
    t = time.perf_counter()
    # The compiled step only, as the loop keeps it (train._fitting_train_step): the lowering
    # it was compiled from holds host memory that the loop gives back before its first step
    # (benchmarks/README.md, sixty-ninth session). Its text, before XLA's passes, on request.
    lowered = jitted.lower(self.state, self.batch, self.rng)
    self.compiled = lowered.compile()
    self.compile_s = time.perf_counter() - t
    self.stablehlo = lowered.as_text() if keep_stablehlo else None
    del lowered, jitted
    self.flops_analytic = vflops.step_flops(config, num_classes)
    # The compiled program is per device under SPMD: scale to the whole step.
    xla = _xla_flops(self.compiled)
    self.flops_xla = None if xla is None else xla * len(mesh.devices.flat)
    self.memory_gib = compiled_memory_gib(self.compiled)
    # The loop's wait for the step's temporaries under jemalloc (timed: the loop pays it).
    temp = (self.compiled.memory_analysis().temp_size_in_bytes
            * len(mesh.local_devices) if heap_wait else 0)
    self.heap_wait = host_memory.TemporariesWait(temp, platform=jax.devices()[0].platform)
    host_memory.drop_traces()  # as the loop does
    # As the loop does after compiling and reading the memory analysis; after XLA's cost
    # analysis too, which the loop does not run: under jemalloc the freed pages of each
    # stay resident (+0.08 GiB of peak RSS for the cost analysis, +0.13 for the memory
    # analysis, bf16 R50+ViT-B/16 b8).
    host_memory.release_freed()

  def run(self, steps):
    """Runs `steps` steps, blocking after each; returns the wall time of each (s)."""
    times = []
    for _ in range(steps):
      t = time.perf_counter()
      self.heap_wait.before_step()
      self.state, metrics = self.compiled(self.state, self.batch, self.rng)
      jax.block_until_ready(metrics)
      self.heap_wait.after_step(metrics)
      times.append(time.perf_counter() - t)
      if not np.isfinite(float(metrics['loss'])):
        raise FloatingPointError(f'loss is {metrics["loss"]}')
      if self.pause_s:
        time.sleep(self.pause_s)
    return times

  def drop_program(self):
    """Drops the compiled step (run no more after) and returns the resident host memory that
    freed, in MiB: XLA keeps the optimised program, its buffer assignment and (XLA:CPU) its
    kernels' runtimes in the host's heap, whatever the device (benchmarks/README.md,
    fifty-fifth and sixtieth sessions). Heap purged before and after, as the loop purges."""
    gc.collect()
    host_memory.release_freed()
    before = harness.rss_gib()
    self.compiled = None
    gc.collect()
    host_memory.release_freed()
    return (before - harness.rss_gib()) * 1024
