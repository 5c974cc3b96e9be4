r"""The bfloat16 train step against vit_jax's own float32 step (issue 16: bf16 >= 1.6x).

XLA:CPU reads its flags once per process and vit_jax chooses them per dtype
(vit_jax/xla_cpu_flags.py), so each side runs `train_step.py --dtypes D` in its own process,
under the allocator vit-train preloads, interleaved per model and round (float32 bfloat16
float32 ...); the ratio is taken per pair. Each side's MFU (against its own dtype's peak, as
the loop reports it), XLA flags and peak RSS are beside it.

  python benchmarks/bf16_over_f32.py --out /tmp/bf16_over_f32.json   # ~25 min on 2 cores
  python benchmarks/bf16_over_f32.py --models ViT-Ti_16 --batch 32 --rounds 5
  python benchmarks/bf16_over_f32.py --models ViT-Ti_16 --batch 32 --devices 2  # both split
"""
import tempfile

import harness

TARGET = 1.6  # bf16 img/s over float32's, the median of the pairs (issue 16)
SIDES = ('float32', 'bfloat16')

parser = harness.argument_parser(__doc__)
harness.add_model_args(parser, dtypes=None, steps=3)
harness.add_allocator_arg(parser)
parser.add_argument(
    '--devices', type=harness.positive_int, default=1,
    help="CPU devices of both sides, as config.cpu_devices (train_step.py's --mesh)")
parser.add_argument('--out', default='')
args = parser.parse_args()


def main():
  env = harness.jax_environment(args.allocator)
  load_start = harness.loadavg()
  results, machine = [], {}
  with tempfile.TemporaryDirectory() as workdir:
    for model, batch in harness.model_batches(args):
      harness.check_batch_splits(batch, args.devices)
      row = {'model': model, 'batch': batch, 'devices': args.devices, 'xla_flags': {}}
      for key in ('img_s', 'mfu', 'peak_rss_gib'):
        row[key] = {dtype: [] for dtype in SIDES}
      for r in range(args.rounds):
        for dtype in SIDES:
          payload = harness.train_step_process(args, model, batch, dtype, env, workdir,
                                               ['--mesh', str(args.devices)])
          step = payload['results'][0]
          row['img_s'][dtype].append(step['img_s_median'])
          row['mfu'][dtype].append(step['mfu_per_round'][0])
          row['peak_rss_gib'][dtype].append(payload['peak_rss_gib'])
          row['xla_flags'][dtype] = payload['machine']['xla_flags']
          row['device_count'] = payload['machine']['device_count']
          machine = payload['machine']
        print(f'{model} b{batch}: round {r + 1}/{args.rounds} done', flush=True)
      row['ratio_per_round'] = [b / f for f, b in zip(*(row['img_s'][d] for d in SIDES))]
      row['ratio_median'] = harness.summary(row['ratio_per_round'])['median']
      row['target_met'] = row['ratio_median'] >= TARGET
      results.append(row)
  rows = [[
      x['model'], x['batch'],
      harness.fmt_range(x['img_s']['float32']),
      harness.fmt_range(x['img_s']['bfloat16']),
      harness.fmt_range([100 * m for m in x['mfu']['float32']], '.1f'),
      harness.fmt_range([100 * m for m in x['mfu']['bfloat16']],
                        '.1f'), ', '.join(f'{v:.2f}' for v in x['ratio_per_round']),
      f'{x["ratio_median"]:.2f}', 'met' if x['target_met'] else 'MISSED',
      harness.fmt_range(x['peak_rss_gib']['float32']),
      harness.fmt_range(x['peak_rss_gib']['bfloat16'])
  ] for x in results]
  print('\n### train step: bfloat16 over float32, each in its own process\n')
  print(
      harness.markdown_table([
          'model', 'batch', 'img/s float32', 'img/s bfloat16', 'MFU % float32', 'MFU % bfloat16',
          'bf16 / f32 per pair', 'median', f'≥{TARGET}×', 'peak RSS GiB float32',
          'peak RSS GiB bfloat16'
      ], rows))
  if results:
    for dtype in SIDES:
      print(f'XLA_FLAGS {dtype}: {results[-1]["xla_flags"][dtype]!r}')
    print(f'devices per side: {results[-1]["device_count"]}')
  harness.end_of_processes_run('bf16_over_f32', args, env, load_start, results, target=TARGET,
                               machine=machine)


if __name__ == '__main__':
  main()
