r"""The train step with YNNPACK fusions on (XLA's default) and off, per dtype: the evidence
for vit_jax/xla_cpu_flags.py's choice per dtype (the table says which side the CLI takes).

XLA reads its flags once per process, so each side runs `train_step.py` in its own
process (VIT_JAX_XLA_CPU_FLAGS=0 for "XLA defaults", XLA_FLAGS=<the YNNPACK-off flag> for
the other), interleaved per model and round: A B A B ..., and the ratio is taken per pair.

  python benchmarks/xla_cpu_flags.py --out /tmp/xla_cpu_flags.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import _common

parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
_common.add_model_args(parser, dtypes='float32', steps=3)
parser.add_argument('--out', default='')
args = parser.parse_args()

from vit_jax import xla_cpu_flags  # noqa: E402  pylint: disable=wrong-import-position

SIDES = {'xla defaults': '', 'ynnpack off': xla_cpu_flags.YNNPACK_OFF}


def _train_step(model, batch, dtype, xla_flags, workdir):
  out = os.path.join(workdir, 'step.json')
  env = {**os.environ, 'VIT_JAX_XLA_CPU_FLAGS': '0', 'TF_CPP_MIN_LOG_LEVEL': '2',
         'XLA_FLAGS': xla_flags}
  cmd = [sys.executable, os.path.join(os.path.dirname(__file__), 'train_step.py'),
         '--models', model, '--batch', str(batch), '--dtypes', dtype,
         '--image_size', str(args.image_size), '--steps', str(args.steps), '--rounds', '1',
         '--matmul_n', '256', '--out', out]
  for o in args.override:
    cmd += ['--override', o]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  if proc.returncode:
    sys.exit(f'train_step.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}')
  with open(out) as f:
    payload = json.load(f)
  return payload['results'][0]['img_s_median'], payload['machine']['xla_flags']


def main():
  load_start = _common.loadavg()
  results = []
  with tempfile.TemporaryDirectory() as workdir:
    for model, batch in _common.model_batches(args):
      for dtype in args.dtypes.split(','):
        row = {'model': model, 'batch': batch, 'dtype': dtype,
               'img_s': {s: [] for s in SIDES}, 'xla_flags': {}}
        for r in range(args.rounds):
          for side, xla_flags in SIDES.items():
            img_s, flags = _train_step(model, batch, dtype, xla_flags, workdir)
            row['img_s'][side].append(img_s)
            row['xla_flags'][side] = flags
          print(f'{model} b{batch} {dtype}: round {r + 1}/{args.rounds} done', flush=True)
        a, b = row['img_s']['xla defaults'], row['img_s']['ynnpack off']
        row['ratio_per_round'] = [y / x for x, y in zip(a, b)]
        row['cli_side'] = ('ynnpack off' if xla_cpu_flags.YNNPACK_OFF
                           in xla_cpu_flags.FLAGS_BY_DTYPE[dtype] else 'xla defaults')
        results.append(row)
  load_end = _common.loadavg()
  rows = [[x['model'], x['batch'], x['dtype'], _common.fmt_range(x['img_s']['xla defaults']),
           _common.fmt_range(x['img_s']['ynnpack off']),
           ', '.join(f'{v:.2f}' for v in x['ratio_per_round']), x['cli_side']] for x in results]
  print('\n### train step: YNNPACK fusions off vs XLA defaults\n')
  print(_common.markdown_table(
      ['model', 'batch', 'dtype', 'img/s XLA defaults', 'img/s YNNPACK off',
       'off / defaults per pair', 'the CLI runs'], rows))
  print(f'\nYNNPACK off: {xla_cpu_flags.YNNPACK_OFF!r}')
  print(f'loadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  _common.write_json(args.out, {
      'benchmark': 'xla_cpu_flags', 'args': vars(args), 'loadavg_start': load_start,
      'loadavg_end': load_end, 'results': results})


if __name__ == '__main__':
  main()
