r"""vit_jax vs PyTorch: the same model, batch and optimizer, timed interleaved (CPU, or GPU).

  pip install torch==2.13.0 && pip install --no-deps timm==1.0.31   # the [bench] extra
  python benchmarks/vs_pytorch.py --out /tmp/vs_pytorch.json

JAX side: the real vit_jax step (make_train_step + SGD momentum 0.9 + global-norm clip 1).
PyTorch side (a separate worker process, torch.set_num_threads = the cores JAX uses):
forward, cross-entropy, backward, clip_grad_norm_(1.0), torch.optim.SGD(momentum=0.9).
The model is timm's (vit_tiny_patch16_224, vit_base_patch16_224, vit_base_r50_s16_224)
when `import timm` works. timm 1.0.x imports torchvision at import time, and there is no
CPU torchvision build here, so the worker then falls back to a MINIMAL PYTORCH VIT
(torch_vit.py) in timm's structure (fused qkv Linear + F.scaled_dot_product_attention, LayerNorm,
tanh-GELU MLP; hybrid: weight-standardised convs, GroupNorm, TF-SAME padding, stages
(3, 4, 9)), with the same parameter count as the vit_jax model (checked, printed).
--torch_compile times torch.compile's model instead (on either device; compiled in the
untimed warm-up step, whose seconds the JSON keeps). Precisions: float32 vs float32, and
vit_jax dtype='bfloat16' (bf16 compute, f32 params) vs torch.autocast('cpu',
dtype=torch.bfloat16). Each round runs --steps steps of JAX then
--steps of PyTorch for every (model, precision); the ratio is per round (pair).
Where JAX runs on a GPU, the worker runs PyTorch on it too (--torch_device; eager, as timm
trains by default, with torch.autocast('cuda') for bf16; float32 matmuls in TF32 on both
sides: XLA's default on an A100/H100 (device_peaks.py), PyTorch's 'high' precision), and
JAX does not preallocate the GPU's memory, which the two processes share. vit-train keeps
JAX's preallocation, under which the step ran slower on an H200 (benchmarks/README.md,
twentieth session): train_step.py times the step as vit-train runs it. Each side
first runs one untimed step per round: vit_jax's first step after the other process ran was
0.7-1.3 s slower than the next, PyTorch's was not (why is not established; vit_jax unmaps
its temporaries between steps, PyTorch keeps its heap), which with --steps 2 cost it ~15%.
The vit_jax side runs under the host allocator vit-train picks (vit_jax/host_allocator.py:
jemalloc where installed; --allocator system|jemalloc|PATH to choose), with the loop's wait
for each step's temporaries; the PyTorch worker is started without that preload.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import harness

from vit_jax import host_allocator  # imports no JAX, so the PyTorch worker may load it

parser = harness.argument_parser(__doc__)
harness.add_model_args(parser)
parser.add_argument('--torch_impl', default='auto', choices=('auto', 'timm', 'minimal'))
parser.add_argument('--remat', default='',
                    help="vit_jax's remat policy (models/remat.py); '' = off")
harness.add_allocator_arg(parser, torch_side=True)
parser.add_argument('--torch_device', default='auto', choices=('auto', 'cpu', 'cuda'),
                    help="PyTorch's device; auto: cuda where JAX's default backend is a GPU")
parser.add_argument(
    '--torch_compile', action='store_true',
    help='torch.compile the PyTorch model (inductor; compiled in its untimed warm-up step); '
    'default eager, as timm trains by default')
parser.add_argument('--out', default='')
parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
parser.add_argument('--threads', type=int, default=0, help=argparse.SUPPRESS)
args = parser.parse_args()


# ----------------------------------------------------------------- PyTorch worker
def torch_worker():
  """Reads JSON commands on stdin, answers one JSON line each on stdout."""
  import torch  # pylint: disable=import-outside-toplevel
  import torch_vit  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(args.threads)
  if args.torch_device == 'cuda':
    if not torch.cuda.is_available():
      sys.exit(f'vs_pytorch.py: --torch_device cuda, but PyTorch {torch.__version__} sees no '
               'CUDA GPU: install a CUDA build of torch, or leave --torch_device auto')
    torch.set_float32_matmul_precision('high')  # TF32, as XLA's default on the GPU
  torch.manual_seed(0)
  device = torch.device(args.torch_device)
  baseline_rss = harness.rss_gib()  # after imports, before any model
  out = sys.stdout
  sys.stdout = sys.stderr  # only protocol lines on the pipe

  steps = {}
  for line in sys.stdin:
    cmd = json.loads(line)
    if cmd['cmd'] == 'build':
      f, size, b = cmd['fields'], cmd['image_size'], cmd['batch']
      model, impl, impl_note = torch_vit.create(cmd['name'], f, size, args.torch_impl,
                                                cmd['overrides'])
      model.to(device).train()
      if args.torch_compile:
        impl += ', torch.compile'
      step = harness.torch_sgd_step(model, b, size, cmd['dtype'] == 'bfloat16',
                                    compile_model=args.torch_compile)

      warmup_start = time.perf_counter()
      step()  # warm-up (and, with --torch_compile, the compile)
      warmup_s = time.perf_counter() - warmup_start
      steps[cmd['key']] = step
      reply = {
          'impl': impl,
          'note': impl_note,
          'torch': torch.__version__,
          'threads': torch.get_num_threads(),
          'num_params': sum(p.numel() for p in model.parameters()),
          'warmup_s': warmup_s,
          'baseline_rss_gib': baseline_rss
      }
    elif cmd['cmd'] == 'run':
      times = []
      for _ in range(cmd['steps']):
        t = time.perf_counter()
        loss = steps[cmd['key']]()
        times.append(time.perf_counter() - t)
        if not math.isfinite(loss):
          raise FloatingPointError(f'torch loss {loss}')
      reply = {'times': times, 'peak_rss_gib': harness.peak_rss_gib()}
    else:
      break
    out.write(json.dumps(reply) + '\n')
    out.flush()


class Worker:

  def __init__(self, threads, device):
    self.proc = subprocess.Popen([
        sys.executable,
        os.path.abspath(__file__), '--worker', '--threads',
        str(threads), '--torch_impl', args.torch_impl, '--torch_device', device,
        *(['--torch_compile'] if args.torch_compile else [])
    ], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=host_allocator.without_preload(os.environ))

  def call(self, **cmd):
    self.proc.stdin.write(json.dumps(cmd) + '\n')
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError('PyTorch worker died (see its stderr above)')
    return json.loads(line)

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


# ----------------------------------------------------------------- JAX side
def main():
  harness.reexec_under_allocator(args.allocator)  # a bad --allocator: its line first
  harness.require_torch('vs_pytorch.py')
  # JAX only here: the PyTorch worker (this file with --worker) must not load it.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')  # a GPU's memory is shared
  import bare_step  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  bare_step.setup(1, args.dtypes.split(','))
  from vit_jax import models as vmodels  # pylint: disable=import-outside-toplevel
  # After imports (JAX, flax, optax and orbax, ~0.2 GiB; bare_step keeps TensorFlow out:
  # tests/test_step.py), before any model.
  jax_baseline_rss = harness.rss_gib()

  load_start = harness.loadavg()
  dtypes = args.dtypes.split(',')
  overrides = bare_step.overrides(args.override)
  threads = harness.cores()
  torch_device = args.torch_device
  if torch_device == 'auto':
    torch_device = 'cuda' if jax.default_backend() == 'gpu' else 'cpu'
  if (torch_device == 'cuda') != (jax.default_backend() == 'gpu'):
    parser.error(f'--torch_device {torch_device}: JAX runs on {jax.default_backend()} here; '
                 'time both on one kind of device (leave --torch_device auto)')
  worker = Worker(threads, torch_device)

  cases = []
  for name, batch in harness.model_batches(args):
    fields = vmodels.get_variant(name, **overrides)
    for dtype in dtypes:
      key = f'{name}/{dtype}'
      jstep = bare_step.BareStep(
          bare_step.make_config(name, batch, dtype=dtype, remat=args.remat,
                                image_size=args.image_size, model_overrides=overrides))
      jstep.run(1)
      info = worker.call(cmd='build', key=key, name=name, fields=fields, dtype=dtype, batch=batch,
                         image_size=args.image_size, overrides=overrides)
      print(
          f'built {key}: jax {jstep.num_params:,} params, torch {info["num_params"]:,} '
          f'({info["impl"]})', flush=True)
      cases.append({
          'key': key,
          'model': name,
          'batch': batch,
          'dtype': dtype,
          'jax': jstep,
          'torch_info': info,
          'jax_times': [],
          'torch_times': []
      })

  torch_rss = 0.0
  for r in range(args.rounds):
    for c in cases:
      c['jax'].run(1)  # untimed: the first step after a switch (module doc)
      c['jax_times'].append(c['jax'].run(args.steps))
      worker.call(cmd='run', key=c['key'], steps=1)
      reply = worker.call(cmd='run', key=c['key'], steps=args.steps)
      c['torch_times'].append(reply['times'])
      torch_rss = reply['peak_rss_gib']
    print(f'round {r + 1}/{args.rounds} done', flush=True)
  worker.close()

  def med(t):
    return sorted(t)[len(t) // 2]

  results, rows = [], []
  for c in cases:
    jax_img = [c['batch'] / med(t) for t in c['jax_times']]
    torch_img = [c['batch'] / med(t) for t in c['torch_times']]
    ratio = [a / b for a, b in zip(jax_img, torch_img)]
    info = c['torch_info']
    results.append({
        'model': c['model'],
        'batch': c['batch'],
        'dtype': c['dtype'],
        'torch_impl': info['impl'],
        'torch_version': info['torch'],
        'torch_threads': info['threads'],
        'jax_threads(cores)': threads,
        'jax_params': c['jax'].num_params,
        'torch_params': info['num_params'],
        'torch_warmup_s': info['warmup_s'],
        'jax_step_s': c['jax_times'],
        'torch_step_s': c['torch_times'],
        'jax_img_s_per_round': jax_img,
        'torch_img_s_per_round': torch_img,
        'ratio_per_round': ratio,
        'ratio_median': harness.summary(ratio)['median'],
        'target_1p1x_met': harness.summary(ratio)['median'] >= 1.1
    })
    rows.append([
        c['model'], c['batch'], c['dtype'] if c['dtype'] == 'float32' else 'bf16 / autocast bf16',
        harness.fmt_range(jax_img),
        harness.fmt_range(torch_img), ', '.join(f'{x:.2f}' for x in ratio),
        harness.fmt_range(ratio), 'met' if results[-1]['target_1p1x_met'] else 'MISSED'
    ])
  load_end = harness.loadavg()
  note = cases[0]['torch_info']['note'] if cases else ''
  payload = {
      'benchmark': 'vs_pytorch',
      'machine': bare_step.machine_info(),
      'args': vars(args),
      'loadavg_start': load_start,
      'loadavg_end': load_end,
      'torch_note': note,
      'torch_device': torch_device,
      'jax_host_allocator': host_allocator.describe(),
      'torch_ld_preload': host_allocator.without_preload(os.environ).get('LD_PRELOAD', ''),
      # Peak RSS of each process over all its cases (one case per run to compare).
      'jax_peak_rss_gib': harness.peak_rss_gib(),
      'torch_peak_rss_gib': torch_rss,
      'jax_baseline_rss_gib': jax_baseline_rss,
      'torch_baseline_rss_gib': cases[0]['torch_info']['baseline_rss_gib'] if cases else 0.0,
      'results': results
  }
  where = f'{threads} threads each' if torch_device == 'cpu' else bare_step.machine_info(
  )['device_kind']
  print(f'\n### vit_jax vs PyTorch ({where})' + (f' — {note}' if note else ''))
  print()
  print(
      harness.markdown_table([
          'model', 'batch', 'precision', 'vit_jax img/s', 'PyTorch img/s', 'ratio per pair',
          'ratio median (min–max)', '≥1.1×'
      ], rows))
  print(f'\npeak host RSS over all cases: vit_jax {payload["jax_peak_rss_gib"]:.2f} GiB, '
        f'PyTorch worker {torch_rss:.2f} GiB; above each process\'s RSS after its imports '
        f'(vit_jax {jax_baseline_rss:.2f}, PyTorch {payload["torch_baseline_rss_gib"]:.2f} GiB): '
        f'vit_jax {payload["jax_peak_rss_gib"] - jax_baseline_rss:.2f} GiB, PyTorch '
        f'{torch_rss - payload["torch_baseline_rss_gib"]:.2f} GiB')
  if torch_device == 'cuda':  # not as vit-train runs: see the module doc
    print(f'vit_jax GPU memory: {payload["machine"]["gpu_memory"]}')
  print(f'vit_jax {payload["jax_host_allocator"]}; PyTorch worker LD_PRELOAD='
        f'{payload["torch_ld_preload"] or "(none)"}')
  print(f'loadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  harness.write_json(args.out, payload)


if __name__ == '__main__':
  if args.worker:
    torch_worker()
  else:
    main()
