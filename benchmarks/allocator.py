r"""The train step under the C library's malloc and under jemalloc as `vit-train` preloads it
(vit_jax/host_allocator.py): img/s, page faults and kernel CPU per process, peak RSS.

An allocator is chosen when a process starts, so each side runs `train_step.py` in its own
process (jemalloc: LD_PRELOAD and MALLOC_CONF as vit-train sets them), interleaved per
model and round: A B A B ..., and the ratio is taken per pair. Needs a libjemalloc.so.2
(Debian/Ubuntu: apt-get install libjemalloc2).

  python benchmarks/allocator.py --out /tmp/allocator.json
  python benchmarks/allocator.py --models ViT-B_16 --batch 8 --remat nothing_saveable
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import harness

from vit_jax import host_allocator

parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
harness.add_model_args(parser, steps=3)
parser.add_argument('--remat', default='', help="one remat policy for both sides ('' = off)")
parser.add_argument('--library', default='jemalloc',
                    help='the second side: jemalloc (found as vit-train finds it) or a path')
parser.add_argument('--out', default='')
args = parser.parse_args()


def _sides():
  base = {k: v for k, v in os.environ.items() if k not in ('LD_PRELOAD', 'MALLOC_CONF')}
  base[host_allocator.CHOICE] = 'system'
  try:
    jemalloc = host_allocator.reexec_environment({**base, host_allocator.CHOICE: args.library})
  except ValueError as e:  # not installed
    sys.exit(str(e))
  if jemalloc is None:
    sys.exit('a TPU/GPU plugin is installed: the host allocator is not the step\'s')
  return {'malloc': base, 'jemalloc': jemalloc}


def _train_step(model, batch, env, workdir):
  """One train_step.py run under `env`: its JSON result, and its page faults and CPU."""
  out = os.path.join(workdir, 'step.json')
  cmd = [
      sys.executable,
      os.path.join(os.path.dirname(__file__), 'train_step.py'), '--models', model, '--batch',
      str(batch), '--dtypes', args.dtypes, '--image_size',
      str(args.image_size), '--steps',
      str(args.steps), '--rounds', '1', '--remat', args.remat, '--peak', '1e12', '--out', out
  ]
  for o in args.override:
    cmd += ['--override', o]
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  proc = subprocess.run(cmd, env={
      **env, 'TF_CPP_MIN_LOG_LEVEL': '2'
  }, capture_output=True, text=True, check=False)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  if proc.returncode:
    sys.exit(f'train_step.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}')
  with open(out) as f:
    payload = json.load(f)
  return {
      'img_s': payload['results'][0]['img_s_median'],
      'peak_rss_gib': payload['peak_rss_gib'],
      # Whole process: compile and warm-up included.
      'minor_faults': after.ru_minflt - before.ru_minflt,
      'sys_s': after.ru_stime - before.ru_stime,
      'user_s': after.ru_utime - before.ru_utime,
  }


def main():
  sides = _sides()
  load_start = harness.loadavg()
  results = []
  with tempfile.TemporaryDirectory() as workdir:
    for model, batch in harness.model_batches(args):
      row = {'model': model, 'batch': batch, 'runs': {s: [] for s in sides}}
      for r in range(args.rounds):
        for side, env in sides.items():
          row['runs'][side].append(_train_step(model, batch, env, workdir))
        print(f'{model} b{batch}: round {r + 1}/{args.rounds} done', flush=True)
      a, b = row['runs']['malloc'], row['runs']['jemalloc']
      row['ratio_per_round'] = [y['img_s'] / x['img_s'] for x, y in zip(a, b)]
      results.append(row)
  load_end = harness.loadavg()

  def col(runs, key, spec='.2f'):
    return harness.fmt_range([x[key] for x in runs], spec)

  rows = []
  for x in results:
    a, b = x['runs']['malloc'], x['runs']['jemalloc']
    rows.append([
        x['model'], x['batch'],
        col(a, 'img_s'),
        col(b, 'img_s'), ', '.join(f'{v:.2f}' for v in x['ratio_per_round']),
        f'{col(a, "minor_faults", ".0f")} / {col(b, "minor_faults", ".0f")}',
        f'{col(a, "sys_s", ".1f")} / {col(b, "sys_s", ".1f")}',
        f'{col(a, "peak_rss_gib")} / {col(b, "peak_rss_gib")}'
    ])
  print(f'\n### train step ({args.dtypes}, remat={args.remat!r}): C library malloc vs jemalloc\n')
  print(
      harness.markdown_table([
          'model', 'batch', 'img/s malloc', 'img/s jemalloc', 'jemalloc / malloc per pair',
          'page faults per run malloc / jemalloc', 'kernel CPU s per run', 'peak RSS GiB'
      ], rows))
  print(f'\njemalloc: LD_PRELOAD={sides["jemalloc"]["LD_PRELOAD"]} '
        f'MALLOC_CONF={sides["jemalloc"]["MALLOC_CONF"]}; per run = one train_step.py process '
        f'(compile, warm-up and {args.steps} timed steps)')
  print(f'loadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  harness.write_json(
      args.out, {
          'benchmark': 'allocator',
          'args': vars(args),
          'loadavg_start': load_start,
          'loadavg_end': load_end,
          'environments': {
              s: {
                  k: e.get(k, '') for k in ('LD_PRELOAD', 'MALLOC_CONF')
              } for s, e in sides.items()
          },
          'results': results
      })


if __name__ == '__main__':
  main()
