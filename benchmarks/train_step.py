r"""Training-step throughput, FLOPs, MFU and memory of vit_jax models.

The step is the real one: vit_jax.train.make_train_step (forward, backward, loss) with
vit_jax.optim.make_optimizer(optimizer='sgd'): SGD momentum 0.9 + global-norm clip 1,
jitted with the loop's shardings and donation, on a random batch already on the device.

  python benchmarks/train_step.py --out /tmp/train_step.json
  python benchmarks/train_step.py --models ViT-B_16 --batch 8 --dtypes float32 \
      --remat=,nothing_saveable,dots_saveable   # remat policies side by side ('' = off)
  python benchmarks/train_step.py --models ViT-B_16 --batch 256 --peak tpu_v3   # on a TPU

Configurations (model x dtype) are timed interleaved, round after round (A B A B ...);
on CPU each round also re-measures the jitted 4096^3 matmul peak (f32 and bf16 inputs
with f32 accumulation), and MFU is computed against the peak of the same round.
Compilation and one warm-up step per configuration are excluded from the timings.
"""
import argparse

import _common

parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
_common.add_model_args(parser)
parser.add_argument('--remat', default='',
                    help="comma-separated remat policies (models/remat.py) timed side by side; '' = off")
parser.add_argument('--accum_steps', type=int, default=1)
parser.add_argument('--mesh', type=int, default=1, help='devices on the data axis (CPU: simulated)')
parser.add_argument('--peak', default='measure',
                    help=f'FLOP/s, "measure" (CPU matmul), or one of {",".join(_common.KNOWN_PEAKS)}')
parser.add_argument('--matmul_n', type=int, default=4096)
parser.add_argument('--out', default='')
args = parser.parse_args()

_common.setup_devices(args.mesh, args.dtypes.split(','))
import jax  # noqa: E402  pylint: disable=wrong-import-position
import _jaxstep  # noqa: E402  pylint: disable=wrong-import-position
from vit_jax import flops as vflops  # noqa: E402  pylint: disable=wrong-import-position


def main():
  load_start = _common.loadavg()
  cases = _common.model_batches(args)
  models = [m for m, _ in cases]
  dtypes = args.dtypes.split(',')
  overrides = _common.parse_overrides(args.override)
  fixed_peak = _common.parse_peak(args.peak)
  measure_peak = fixed_peak is None

  steps = []
  for name, batch in cases:
    for dtype, remat in [(d, r) for d in dtypes for r in args.remat.split(',')]:
      config = _jaxstep.make_config(name, batch, dtype=dtype, remat=remat,
                                    accum_steps=args.accum_steps, mesh=args.mesh,
                                    image_size=args.image_size, overrides=overrides)
      s = _jaxstep.BareStep(config)
      s.run(1)  # warm-up
      print(f'compiled {name} b{batch} {dtype} remat={remat!r}: {s.compile_s:.1f} s', flush=True)
      steps.append(s)

  peaks = {'float32': [], 'bfloat16': []}
  times = [[] for _ in steps]  # per config, per round: list of step times
  for r in range(args.rounds):
    if measure_peak:
      for dt in peaks:
        if dt in dtypes:
          peaks[dt].append(_common.matmul_peak(args.matmul_n, dt, reps=2))
    for i, s in enumerate(steps):
      times[i].append(s.run(args.steps))
    print(f'round {r + 1}/{args.rounds} done', flush=True)

  results = []
  for i, s in enumerate(steps):
    c = s.config
    per_round = [sorted(t)[len(t) // 2] for t in times[i]]  # median step time per round
    all_times = [x for t in times[i] for x in t]
    step_s = _common.summary(all_times)['median']
    img_s = [c.batch_size / t for t in per_round]
    flop_s = [s.flops_analytic / t for t in per_round]
    if measure_peak:
      peak_list, peak_desc = peaks[c.dtype], f'measured {c.dtype} matmul'
    else:
      peak_list, peak_desc = [fixed_peak] * len(per_round), args.peak
    mfu = [vflops.mfu(s.flops_analytic, t, p) for t, p in zip(per_round, peak_list)]
    results.append({
        'model': c.model_name, 'batch': c.batch_size, 'dtype': c.dtype, 'remat': c.remat,
        'accum_steps': c.accum_steps, 'mesh': args.mesh, 'image_size': c.image_size,
        'overrides': overrides, 'num_params': s.num_params, 'compile_s': s.compile_s,
        'step_s_all': all_times, 'step_s_median': step_s,
        'img_s_per_round': img_s, 'img_s_median': c.batch_size / step_s,
        'flops_per_step_analytic': s.flops_analytic, 'flops_per_step_xla': s.flops_xla,
        'flop_s_per_round': flop_s, 'peak_flop_s_per_round': peak_list,
        'peak': peak_desc, 'mfu_per_round': mfu,
        'xla_planned_memory_gib': s.memory_gib,
    })

  ratios = []
  if 'float32' in dtypes and 'bfloat16' in dtypes:
    for name in models:
      a = next(x for x in results if x['model'] == name and x['dtype'] == 'float32')
      b = next(x for x in results if x['model'] == name and x['dtype'] == 'bfloat16')
      ratios.append({'model': name, 'bf16_over_f32_per_round':
                     [y / x for x, y in zip(a['img_s_per_round'], b['img_s_per_round'])]})

  load_end = _common.loadavg()
  payload = {'benchmark': 'train_step', 'machine': _common.machine_info(), 'args': vars(args),
             'loadavg_start': load_start, 'loadavg_end': load_end,
             'peak_flop_s_measured': peaks if measure_peak else None,
             'peak_rss_gib': _common.peak_rss_gib(),
             'device_peak_memory_gib': _common.device_peak_memory_gib(),
             'results': results, 'bf16_vs_f32': ratios}

  rows = []
  for x in results:
    rows.append([
        x['model'], x['batch'], x['dtype'] + (f' remat={x["remat"]}' if x['remat'] else '')
        + (f' accum{x["accum_steps"]}' if x['accum_steps'] > 1 else ''),
        _common.fmt_range(x['img_s_per_round']), f'{x["step_s_median"]:.3f}',
        f'{x["flops_per_step_analytic"] / 1e9:.1f}',
        'n/a' if x['flops_per_step_xla'] is None else f'{x["flops_per_step_xla"] / 1e9:.1f}',
        _common.fmt_range([f / 1e9 for f in x['flop_s_per_round']], '.1f'),
        _common.fmt_range([100 * m for m in x['mfu_per_round']], '.1f'),
        'n/a' if x['xla_planned_memory_gib'] is None else f'{x["xla_planned_memory_gib"]:.2f}',
    ])
  print(f'\n### train_step ({payload["machine"]["device_kind"] or "cpu"}, '
        f'{jax.device_count()} device(s), {_common.cores()} cores)\n')
  print(_common.markdown_table(
      ['model', 'batch', 'dtype', 'img/s median (min–max over rounds)', 'step s',
       'GFLOP/step (analytic)', 'GFLOP/step (XLA)', 'GFLOP/s', 'MFU %', 'XLA mem GiB'], rows))
  if measure_peak:
    print('\nmeasured matmul peak GFLOP/s: ' + ', '.join(
        f'{dt} {_common.fmt_range([p / 1e9 for p in v], ".0f")}' for dt, v in peaks.items() if v))
  for r in ratios:
    print(f'bf16/f32 img/s {r["model"]}: per round '
          + ', '.join(f'{v:.2f}' for v in r['bf16_over_f32_per_round']))
  print(f'peak host RSS {payload["peak_rss_gib"]:.2f} GiB; loadavg start '
        f'{load_start[0]:.2f}, end {load_end[0]:.2f}')
  _common.write_json(args.out, payload)


if __name__ == '__main__':
  main()
