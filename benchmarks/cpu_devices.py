r"""The train step on the host CPU as one XLA device and split into several (data parallel
over them, `config.cpu_devices`): the evidence for configs/quickstart.py's choice.

JAX fixes the CPU device count when its backend starts, so each side runs `train_step.py
--mesh N` in its own process, under the allocator vit-train preloads, interleaved per model
and round (1 N 1 N ...); the speed ratio is taken per pair, and each side's peak RSS (the
parameters and optimizer state are on every device) is reported beside it.

  python benchmarks/cpu_devices.py --models ViT-Ti_16 --batch 128 --image_size 28 \
      --override patch_size=7 --override hidden_size=64 --override mlp_dim=128 \
      --override num_heads=4 --override num_layers=4 --steps 20   # the quickstart's step
  python benchmarks/cpu_devices.py --models ViT-Ti_16,ViT-B_16 --batch 32,8 --steps 4
"""
import tempfile

import harness

parser = harness.argument_parser(__doc__)
harness.add_model_args(parser, dtypes='float32', steps=3)
harness.add_allocator_arg(parser)
parser.add_argument('--devices', type=int, default=2, help='the split side: CPU devices')
parser.add_argument('--out', default='')
args = parser.parse_args()


def _train_step(env, model, batch, dtype, devices, workdir):
  """(img/s, peak RSS GiB, its machine record) of one `train_step.py` process on `devices`
  devices."""
  payload = harness.train_step_process(args, model, batch, dtype, env, workdir,
                                       ['--mesh', str(devices)])
  return payload['results'][0]['img_s_median'], payload['peak_rss_gib'], payload['machine']


def main():
  if args.devices < 2:
    raise SystemExit(f'--devices {args.devices}: give 2 or more (the side set against 1)')
  env = harness.jax_environment(args.allocator)
  sides = (1, args.devices)
  load_start = harness.loadavg()
  results = []
  with tempfile.TemporaryDirectory() as workdir:
    for model, batch in harness.model_batches(args):
      harness.check_batch_splits(batch, args.devices)
      for dtype in args.dtypes.split(','):
        row = {'model': model, 'batch': batch, 'dtype': dtype}
        for key in ('img_s', 'peak_rss_gib', 'device_count'):
          row[key] = {devices: [] for devices in sides}
        for r in range(args.rounds):
          for devices in sides:
            img_s, rss, machine = _train_step(env, model, batch, dtype, devices, workdir)
            row['img_s'][devices].append(img_s)
            row['peak_rss_gib'][devices].append(rss)
            row['device_count'][devices].append(machine['device_count'])
            row['xla_flags'] = machine['xla_flags']
          print(f'{model} b{batch} {dtype}: round {r + 1}/{args.rounds} done', flush=True)
        one, split = row['img_s'][1], row['img_s'][args.devices]
        row['ratio_per_round'] = [y / x for x, y in zip(one, split)]
        results.append(row)
  n = args.devices
  rows = [[
      x['model'], x['batch'], x['dtype'],
      harness.fmt_range(x['img_s'][1]),
      harness.fmt_range(x['img_s'][n]), ', '.join(f'{v:.2f}' for v in x['ratio_per_round']),
      harness.fmt_range(x['peak_rss_gib'][1]),
      harness.fmt_range(x['peak_rss_gib'][n])
  ] for x in results]
  print(f'\n### train step: the CPU as 1 device and as {n}\n')
  print(
      harness.markdown_table([
          'model', 'batch', 'dtype', 'img/s 1 device', f'img/s {n} devices', f'{n} / 1 per pair',
          'peak RSS GiB 1', f'peak RSS GiB {n}'
      ], rows))
  if results:
    print(f'\nXLA_FLAGS {results[-1]["xla_flags"]!r}')
  harness.end_of_processes_run('cpu_devices', args, env, load_start, results)


if __name__ == '__main__':
  main()
