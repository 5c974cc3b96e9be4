r"""Where the train step's device time goes, by kind of work: vit_jax against timm in PyTorch.

  python benchmarks/device_time.py --models ViT-B_16 --batch 128 --dtypes bfloat16 \
      --torch compile      # on a GPU: vit_jax and torch.compile'd timm, kernel by kernel
  python benchmarks/device_time.py --models ViT-B_16 --batch 8 --dtypes float32 \
      --torch eager        # CPU: vit_jax's thunks and PyTorch's operators, side by side

Each side runs in its own process, one after the other (JAX preallocates the GPU's memory,
as vit-train does), and traces `--steps` steps after `--warmup` untraced ones. vit_jax's
runs under the host allocator vit-train picks (--allocator, as vs_pytorch.py), so that its
XLA:CPU flags are the ones the start-up probe chose for vit-train; PyTorch's without it.
vit_jax: the bare step (bare_step.py, as train_step.py times it) under jax.profiler. Each
device event (a GPU kernel; on the CPU, an XLA thunk) names the HLO instruction it runs
(its hlo_op stat); the instruction's kind comes from the compiled program's HLO text: a dot
or a fusion around one, cuDNN's attention or a batched dot (the unfused attention core), a
convolution, a fusion with a reduce in it, a fusion of elementwise ops, a copy or transpose,
or other. A kernel without one is classed by its name, as PyTorch's are. Under XLA:GPU's
default CUDA graphs the whole step is one event (command_buffer_N): run with
XLA_FLAGS=--xla_gpu_enable_command_buffer= to see its kernels (on an H100 the preallocated
step ran 1.08x faster without them; benchmarks/README.md).
PyTorch (`--torch eager|compile`, SGD momentum + clip as vs_pytorch.py): on a CUDA GPU timm's
model and torch.profiler's CUDA kernels, each kind read from the kernel's name (cuBLAS and
CUTLASS gemms, flash/cuDNN attention, inductor's fused pointwise and reduction kernels); on
the CPU (torch.set_num_threads = the cores JAX uses; torch_vit.py's model) each operator's
self time, its kind read from its aten:: name. On the CPU both sides count the wall time of
each op (thunk, operator) on the thread that runs it, its helper threads inside it.
Per step, in ms. XLA:CPU runs independent thunks at once on its threads (and a GPU's
streams may overlap), so each of vit_jax's ops is charged its share of the wall time, each
moment split among the ops running then (`wall_shares`); the table's 'concurrency' is their
summed durations over those shares. PyTorch's CPU operators run one at a time; its CUDA
kernels are counted by duration. The traced steps' wall time is printed beside.
Beside PyTorch, vit_jax's speed over PyTorch's from the two traced walls, and what it would
be with vit_jax's time in one kind of work, then in every kind but the matmuls, cut to
PyTorch's (`ratios_if`): how far work outside the dense dots could take the step.
Then each side's dots by shape, (batch x) M x K x N: vit_jax's from the HLO (a fusion's dots
together: YNNPACK fuses the attention core's two), PyTorch's CPU matmul operators from
torch.profiler's input shapes (its CUDA kernels carry none): how many per step, their FLOPs,
the time charged to them as above, and GFLOP/s over that charge (which compares across the
two sides) and over the time each ran.
"""
import argparse
import collections
import functools
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import harness

from vit_jax import host_allocator  # imports no JAX

KINDS = ('matmul', 'attention', 'convolution', 'reduction fusion', 'elementwise fusion',
         'copy/layout', 'other')

parser = harness.argument_parser(__doc__)
harness.add_model_args(parser, dtypes='bfloat16', steps=5)
parser.add_argument('--warmup', type=int, default=3, help='untraced steps before the trace')
parser.add_argument('--torch', default='compile', choices=('none', 'eager', 'compile'),
                    help="PyTorch's side: eager, under torch.compile, or none")
parser.add_argument('--top', type=int, default=12, help='the longest HLO ops / kernels listed')
harness.add_allocator_arg(parser, torch_side=True)
parser.add_argument('--out', default='')
parser.add_argument('--side', default='', choices=('', 'vit_jax', 'torch'), help=argparse.SUPPRESS)
args = parser.parse_args()

# ------------------------------------------------------------------- vit_jax
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$')
_OPCODE = re.compile(r'\b([a-z][a-z0-9\-]*)\(')
_CALLS = re.compile(r'calls=%?([\w.\-]+)')
_LAYOUT_OPS = {
    'parameter', 'copy', 'transpose', 'bitcast', 'reshape', 'slice', 'concatenate', 'broadcast',
    'tuple', 'get-tuple-element', 'constant', 'pad', 'dynamic-slice', 'dynamic-update-slice',
    'convert'
}


# hlo_kinds and hlo_dots read the same step's text: it is parsed once (callers only read).
@functools.lru_cache(maxsize=1)
def parse_hlo(hlo_text):
  """({computation: [(opcode, text after ' = ')]}, {instruction: (opcode, text)},
  {instruction: its computation}) of an optimised HLO module's text (instruction names are
  unique in the module)."""
  bodies, lines, where, current = collections.defaultdict(list), {}, {}, None
  for line in hlo_text.splitlines():
    if line.rstrip().endswith('{') and ' = ' not in line:
      current = line.split()[1 if line.startswith('ENTRY') else 0].lstrip('%')
      continue
    m = _INSTRUCTION.match(line)
    if m:
      op = _OPCODE.search(m.group(2))
      lines[m.group(1)] = (op.group(1) if op else '', m.group(2))
      bodies[current].append(lines[m.group(1)])
      where[m.group(1)] = current
  return bodies, lines, where


def hlo_kinds(hlo_text):
  """{instruction name: kind} for every instruction of an optimised HLO module's text."""
  bodies, lines, _ = parse_hlo(hlo_text)

  def kind(opcode, rest):
    """By what the instruction computes: an operand's name (gemm_fusion.3) says nothing. A
    dot with batch dimensions is the attention core's: in these models only it has them."""
    if opcode == 'custom-call':
      target = re.search(r'custom_call_target="([^"]*)"', rest)
      target = target.group(1).lower() if target else ''
      if 'fmha' in target or 'attention' in target:
        return 'attention'
      if 'conv' in target:
        return 'convolution'
      if 'gemm' in target or 'matmul' in target:
        return 'attention' if '"lhs_batch_dimensions":["' in rest else 'matmul'
      return 'other'
    if opcode == 'fusion':
      calls = _CALLS.search(rest)
      body = bodies.get(calls.group(1), []) if calls else []
      inner = {kind(o, r) for o, r in body if o in ('custom-call', 'dot', 'convolution')}
      backend = re.search(r'"kind":"([^"]*)"', rest)  # a kCustom fusion's emitter
      backend = backend.group(1).lower() if backend else ''
      if 'attention' in inner or 'fmha' in backend:
        return 'attention'
      if 'matmul' in inner or 'gemm' in backend:
        return 'matmul'
      if 'convolution' in inner or 'conv' in backend:
        return 'convolution'
      opcodes = {o for o, _ in body}
      if opcodes & {'reduce', 'reduce-window', 'scatter'}:
        return 'reduction fusion'
      return 'copy/layout' if opcodes <= _LAYOUT_OPS else 'elementwise fusion'
    if opcode == 'dot':
      return 'attention' if 'lhs_batch_dims=' in rest else 'matmul'
    if opcode == 'convolution':
      return 'convolution'
    if opcode in ('copy', 'transpose', 'copy-start', 'copy-done'):
      return 'copy/layout'
    if opcode in ('reduce', 'reduce-window'):
      return 'reduction fusion'
    return 'other'

  return {name: kind(*v) for name, v in lines.items()}


_SHAPE = re.compile(r'\b[a-z]+\d*\[([\d,]*)\]')
_DOT_OPERANDS = re.compile(r'\b(?:dot|custom-call)\(([^)]*)\)')


def _dims(rest, name):
  """The dimension numbers `name` of a dot (lhs_contracting_dims={1}) or of a cuBLAS call's
  backend config ("lhs_contracting_dimensions":["1"]), as a tuple of ints."""
  m = (re.search(name + r'_dims=\{([\d,]*)\}', rest)
       or re.search(f'"{name}_dimensions":\\[([\\d",]*)\\]', rest))
  return tuple(int(d) for d in m.group(1).replace('"', '').split(',') if d) if m else ()


def _dot_shape(rest, lines):
  """(batch, M, K, N) of one dot: the product of its batch dimensions, of the left operand's
  free ones, of the contracted ones and of the right operand's free ones; None where the
  operands' shapes cannot be read."""
  operands = _DOT_OPERANDS.search(rest)
  names = [o.split()[-1].lstrip('%') for o in operands.group(1).split(',')] if operands else []
  if len(names) < 2 or any(n not in lines for n in names[:2]):
    return None
  lhs, rhs = (
      [int(d) for d in _SHAPE.search(lines[n][1]).group(1).split(',') if d] for n in names[:2])
  prod = lambda dims, shape: math.prod(shape[d] for d in dims)
  lb, lc, rb, rc = (
      _dims(rest, f'{side}_{what}') for side in ('lhs', 'rhs') for what in ('batch', 'contracting'))
  if not lc:  # a gemm call whose dimension numbers are not in its text
    return None
  free = lambda shape, used: math.prod(d for i, d in enumerate(shape) if i not in used)
  return (prod(lb, lhs), free(lhs, lb + lc), prod(lc, lhs), free(rhs, rb + rc))


def hlo_dots(hlo_text):
  """{instruction name: [(batch, M, K, N), ...]} for each instruction of an optimised HLO
  module's text that runs dots: a dot, a cuBLAS gemm call, a fusion with dots in it (all of
  them: YNNPACK fuses the attention core's two with the softmax between). A dot's FLOPs are
  2 batch M K N. The dots inside fusions are not listed themselves."""
  bodies, lines, where = parse_hlo(hlo_text)

  def shapes(opcode, rest):
    if opcode == 'dot' or (opcode == 'custom-call' and re.search(
        r'custom_call_target="[^"]*(gemm|matmul)', rest, re.IGNORECASE)):
      shape = _dot_shape(rest, lines)
      return [shape] if shape else []
    calls = _CALLS.search(rest) if opcode == 'fusion' else None
    return [s for o, r in bodies.get(calls.group(1), []) for s in shapes(o, r)] if calls else []

  fused = {
      m.group(1) for body in bodies.values() for opcode, rest in body if opcode == 'fusion'
      for m in [_CALLS.search(rest)] if m
  }
  found = {name: shapes(*v) for name, v in lines.items() if where[name] not in fused}
  return {name: dots for name, dots in found.items() if dots}


def dot_label(dots):
  """'6304x192x768' (M x K x N) for a dot, '24 x 197x64x197' with a batch; a fusion's dots
  joined by ' + '."""
  return ' + '.join((f'{b} x ' if b > 1 else '') + f'{m}x{k}x{n}' for b, m, k, n in dots)


def dot_table(durations, steps):
  """[{dots, per_step, ms_per_step, gflops_per_s, ...}] by dot label, the most time first:
  `durations` are (label, FLOPs, ms charged, ms running) of each traced dot op or operator.
  GFLOP/s over the time charged (comparable across sides: the charges add up to the wall
  time) and over the time each ran (where thunks run at once, each runs slower than alone)."""
  rows = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
  for label, flops, charged, running in durations:
    row = rows[label]
    row[0] += 1
    row[1] += flops
    row[2] += charged
    row[3] += running
  table = [{
      'dots': label,
      'per_step': n / steps,
      'gflop_per_step': flops / 1e9 / steps,
      'ms_per_step': charged / steps,
      'running_ms_per_step': running / steps,
      'gflops_per_s_charged': flops / 1e6 / charged if charged else 0.0,
      'gflops_per_s': flops / 1e6 / running if running else 0.0,
  } for label, (n, flops, charged, running) in rows.items()]
  return sorted(table, key=lambda r: -r['ms_per_step'])


def ratios_if(vit_jax, torch):
  """[(what, vit_jax's step speed over PyTorch's)] from the two traces: as traced, then with
  vit_jax's time in one kind of work replaced by PyTorch's (each kind where vit_jax's is
  longer), then with every kind but the matmuls at the shorter side's time: the most that
  work outside the dense dots could give while the matmuls take what they took. Each side's
  kinds are its own (the hybrid's 1x1 convolutions are dots in vit_jax, convolutions in
  PyTorch), so a kind's row is an estimate; the last one bounds what the trace can say."""
  mine, theirs = vit_jax['ms_per_step'], torch['ms_per_step']
  wall, target = vit_jax['wall_ms_per_step'], torch['wall_ms_per_step']
  over = {k: mine.get(k, 0.0) - theirs.get(k, 0.0) for k in KINDS}
  rows = [('as traced', target / wall)]
  rows += [(f'{k} at PyTorch\'s time', target / (wall - over[k])) for k in KINDS if over[k] > 0]
  rows.append(('every kind but matmul at the shorter time', target /
               (wall - sum(max(over[k], 0.0) for k in KINDS if k != 'matmul'))))
  return rows


def trace_events(xplane_path, module):
  """[(hlo_op or None, event name, start ns, end ns)] of the device events of `module`
  (XLA:CPU: its thunks). A kernel launched inside a CUDA graph may carry no hlo_op."""
  import jax  # pylint: disable=import-outside-toplevel
  data = jax.profiler.ProfileData.from_file(xplane_path)
  planes = [p for p in data.planes if p.name.startswith('/device:')]
  if not planes:
    planes = [p for p in data.planes if p.name == '/host:CPU']
  events = []
  for plane in planes:
    for line in plane.lines:
      for e in line.events:
        stats = dict(e.stats)
        if stats.get('hlo_module', module) != module:
          continue
        if 'hlo_op' not in stats and plane.name == '/host:CPU':
          continue  # host-side bookkeeping, not a thunk
        events.append((stats.get('hlo_op'), e.name, e.start_ns, e.end_ns))
  return events


def wall_shares(spans):
  """Each (start, end) span's share of the wall time, in the spans' unit: every moment is
  split evenly among the spans running then. XLA:CPU runs independent thunks at once on
  its threads, so their durations add up to more than the time they took; the shares add up
  to the time that any ran."""
  edges = sorted([(start, 1, i) for i, (start, _) in enumerate(spans)]
                 + [(end, -1, i) for i, (_, end) in enumerate(spans)])
  shares, running, last = [0.0] * len(spans), set(), None
  for t, change, i in edges:
    if running:
      for j in running:
        shares[j] += (t - last) / len(running)
    last = t
    if change > 0:
      running.add(i)
    else:
      running.discard(i)
  return shares


def vit_jax_side(name, batch, dtype):
  import bare_step  # pylint: disable=import-outside-toplevel
  bare_step.setup(1, (dtype,))
  import jax  # pylint: disable=import-outside-toplevel
  config = bare_step.make_config(name, batch, dtype=dtype, image_size=args.image_size,
                                 model_overrides=bare_step.overrides(args.override))
  step = bare_step.BareStep(config)
  text = step.compiled.as_text()
  module = re.search(r'HloModule ([\w.\-]+)', text).group(1)
  kinds, dots = hlo_kinds(text), hlo_dots(text)
  step.run(args.warmup)
  logdir = tempfile.mkdtemp(prefix='device_time_')
  jax.profiler.start_trace(logdir)
  wall = time.perf_counter()
  step.run(args.steps)
  wall = time.perf_counter() - wall
  jax.profiler.stop_trace()
  (path,) = glob.glob(os.path.join(logdir, '**', '*.xplane.pb'), recursive=True)
  events = trace_events(path, module)
  shutil.rmtree(logdir)
  shares = wall_shares([(start, end) for _, _, start, end in events])
  per_op, op_kind, dot_durations = collections.Counter(), {}, []
  for (op, kernel, start, end), ns in zip(events, shares):
    if op in dots:
      flops = sum(2 * b * m * k * n for b, m, k, n in dots[op])
      dot_durations.append((dot_label(dots[op]), flops, ns / 1e6, (end - start) / 1e6))
    key = op or f'kernel {kernel[:80]}'
    per_op[key] += ns / 1e6 / args.steps
    op_kind[key] = kinds[op] if op in kinds else kernel_kind(kernel)
  busy = sum(end - start for _, _, start, end in events) / 1e6 / args.steps
  per_kind = collections.Counter()
  for op, ms in per_op.items():
    per_kind[op_kind[op]] += ms
  machine = bare_step.machine_info()
  return {
      'impl': f'vit_jax (jax {jax.__version__})',
      'host_allocator': host_allocator.describe(),
      'gpu_memory': machine['gpu_memory'],
      'device': jax.devices()[0].device_kind,
      'wall_ms_per_step': 1e3 * wall / args.steps,
      'ms_per_step': dict(per_kind),
      'concurrency': busy / max(sum(per_kind.values()), 1e-9),
      'top': [(op, op_kind[op], ms) for op, ms in per_op.most_common(args.top)],
      'dots': dot_table(dot_durations, args.steps),
      'machine': machine,
  }


# ------------------------------------------------------------------- PyTorch
# (pattern, kind), first match wins. cuDNN's attention backward also runs dot(dO, O) and the
# dQ conversion as kernels of its own; 'conv' is not 'convert'.
_KERNEL_KINDS = [
    (r'flash|fmha|attention|sdpa|mha|dot_do_o|convert_dq', 'attention'),
    (r'conv(?!ert)|fprop|dgrad|wgrad|implicit', 'convolution'),
    (r'gemm|nvjet|xmma|cutlass|cublas|matmul|triton_tem_fused_(add)?mm|splitk', 'matmul'),
    (r'triton_(red|per)_|reduce|layer_norm|softmax|norm', 'reduction fusion'),
    (r'triton_poi_|elementwise|foreach|multi_tensor|cat', 'elementwise fusion'),
    (r'copy|memcpy|memset|transpose|nchwtonhwc|nhwctonchw', 'copy/layout'),
]


def kernel_kind(name):
  """The kind of work of a CUDA kernel, from its name (cuBLAS, CUTLASS, cuDNN, inductor)."""
  return next((kind for pattern, kind in _KERNEL_KINDS if re.search(pattern, name.lower())),
              'other')


# (pattern, kind) for PyTorch's CPU operators (torch.profiler's aten:: names), first match wins:
# the autograd engine's, its nodes' (AddmmBackward0) and the optimizer's own entries first, as
# their names hold an operator's.
_ATEN_KINDS = [
    (r'^autograd::|^torch::autograd|^optimizer|#|backward\d+$|^detach', 'other'),
    (r'attention|flash', 'attention'),
    (r'conv(?!ert)', 'convolution'),
    (r'\b(addmm|mm|bmm|baddbmm|matmul|linear)\b', 'matmul'),
    (r'norm|softmax|\bsum\b|\bmean\b|\bvar|\bstd\b|max_pool|amax|nll_loss|cross_entropy',
     'reduction fusion'),
    (r'copy|clone|contiguous|transpose|permute|\bt\b|\bcat\b|pad|view|reshape|expand|slice|'
     r'select|stack|as_strided|\bto\b|empty|unfold|split|chunk|unbind', 'copy/layout'),
    (r'add|sub|mul|div|gelu|relu|threshold|tanh|exp|sqrt|pow|neg|fill|zero|clamp|where|'
     r'foreach|lerp|sign|abs|square|reciprocal', 'elementwise fusion'),
]


def aten_kind(name):
  """The kind of work of a PyTorch CPU operator, from its name."""
  return next((kind for pattern, kind in _ATEN_KINDS if re.search(pattern, name.lower())), 'other')


def torch_dot(name, input_shapes):
  """(batch, M, K, N) of a PyTorch CPU matmul operator (torch.profiler's name and input
  shapes), else None."""
  operands = {
      'aten::mm': (0, 1),
      'aten::addmm': (1, 2),
      'aten::bmm': (0, 1),
      'aten::baddbmm': (1, 2)
  }.get(name)
  if operands is None:
    return None
  lhs, rhs = (input_shapes[i] for i in operands)
  return (lhs[0] if len(lhs) == 3 else 1, lhs[-2], lhs[-1], rhs[-1])


def torch_side(name, batch, dtype):
  """timm's step (or torch_vit.py's minimal ViT where timm does not import, on the CPU only)
  under torch.profiler: on a CUDA GPU its kernels, on the CPU each operator's self time."""
  import torch  # pylint: disable=import-outside-toplevel
  import torch_vit  # pylint: disable=import-outside-toplevel
  from vit_jax import model_flags  # pylint: disable=import-outside-toplevel
  from vit_jax.models import variants  # pylint: disable=import-outside-toplevel
  overrides = model_flags.parse_overrides(','.join(args.override))
  cuda = torch.cuda.is_available()
  if cuda:
    torch.set_float32_matmul_precision('high')  # TF32, as XLA's default on the GPU
  else:
    torch.set_num_threads(harness.cores())
  torch.manual_seed(0)
  fields = variants.get_variant(name, **overrides)
  model, impl, note = torch_vit.create(name, fields, args.image_size, 'timm' if cuda else 'auto',
                                       overrides)
  model = model.to('cuda' if cuda else 'cpu').train()
  step = harness.torch_sgd_step(model, batch, args.image_size, dtype == 'bfloat16',
                                compile_model=args.torch == 'compile')
  impl += ' under torch.compile' if args.torch == 'compile' else ' eager'
  for _ in range(args.warmup):
    step()
  activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
  with torch.profiler.profile(activities=[activity], record_shapes=not cuda) as prof:
    wall = time.perf_counter()
    for _ in range(args.steps):
      step()
    wall = time.perf_counter() - wall
  per_op, dot_durations = collections.Counter(), []
  if cuda:
    for e in prof.profiler.kineto_results.events():
      if e.device_type() == torch.autograd.DeviceType.CUDA:
        per_op[e.name()] += e.duration_ns() / 1e6 / args.steps
  else:
    for e in prof.key_averages():
      per_op[e.key] += e.self_cpu_time_total / 1e3 / args.steps
    for e in prof.key_averages(group_by_input_shape=True):
      dot = torch_dot(e.key, e.input_shapes)
      if dot:  # count operators of one shape, so each's time is its average
        ms = e.self_cpu_time_total / 1e3 / e.count
        dot_durations += [(dot_label([dot]), 2 * math.prod(dot), ms, ms)] * e.count
  classify = kernel_kind if cuda else aten_kind
  per_kind = collections.Counter()
  for op, ms in per_op.items():
    per_kind[classify(op)] += ms
  return {
      'impl': f'{impl} (torch {torch.__version__})',
      'ld_preload': os.environ.get('LD_PRELOAD', ''),
      'note': note,
      'device': torch.cuda.get_device_name() if cuda else f'CPU, {torch.get_num_threads()} threads',
      'wall_ms_per_step': 1e3 * wall / args.steps,
      'ms_per_step': dict(per_kind),
      'top': [(k[:90], classify(k), ms) for k, ms in per_op.most_common(args.top)],
      'dots': dot_table(dot_durations, args.steps),
  }


# ------------------------------------------------------------------- both
def run_side(side, name, batch, dtype):
  """One side in its own process; its result (a JSON line on stdout)."""
  cmd = [
      sys.executable,
      os.path.abspath(__file__), '--side', side, '--models', name, '--batch',
      str(batch), '--dtypes', dtype, '--image_size',
      str(args.image_size), '--steps',
      str(args.steps), '--warmup',
      str(args.warmup), '--torch', args.torch, '--top',
      str(args.top), *[f'--override={o}' for o in args.override]
  ]
  env = (harness.jax_environment(args.allocator)
         if side == 'vit_jax' else host_allocator.without_preload(os.environ))
  proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
  if proc.returncode:
    sys.exit(f'device_time.py: the {side} side of {name} {dtype} failed (exit '
             f'{proc.returncode}; its error is above)')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
  if args.side:
    (name, batch), = harness.model_batches(args)
    run = vit_jax_side if args.side == 'vit_jax' else torch_side
    result = run(name, batch, args.dtypes)
    sys.stdout.flush()
    print(json.dumps(result, default=float))
    return
  harness.jax_environment(args.allocator)  # a bad --allocator: its one line before any side
  if args.torch != 'none':
    harness.require_torch('device_time.py', without='--torch none')
  load_start = harness.loadavg()
  results = []
  sides = ['vit_jax'] + ([] if args.torch == 'none' else ['torch'])
  for name, batch in harness.model_batches(args):
    for dtype in args.dtypes.split(','):
      row = {'model': name, 'batch': batch, 'dtype': dtype}
      for side in sides:
        row[side] = run_side(side, name, batch, dtype)
      results.append(row)
      header = ['kind'] + [f'{row[s]["impl"]} ms/step' for s in sides]
      table = [[k] + [f'{row[s]["ms_per_step"].get(k, 0.0):.3f}' for s in sides] for k in KINDS]
      table.append(['sum of kinds'] + [f'{sum(row[s]["ms_per_step"].values()):.3f}' for s in sides])
      table.append(['wall'] + [f'{row[s]["wall_ms_per_step"]:.3f}' for s in sides])
      table.append(['concurrency'] + [f'{row[s].get("concurrency", 1.0):.2f}' for s in sides])
      memory = row['vit_jax']['gpu_memory']
      print(f'\n{name} b{batch} {dtype} on {row["vit_jax"]["device"]}, {args.steps} steps traced'
            + (f'; JAX\'s GPU memory {memory}' if memory else ''))
      print(harness.markdown_table(header, table))
      print(f'vit_jax {row["vit_jax"]["host_allocator"]}; XLA_FLAGS='
            f'{row["vit_jax"]["machine"]["xla_flags"] or "(none)"}')
      if 'torch' in row:
        row['ratios_if'] = ratios_if(row['vit_jax'], row['torch'])
        print('\nvit_jax / PyTorch speed from the traced walls, if vit_jax took PyTorch\'s time:')
        print(
            harness.markdown_table(['vit_jax\'s time', 'ratio'],
                                   [(w, f'{r:.3f}') for w, r in row['ratios_if']]))
      for s in sides:
        print(f'\nlongest of {row[s]["impl"]}:')
        print(
            harness.markdown_table(['op / kernel', 'kind', 'ms/step'],
                                   [(o, k, f'{ms:.3f}') for o, k, ms in row[s]['top']]))
      for s in sides:
        if row[s]['dots']:
          print(f'\ndots of {row[s]["impl"]} by shape ([batch x] M x K x N; ms/step charged '
                'as above; GFLOP/s over that and over the time each ran):')
          print(
              harness.markdown_table([
                  'dots', 'per step', 'GFLOP/step', 'ms/step', 'GFLOP/s charged', 'GFLOP/s running'
              ], [(d['dots'], f'{d["per_step"]:g}', f'{d["gflop_per_step"]:.3f}',
                   f'{d["ms_per_step"]:.3f}', f'{d["gflops_per_s_charged"]:.1f}',
                   f'{d["gflops_per_s"]:.1f}') for d in row[s]['dots'][:args.top]]))
  harness.write_json(args.out, {
      'results': results,
      'loadavg_start': load_start,
      'loadavg_end': harness.loadavg()
  })


if __name__ == '__main__':
  main()
