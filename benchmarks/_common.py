"""Helpers shared by the benchmark scripts: set-up, timing, peaks, tables, JSON.

Import this module BEFORE jax when a script needs simulated devices
(`setup_devices`), since XLA reads its flags when jax starts.
"""
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

# bf16 dense peaks (FLOP/s) of common accelerators, per chip / device as JAX sees it.
KNOWN_PEAKS = {
    'tpu_v2': 45e12,  # per chip (2 cores)
    'tpu_v3': 123e12,  # per chip (2 cores)
    'tpu_v4': 275e12,
    'tpu_v5e': 197e12,
    'tpu_v5p': 459e12,
    'v100': 125e12,
    'a100': 312e12,
    'h100': 989e12,  # SXM, dense
    'h200': 989e12,
}


def setup_devices(n, dtypes=('float32',)):
  """Simulates `n` CPU devices (n > 1), adds vit_jax's XLA:CPU flags for `dtypes` (as the
  training CLI does for its dtype; VIT_JAX_XLA_CPU_FLAGS=0 leaves them out) and quiets
  TensorFlow. Call before importing jax. XLA reads its flags once per process, so dtypes
  whose flags differ cannot be timed in one process as the CLI runs them: one line and exit."""
  from vit_jax import xla_cpu_flags  # pylint: disable=import-outside-toplevel
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  if n and n > 1:
    flags.append(f'--xla_force_host_platform_device_count={n}')
  elif 'jax' not in sys.modules:
    flags.append('--xla_force_host_platform_device_count=1')
  os.environ['XLA_FLAGS'] = ' '.join(flags)
  wanted = {d: xla_cpu_flags.pending(dtype=d) for d in dtypes}
  if len({tuple(f) for f in wanted.values()}) > 1:
    sys.exit(f'the CLI runs {" and ".join(wanted)} under different XLA:CPU flags '
             f'({wanted}, vit_jax/xla_cpu_flags.py): pass one --dtypes per run, or set '
             'VIT_JAX_XLA_CPU_FLAGS=0 (XLA defaults for all) or XLA_FLAGS yourself')
  xla_cpu_flags.apply(dtype=dtypes[0])


def cores():
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count()


def machine_info():
  import jax  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  return {
      'date': datetime.date.today().isoformat(),
      'host': platform.node(),
      'cpu_cores': cores(),
      'platform': dev.platform,
      'device_kind': getattr(dev, 'device_kind', ''),
      'device_count': jax.device_count(),
      'jax': jax.__version__,
      'xla_flags': os.environ.get('XLA_FLAGS', ''),
      'python': platform.python_version(),
  }


def loadavg():
  return list(os.getloadavg())


def peak_rss_gib():
  """Peak resident memory of this process so far (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def device_peak_memory_gib():
  """Accelerator peak bytes in use, where the backend reports it (not on CPU)."""
  import jax  # pylint: disable=import-outside-toplevel
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


def cost_flops(compiled):
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost['flops']) if cost and 'flops' in cost else None


def matmul_peak(n=4096, dtype='float32', reps=3):
  """Best FLOP/s of a jitted n x n x n matmul (bf16: bf16 inputs, f32 accumulation)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
  a = jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(key_b, (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
  f(a, b).block_until_ready()
  best = float('inf')
  for _ in range(reps):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * n**3 / best


def parse_peak(value):
  """--peak: a known accelerator name, a number of FLOP/s, or 'measure' (CPU matmul)."""
  if value in (None, '', 'measure'):
    return None
  if value.lower() in KNOWN_PEAKS:
    return KNOWN_PEAKS[value.lower()]
  try:
    return float(value)
  except ValueError:
    raise SystemExit(f'--peak {value!r}: use a number of FLOP/s, "measure", or one of '
                     f'{", ".join(KNOWN_PEAKS)}') from None


def summary(values):
  """median, min, max of a non-empty list."""
  return {'median': statistics.median(values), 'min': min(values), 'max': max(values)}


def fmt_range(values, spec='.2f'):
  s = summary(values)
  return f'{s["median"]:{spec}} ({s["min"]:{spec}}–{s["max"]:{spec}})'


def markdown_table(header, rows):
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  for r in rows:
    lines.append('| ' + ' | '.join(str(x) for x in r) + ' |')
  return '\n'.join(lines)


def write_json(path, payload):
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(payload, f, indent=2, default=float)
  print(f'\nwrote {path}')


def add_model_args(parser, dtypes='float32', steps=2):
  """The flags every model benchmark takes: models and batches, dtypes, size, timing, overrides."""
  parser.add_argument('--models', default='ViT-Ti_16,ViT-B_16,R50+ViT-B_16')
  parser.add_argument('--batch', default='32,8,8', help='one per model, or one for all')
  parser.add_argument('--dtypes', default=dtypes)
  parser.add_argument('--image_size', type=int, default=224)
  parser.add_argument('--steps', type=int, default=steps, help='timed steps per side per round')
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--override', action='append', default=[],
                      help='variant field, e.g. --override num_layers=2 (repeatable)')


def model_batches(args):
  """[(model, batch), ...] from --models and --batch (one batch for all, or one per model)."""
  models = args.models.split(',')
  batches = [int(b) for b in args.batch.split(',')]
  if len(batches) == 1:
    batches = batches * len(models)
  if len(batches) != len(models):
    raise SystemExit(f'--batch has {len(batches)} values for {len(models)} models: '
                     'give one for all or one per model')
  return list(zip(models, batches))


def parse_overrides(items):
  """['num_layers=2', 'hidden_size=64'] -> {'num_layers': 2, 'hidden_size': 64}."""
  out = {}
  for item in items or ():
    key, _, value = item.partition('=')
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value
  return out
