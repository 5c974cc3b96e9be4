"""What every benchmark script shares and that needs no JAX: statistics, markdown tables,
JSON, load and memory of the process, the model/batch flags, and PyTorch's side of the step
(timm's names for the models, the SGD step vs_pytorch.py and device_time.py time).

(The PyTorch workers import only this; the JAX side is bare_step.py.)
"""
import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from vit_jax import cpu_features  # noqa: E402  (no JAX)
from vit_jax import host_allocator  # noqa: E402  (no JAX)
from vit_jax import xla_cpu_flags  # noqa: E402  (no JAX: it imports jaxlib only when asked)

cores = xla_cpu_flags.cores  # the CPU cores this process may use

TIMM_NAMES = {  # vit_jax's model names -> timm's, for the PyTorch sides
    'ViT-Ti_16': 'vit_tiny_patch16_224',
    'ViT-S_16': 'vit_small_patch16_224',
    'ViT-B_16': 'vit_base_patch16_224',
    'ViT-B_32': 'vit_base_patch32_224',
    'R50+ViT-B_16': 'vit_base_r50_s16_224'
}


def loadavg():
  return list(os.getloadavg())


def peak_rss_gib():
  """Peak resident memory of this process so far (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rss_gib():
  """Resident memory of this process now (Linux /proc; 0.0 where there is none)."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**30
  except OSError:
    return 0.0


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


def host():
  """The host a result was measured on, as benchmarks/README.md tells hosts apart."""
  return {
      'cpu_model': cpu_features.model(),
      'cpu_cores': cores(),
      'hostname': platform.node(),
      'date': datetime.date.today().isoformat(),
      'python': platform.python_version(),
      'jaxlib': _version('jaxlib'),
  }


def _version(package):
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return ''


def write_json(path, payload):
  """Writes `payload` with the host it ran on (`host`) to `path`; nothing where path is ''."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w') as f:
    json.dump({**payload, 'host': host()}, f, indent=2, default=float)
  print(f'\nwrote {path}')


def positive_int(text):
  """argparse's type for a count or size: a whole number, 1 or more."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not a whole number') from None
  if value < 1:
    raise argparse.ArgumentTypeError(f'{value} must be 1 or more')
  return value


def positive_ints(text):
  """argparse's type for comma-separated counts or sizes."""
  return [positive_int(part) for part in text.split(',')]


def height_width(text):
  """argparse's type for an image size 'height,width' (two whole numbers)."""
  if len(text.split(',')) != 2:
    raise argparse.ArgumentTypeError(f'{text!r} is not height,width (e.g. 375,500)')
  return tuple(positive_ints(text))


class _DefaultsShown(argparse.HelpFormatter):
  """--help gives every flag's default, those without a help text too (a default such as
  device_time.py's --torch compile had been in the source alone)."""

  def _format_action(self, action):
    if not action.help and _shown_default(action):
      action = argparse.Action(action.option_strings, action.dest, nargs=action.nargs,
                               default=action.default, metavar=action.metavar,
                               help='default: %(default)s')
    return super()._format_action(action)

  def _get_help_string(self, action):
    if '%(default)' in action.help or not _shown_default(action):
      return action.help
    return action.help + ' (default: %(default)s)'


def _shown_default(action):
  return action.option_strings and action.default not in (None, False, [], '', argparse.SUPPRESS)


def argument_parser(doc):
  """The script's parser: its docstring's first paragraph as the description (its first
  line alone had stopped mid-sentence), every default shown."""
  first = doc.strip().split('\n\n')[0]
  return argparse.ArgumentParser(description=' '.join(first.split()),
                                 formatter_class=_DefaultsShown)


def add_model_args(parser, dtypes='float32', steps=2):
  """The flags every model benchmark takes: models and batches, dtypes (not where dtypes is
  None: the script fixes them), size, timing, overrides."""
  parser.add_argument('--models', default='ViT-Ti_16,ViT-B_16,R50+ViT-B_16')
  parser.add_argument('--batch', type=positive_ints, default='32,8,8',
                      help='one per model, or one for all')
  if dtypes is not None:
    parser.add_argument('--dtypes', default=dtypes)
  parser.add_argument('--image_size', type=positive_int, default=224)
  parser.add_argument('--steps', type=positive_int, default=steps,
                      help='timed steps per side per round')
  parser.add_argument('--rounds', type=positive_int, default=2)
  parser.add_argument('--override', action='append', default=[],
                      help='variant field, e.g. --override num_layers=2 (repeatable)')


def add_allocator_arg(parser, torch_side=False):
  """--allocator: the host allocator of the benchmark's vit_jax process; by default the
  environment's VIT_JAX_HOST_ALLOCATOR, else auto, as vit-train takes it."""
  parser.add_argument(
      '--allocator', default=os.environ.get(host_allocator.CHOICE) or 'auto',
      help="vit_jax's host allocator, as VIT_JAX_HOST_ALLOCATOR takes it (auto, jemalloc, "
      "system, a path; default: that variable's value, else auto)" +
      ("; PyTorch's side is started without it" if torch_side else ''))


def reexec_under_allocator(allocator):
  """Restarts this script with `allocator` preloaded as vit-train would preload it
  (vit_jax/host_allocator.py), so that the start-up flags it times are vit-train's (they are
  keyed on the allocator: vit_jax/xla_cpu_flags.py). Returns where there is nothing to
  preload (`system`, already preloaded, a TPU/GPU plugin); a bad choice exits with the fix."""
  os.environ[host_allocator.CHOICE] = allocator
  try:
    host_allocator.reexec_with_jemalloc()
  except ValueError as e:  # not a mode or a file, or jemalloc asked for and not installed
    raise SystemExit(f'--allocator: {e}') from None


def jax_environment(allocator):
  """The environment a vit_jax process of a benchmark starts with: `allocator` preloaded as
  vit-train would preload it (vit_jax/host_allocator.py). Its start-up flags are keyed on the
  allocator (vit_jax/xla_cpu_flags.py), so a benchmark under another one times other flags.
  A bad --allocator, or jemalloc asked for and not installed, exits with the fix."""
  env = {**host_allocator.without_preload(os.environ), host_allocator.CHOICE: allocator}
  try:
    return host_allocator.reexec_environment(env) or env
  except ValueError as e:
    raise SystemExit(f'--allocator: {e}') from None


def train_step_process(args, model, batch, dtype, env, workdir, extra=()):
  """The JSON of one `train_step.py` run in its own process under `env` (for what is fixed
  when a process starts: XLA flags, allocator, CPU devices): `model` at `batch` and `dtype`,
  args' --image_size, --steps and --override, one round, then the flags `extra`. Exits with
  the tail of its output if it fails."""
  out = os.path.join(workdir, 'step.json')
  cmd = [
      sys.executable,
      os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train_step.py'), '--models', model,
      '--batch',
      str(batch), '--dtypes', dtype, '--image_size',
      str(args.image_size), '--steps',
      str(args.steps), '--rounds', '1', '--out', out, *extra
  ]
  for o in args.override:
    cmd += ['--override', o]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  if proc.returncode:
    sys.exit(f'train_step.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}')
  with open(out) as f:
    return json.load(f)


def end_of_processes_run(benchmark, args, env, load_start, results, **fields):
  """What a benchmark whose sides ran as `train_step.py` processes under `env` prints last
  (the cores, the preloaded allocator, the load average over the run) and writes to --out:
  its name, args, `fields`, those and its `results`."""
  load_end = loadavg()
  print(f'{cpu_features.model()}, {cores()} cores; LD_PRELOAD {env.get("LD_PRELOAD", "")!r}')
  print(f'loadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  write_json(
      args.out, {
          'benchmark': benchmark,
          'args': vars(args),
          'loadavg_start': load_start,
          'loadavg_end': load_end,
          'ld_preload': env.get('LD_PRELOAD', ''),
          'results': results,
          **fields
      })


def model_batches(args):
  """[(model, batch), ...] from --models and --batch (one batch for all, or one per model)."""
  models = args.models.split(',')
  batches = args.batch
  if len(batches) == 1:
    batches = batches * len(models)
  if len(batches) != len(models):
    raise SystemExit(f'--batch has {len(batches)} values for {len(models)} models: '
                     'give one for all or one per model')
  return list(zip(models, batches))


def check_batch_splits(batch, devices):
  """Exits with one line where `batch` does not split evenly over `devices` devices."""
  if batch % devices:
    raise SystemExit(f'--batch {batch} does not split over {devices} devices: give a '
                     'multiple of --devices')


def require_torch(script, without=''):
  """One line naming the install, not a worker's ModuleNotFoundError and a broken pipe;
  `without` names the flag that runs the script without PyTorch, where it has one."""
  if importlib.util.find_spec('torch') is None:
    alternative = f', or run without it: {without}' if without else ''
    sys.exit(f"{script}: PyTorch is not installed: pip install -c constraints.txt '.[bench]'"
             f'{alternative}')


def torch_sgd_step(model, batch, image_size, bf16, compile_model=False):
  """PyTorch's side of the step on a random batch on the model's device: forward (under
  torch.autocast for bf16), cross-entropy, backward, clip_grad_norm_(1.0), SGD momentum 0.9;
  compile_model: torch.compile's model (not the optimizer, as timm's --torchcompile).
  Returns step(), which returns the loss and so waits for the device."""
  import torch  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  device = next(model.parameters()).device
  opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
  if compile_model:
    model = torch.compile(model)
  x = (torch.rand(batch, 3, image_size, image_size) * 2 - 1).to(device)
  y = torch.randint(0, 1000, (batch,)).to(device)

  def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
      logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())

  return step
