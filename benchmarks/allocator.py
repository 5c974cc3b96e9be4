r"""The train step under the C library's malloc and under jemalloc as `vit-train` preloads it
(vit_jax/host_allocator.py): img/s, page faults and kernel CPU per process, peak RSS.

An allocator is chosen when a process starts, so each side runs `train_step.py` in its own
process (jemalloc: LD_PRELOAD and MALLOC_CONF as vit-train sets them), interleaved per
model and round: A B A B ..., and the ratio is taken per pair. Needs a libjemalloc.so.2
(Debian/Ubuntu: apt-get install libjemalloc2). Under jemalloc each step waits for its
temporaries to be freed, as the loop's does (vit_jax/host_memory.py); --without_wait adds a
third side, jemalloc with no wait. Peak RSS is listed per run: a run either keeps one
buffer of temporaries or two.

  python benchmarks/allocator.py --out /tmp/allocator.json
  python benchmarks/allocator.py --models ViT-B_16 --batch 8 --remat nothing_saveable
  python benchmarks/allocator.py --models R50+ViT-B_16 --batch 8 --rounds 4 --without_wait
"""
import os
import resource
import sys
import tempfile

import harness

from vit_jax import host_allocator

parser = harness.argument_parser(__doc__)
harness.add_model_args(parser, steps=3)
parser.add_argument('--remat', default='', help="one remat policy for both sides ('' = off)")
parser.add_argument('--library', default='jemalloc',
                    help='the second side: jemalloc (found as vit-train finds it) or a path')
parser.add_argument('--without_wait', action='store_true',
                    help='a third side: jemalloc without the wait for the temporaries')
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
  sides = {'malloc': (base, []), 'jemalloc': (jemalloc, [])}
  if args.without_wait:
    sides['jemalloc, no wait'] = (jemalloc, ['--no-heap_wait'])
  return sides


def _train_step(model, batch, env, flags, workdir):
  """One train_step.py run under `env`: its JSON result, and its page faults and CPU."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  payload = harness.train_step_process(args, model, batch, args.dtypes, {
      **env, 'TF_CPP_MIN_LOG_LEVEL': '2'
  }, workdir, ['--remat', args.remat, '--peak', '1e12', *flags])
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  return {
      'img_s': payload['results'][0]['img_s_median'],
      'heap_wait': payload['results'][0]['heap_wait'],
      'peak_rss_gib': payload['peak_rss_gib'],
      'host_allocator': payload['machine']['host_allocator'],  # as the process saw it
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
        for side, (env, flags) in sides.items():
          row['runs'][side].append(_train_step(model, batch, env, flags, workdir))
        print(f'{model} b{batch}: round {r + 1}/{args.rounds} done', flush=True)
      base = row['runs']['malloc']
      row['over_malloc_per_round'] = {
          s: [y['img_s'] / x['img_s'] for x, y in zip(base, runs)]
          for s, runs in row['runs'].items() if s != 'malloc'
      }
      results.append(row)
  load_end = harness.loadavg()

  def col(runs, key, spec='.2f'):
    return harness.fmt_range([x[key] for x in runs], spec)

  rows = []
  for x in results:
    for side, runs in x['runs'].items():
      rows.append([
          x['model'], x['batch'], side,
          col(runs, 'img_s'),
          ', '.join(f'{v:.2f}' for v in x['over_malloc_per_round'].get(side, [])),
          col(runs, 'minor_faults', '.0f'),
          col(runs, 'sys_s', '.1f'), ', '.join(f'{r["peak_rss_gib"]:.2f}' for r in runs)
      ])
  print(f'\n### train step ({args.dtypes}, remat={args.remat!r}): C library malloc vs jemalloc\n')
  print(
      harness.markdown_table([
          'model', 'batch', 'allocator', 'img/s', 'over malloc per pair', 'page faults per run',
          'kernel CPU s per run', 'peak RSS GiB per run'
      ], rows))
  for x in results:
    for run in x['runs']['jemalloc']:
      print(f'{x["model"]} b{x["batch"]} jemalloc: {run["heap_wait"] or "no wait"}')
  jemalloc = sides['jemalloc'][0]
  print(f'\njemalloc: LD_PRELOAD={jemalloc["LD_PRELOAD"]} '
        f'MALLOC_CONF={jemalloc["MALLOC_CONF"]}; per run = one train_step.py process '
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
              } for s, (e, _) in sides.items()
          },
          'results': results
      })


if __name__ == '__main__':
  main()
