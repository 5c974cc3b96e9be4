r"""Training-step throughput, FLOPs, MFU and memory of vit_jax models.

The step is the real one: vit_jax.step.make_train_step (forward, backward, loss) with
vit_jax.optim.make_optimizer(optimizer='sgd'): SGD momentum 0.9 + global-norm clip 1,
jitted with the loop's shardings and donation, on a random batch already on the device.

  python benchmarks/train_step.py --out /tmp/train_step.json
  python benchmarks/train_step.py --models ViT-B_16 --batch 8 --dtypes float32 \
      --remat=,nothing_saveable,dots_saveable   # remat policies side by side ('' = off)
  python benchmarks/train_step.py --models ViT-B_16 --batch 256   # on a TPU or GPU

Configurations (model x dtype) are timed interleaved, round after round (A B A B ...).
MFU divides by the device's peak as the loop's does (vit_jax.device_peaks: the TPU/GPU
table, --peak FLOP/s per device, or on CPU a jitted matmul, f32 or bf16 inputs with f32
accumulation, timed again each round: every round's MFU is against the best timing of the
run, since one timing in a shared host's slow spell can put MFU over 100%; where it still
reads over 100%, the matmul is timed again after the rounds, as the loop does).
Compilation and one warm-up step per configuration are excluded from the timings.
The process runs under the host allocator vit-train preloads (--allocator, as vs_pytorch.py;
by default VIT_JAX_HOST_ALLOCATOR's choice, else auto). Under jemalloc each step waits for
its temporaries to be freed, as the loop's does (vit_jax/host_memory.py); --no-heap_wait
times it without. --pause_ms idles after each step instead (benchmarks/README.md, ninth
session). With one configuration, the compiled step is dropped after the rounds and the
resident host memory that frees is its program's ('program host MiB': part of the peak RSS
that no planned buffer accounts for). With more, their programs share the heap's pages, and
one dropped while others are alive frees only pages of its own: n/a (benchmarks/README.md,
sixtieth session).
"""
import argparse

import bare_step
import harness
import jax

from vit_jax import cpu_features
from vit_jax import device_peaks
from vit_jax import flops as vflops

parser = harness.argument_parser(__doc__)
harness.add_model_args(parser)
parser.add_argument(
    '--remat', default='',
    help="comma-separated remat policies (models/remat.py) timed side by side; '' = off")
parser.add_argument('--accum_steps', type=int, default=1)
parser.add_argument('--mesh', type=int, default=1, help='devices on the data axis (CPU: simulated)')
parser.add_argument('--peak', type=float, default=0.0,
                    help='peak FLOP/s per device (default: the device table, or measured on CPU)')
parser.add_argument('--pause_ms', type=float, default=0.0,
                    help='idle time after each step, outside its timing (host allocator tests)')
parser.add_argument('--heap_wait', action=argparse.BooleanOptionalAction, default=True,
                    help="the loop's wait for the step's temporaries under jemalloc")
harness.add_allocator_arg(parser)
parser.add_argument('--out', default='')
args = parser.parse_args()
try:  # vit-train's check of peak_flops_per_device, in this script's words
  device_peaks.validate_given(args.peak)
except ValueError as e:
  parser.error(
      str(e).replace('--config.peak_flops_per_device',
                     '--peak').replace('peak_flops_per_device', '--peak'))


def _best(peaks):
  """The best of a dtype's peak timings, or None (no peak: MFU n/a)."""
  return max(peaks) if peaks and None not in peaks else None


def _over_one(steps, per_round, peak):
  """Whether any of `steps` (one dtype's) ran a round at MFU over 100% of `peak`."""
  return any(
      vflops.mfu(s.flops_analytic, min(t), peak * len(s.mesh.devices.flat)) > 1
      for s, t in zip(steps, per_round))


def _retime_where_mfu_exceeds_one(steps, per_round, peaks, sources):
  """{dtype: [peaks timed again]}: while a round's MFU reads over 100% against the best
  timing so far, which no step can do (every timing fell in a slow spell of the host), the
  matmul is timed again, up to CPU_PEAK_RETIMES times per dtype, as the loop does
  (vit_jax/train.py); a warning if MFU still reads over 100%."""
  retimes = {dt: [] for dt in peaks}
  for dt in peaks:
    mine = [i for i, s in enumerate(steps) if s.config.dtype == dt]
    mine_steps, mine_rounds = [steps[i] for i in mine], [per_round[i] for i in mine]
    while (sources[dt] == 'measured' and len(retimes[dt]) < device_peaks.CPU_PEAK_RETIMES
           and _over_one(mine_steps, mine_rounds, _best(peaks[dt] + retimes[dt]))):
      retimes[dt].append(device_peaks.better_cpu_peak(dt, _best(peaks[dt] + retimes[dt])))
    best = _best(peaks[dt] + retimes[dt])
    if best and _over_one(mine_steps, mine_rounds, best):
      print(
          f'warning: {dt} MFU reads over 100% after {len(retimes[dt])} more timings of the '
          'peak: this host was slow in every one; pass --peak (FLOP/s per device) for an '
          'exact MFU', flush=True)
  return retimes


def main():
  harness.reexec_under_allocator(args.allocator)
  bare_step.setup(args.mesh, args.dtypes.split(','))
  load_start = harness.loadavg()
  cases = harness.model_batches(args)
  models = [m for m, _ in cases]
  dtypes = args.dtypes.split(',')
  overrides = bare_step.overrides(args.override)

  steps = []
  for name, batch in cases:
    for dtype, remat in [(d, r) for d in dtypes for r in args.remat.split(',')]:
      config = bare_step.make_config(name, batch, dtype=dtype, remat=remat,
                                     accum_steps=args.accum_steps, mesh=args.mesh,
                                     image_size=args.image_size, model_overrides=overrides)
      s = bare_step.BareStep(config, pause_s=args.pause_ms / 1000, heap_wait=args.heap_wait)
      s.run(1)  # warm-up
      print(f'compiled {name} b{batch} {dtype} remat={remat!r}: {s.compile_s:.1f} s', flush=True)
      steps.append(s)

  peaks = {dt: [] for dt in dtypes}
  sources = {}
  times = [[] for _ in steps]  # per config, per round: list of step times
  for r in range(args.rounds):
    for dt in dtypes:
      peak, sources[dt] = bare_step.peak_per_device(
          dt, args.peak, remeasure=True, earlier=max(filter(None, peaks[dt]), default=0.0))
      peaks[dt].append(peak)
    for i, s in enumerate(steps):
      times[i].append(s.run(args.steps))
    print(f'round {r + 1}/{args.rounds} done', flush=True)

  per_round = [[sorted(t)[len(t) // 2] for t in ts] for ts in times]  # median step times
  retimes = _retime_where_mfu_exceeds_one(steps, per_round, peaks, sources)
  program_mib = [steps[0].drop_program()] if len(steps) == 1 else [None] * len(steps)
  results = []
  for i, s in enumerate(steps):
    c = s.config
    all_times = [x for t in times[i] for x in t]
    step_s = harness.summary(all_times)['median']
    img_s = [c.batch_size / t for t in per_round[i]]
    flop_s = [s.flops_analytic / t for t in per_round[i]]
    # MFU per device: the step's FLOPs over its devices' peaks, every round against the best
    # timing of the run (the rounds' and any taken again after them).
    n_dev = len(s.mesh.devices.flat)
    peak_list = [p * n_dev if p else None for p in peaks[c.dtype]]
    used = _best(peaks[c.dtype] + retimes[c.dtype])
    mfu = [vflops.mfu(s.flops_analytic, t, used * n_dev) if used else None for t in per_round[i]]
    results.append({
        'model': c.model_name,
        'batch': c.batch_size,
        'dtype': c.dtype,
        'remat': c.remat,
        'accum_steps': c.accum_steps,
        'mesh': args.mesh,
        'image_size': c.image_size,
        'overrides': overrides,
        'num_params': s.num_params,
        'compile_s': s.compile_s,
        'step_s_all': all_times,
        'step_s_median': step_s,
        'img_s_per_round': img_s,
        'img_s_median': c.batch_size / step_s,
        'flops_per_step_analytic': s.flops_analytic,
        'flops_per_step_xla': s.flops_xla,
        'flop_s_per_round': flop_s,
        'peak_flop_s_per_round': peak_list,
        'peak_flop_s_retimed': [p * n_dev for p in retimes[c.dtype]],
        'peak_flop_s_used': used * n_dev if used else None,
        'peak': sources[c.dtype],
        'mfu_per_round': mfu,
        'xla_planned_memory_gib': s.memory_gib,
        'program_host_mib': program_mib[i],
        'heap_wait': s.heap_wait.summary(),
    })

  ratios = []
  if 'float32' in dtypes and 'bfloat16' in dtypes:
    for name in models:
      a = next(x for x in results if x['model'] == name and x['dtype'] == 'float32')
      b = next(x for x in results if x['model'] == name and x['dtype'] == 'bfloat16')
      ratios.append({
          'model': name,
          'bf16_over_f32_per_round': [
              y / x for x, y in zip(a['img_s_per_round'], b['img_s_per_round'])
          ]
      })

  load_end = harness.loadavg()
  payload = {
      'benchmark': 'train_step',
      'machine': bare_step.machine_info(),
      'args': vars(args),
      'loadavg_start': load_start,
      'loadavg_end': load_end,
      'peak_flop_s_per_device': peaks,
      'peak_source': sources,
      'peak_rss_gib': harness.peak_rss_gib(),
      'device_peak_memory_gib': bare_step.device_peak_memory_gib(),
      'results': results,
      'bf16_vs_f32': ratios
  }

  rows = []
  for x in results:
    rows.append([
        x['model'],
        x['batch'],
        x['dtype'] + (f' remat={x["remat"]}' if x['remat'] else '') +
        (f' accum{x["accum_steps"]}' if x['accum_steps'] > 1 else ''),
        harness.fmt_range(x['img_s_per_round']),
        f'{x["step_s_median"]:.3f}',
        f'{x["flops_per_step_analytic"] / 1e9:.1f}',
        'n/a' if x['flops_per_step_xla'] is None else f'{x["flops_per_step_xla"] / 1e9:.1f}',
        harness.fmt_range([f / 1e9 for f in x['flop_s_per_round']], '.1f'),
        'n/a' if None in x['mfu_per_round'] else harness.fmt_range(
            [100 * m for m in x['mfu_per_round']], '.1f'),
        'n/a' if x['xla_planned_memory_gib'] is None else f'{x["xla_planned_memory_gib"]:.2f}',
        'n/a' if x['program_host_mib'] is None else f'{x["program_host_mib"]:.0f}',
    ])
  print(f'\n### train_step ({payload["machine"]["device_kind"] or "cpu"}, '
        f'{jax.device_count()} device(s); {cpu_features.model()}, {harness.cores()} cores)\n')
  print(
      harness.markdown_table([
          'model', 'batch', 'dtype', 'img/s median (min–max over rounds)', 'step s',
          'GFLOP/step (analytic)', 'GFLOP/step (XLA)', 'GFLOP/s', 'MFU %', 'XLA mem GiB',
          'program host MiB'
      ], rows))
  print('\npeak GFLOP/s per device: ' + ', '.join(
      f'{dt} {harness.fmt_range([p / 1e9 for p in v], ".0f")} ({sources[dt]}'
      + (f'; timed again after the rounds: {", ".join(f"{p / 1e9:.0f}" for p in retimes[dt])}'
         if retimes[dt] else '') + ')' for dt, v in peaks.items() if None not in v))
  for r in ratios:
    print(f'bf16/f32 img/s {r["model"]}: per round '
          + ', '.join(f'{v:.2f}' for v in r['bf16_over_f32_per_round']))
  if payload['machine']['platform'] == 'gpu':
    print(f'GPU memory: {payload["machine"]["gpu_memory"]}')
  print(payload['machine']['host_allocator'])
  print(f'peak host RSS {payload["peak_rss_gib"]:.2f} GiB; loadavg start '
        f'{load_start[0]:.2f}, end {load_end[0]:.2f}')
  harness.write_json(args.out, payload)


if __name__ == '__main__':
  main()
