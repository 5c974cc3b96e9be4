r"""The train step with YNNPACK fusions on (XLA's default) and off, per dtype: the evidence
for vit_jax/xla_cpu_flags.py's choice per dtype, and beside it what that module's start-up
probe (a ViT-B-shaped block) says on this host, so the two can be compared.

XLA reads its flags once per process, so each side runs `train_step.py` in its own
process (VIT_JAX_XLA_CPU_FLAGS=0 for "XLA defaults", XLA_FLAGS=<the YNNPACK-off flag> for
the other), interleaved per model and round: A B A B ..., and the ratio is taken per pair.

  python benchmarks/ynnpack.py --out /tmp/ynnpack.json
"""
import os
import tempfile

import harness

from vit_jax import xla_cpu_flags

parser = harness.argument_parser(__doc__)
harness.add_model_args(parser, dtypes='float32', steps=3)
parser.add_argument('--probe_rounds', type=int, default=4,
                    help="rounds of vit_jax.xla_cpu_flags.probe() after the steps (0: none)")
parser.add_argument('--out', default='')
args = parser.parse_args()

SIDES = {'xla defaults': '', 'ynnpack off': xla_cpu_flags.YNNPACK_OFF}


def _train_step(model, batch, dtype, xla_flags, workdir):
  env = {
      **os.environ, 'VIT_JAX_XLA_CPU_FLAGS': '0',
      'TF_CPP_MIN_LOG_LEVEL': '2',
      'XLA_FLAGS': xla_flags
  }
  payload = harness.train_step_process(args, model, batch, dtype, env, workdir, ['--peak', '1e12'])
  return payload['results'][0]['img_s_median'], payload['machine']['xla_flags']


def main():
  load_start = harness.loadavg()
  results = []
  with tempfile.TemporaryDirectory() as workdir:
    for model, batch in harness.model_batches(args):
      for dtype in args.dtypes.split(','):
        row = {
            'model': model,
            'batch': batch,
            'dtype': dtype,
            'img_s': {
                s: [] for s in SIDES
            },
            'xla_flags': {}
        }
        for r in range(args.rounds):
          for side, xla_flags in SIDES.items():
            img_s, flags = _train_step(model, batch, dtype, xla_flags, workdir)
            row['img_s'][side].append(img_s)
            row['xla_flags'][side] = flags
          print(f'{model} b{batch} {dtype}: round {r + 1}/{args.rounds} done', flush=True)
        a, b = row['img_s']['xla defaults'], row['img_s']['ynnpack off']
        row['ratio_per_round'] = [y / x for x, y in zip(a, b)]
        cli_flags, row['cli_reason'] = xla_cpu_flags.choose(dict(os.environ), dtype)
        row['cli_side'] = 'ynnpack off' if xla_cpu_flags.YNNPACK_OFF in cli_flags else 'xla defaults'
        results.append(row)
  probe = xla_cpu_flags.probe(rounds=args.probe_rounds) if args.probe_rounds else None
  load_end = harness.loadavg()
  rows = [[
      x['model'], x['batch'], x['dtype'],
      harness.fmt_range(x['img_s']['xla defaults']),
      harness.fmt_range(x['img_s']['ynnpack off']),
      ', '.join(f'{v:.2f}' for v in x['ratio_per_round']), x['cli_side']
  ] for x in results]
  print('\n### train step: YNNPACK fusions off vs XLA defaults\n')
  print(
      harness.markdown_table([
          'model', 'batch', 'dtype', 'img/s XLA defaults', 'img/s YNNPACK off',
          'off / defaults per pair', 'the CLI runs'
      ], rows))
  print(f'\nYNNPACK off: {xla_cpu_flags.YNNPACK_OFF!r}')
  if probe:
    print('start-up probe (ViT-B-shaped block), YNNPACK off/on per round: '
          + ', '.join(f'{r:.2f}' for r in probe.get('off_over_on', ()))
          + f'; verdict: {probe.get("verdict") or probe.get("error")}')
  print(f'loadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  harness.write_json(
      args.out, {
          'benchmark': 'ynnpack',
          'args': vars(args),
          'loadavg_start': load_start,
          'loadavg_end': load_end,
          'results': results,
          'probe': probe
      })


if __name__ == '__main__':
  main()
