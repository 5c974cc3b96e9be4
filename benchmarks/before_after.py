r"""The train step with the models' ordered dots (vit_jax/models/precision.py) against
the order XLA gets otherwise: the evidence for precision.py's choices on this host.

  float32:  flax's own dots (what float32 models had before) vs `float32_dot_general`
  bfloat16: every weight gradient as lhs^T g vs `_cotangent_transposed_is_cheaper`'s order

Both variants are traced and compiled in one process under the XLA:CPU flags the CLI uses
for the dtype (one --dtypes per run), then timed in alternating rounds (A B, B A, ...);
the ratio is taken per round.

  python benchmarks/ordered_dots.py --dtypes float32 --rounds 3
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python benchmarks/ordered_dots.py
"""
import argparse
import contextlib
import statistics

import bare_step
import harness
import jax.numpy as jnp

from vit_jax.models import precision

parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
harness.add_model_args(parser, dtypes='float32', steps=3)
parser.add_argument('--out', default='')
args = parser.parse_args()


@contextlib.contextmanager
def _unordered(dtype):
  """While tracing: the dots as they were before precision.py ordered them for `dtype`."""
  if jnp.dtype(dtype) == jnp.float32:
    name, shipped = 'dot_general_for', precision.dot_general_for
    replacement = lambda d: None if jnp.dtype(d) == jnp.float32 else shipped(d)
  else:
    name, shipped = '_cotangent_transposed_is_cheaper', precision._cotangent_transposed_is_cheaper  # pylint: disable=protected-access
    replacement = lambda *unused: False
  setattr(precision, name, replacement)
  try:
    yield
  finally:
    setattr(precision, name, shipped)


def _gib(value):
  return '?' if value is None else f'{value:.2f}'


def main():
  dtypes = args.dtypes.split(',')
  bare_step.setup(1, dtypes)
  load_start = harness.loadavg()
  results = []
  for model, batch in harness.model_batches(args):
    for dtype in dtypes:
      config = bare_step.make_config(model, batch, dtype=dtype, image_size=args.image_size,
                                     model_overrides=bare_step.overrides(args.override))
      with _unordered(dtype):
        before = bare_step.BareStep(config)
      ordered = bare_step.BareStep(config)
      before.run(1)
      ordered.run(1)
      img_s = {'before': [], 'ordered': []}
      for r in range(args.rounds):
        sides = [('before', before), ('ordered', ordered)]
        for side, step in sides if r % 2 == 0 else sides[::-1]:
          img_s[side].append(batch / statistics.median(step.run(args.steps)))
        print(f'{model} b{batch} {dtype}: round {r + 1}/{args.rounds} done', flush=True)
      results.append({
          'model': model,
          'batch': batch,
          'dtype': dtype,
          'img_s': img_s,
          'ratio_per_round': [b / a for a, b in zip(img_s['before'], img_s['ordered'])],
          'xla_memory_gib': {
              'before': before.memory_gib,
              'ordered': ordered.memory_gib
          },
          # The (g^T x)^T weight gradients in each step (precision.py's barrier; XLA:CPU
          # drops barriers once it has compiled, so they are counted in the lowered step).
          'barriers': {
              side: step.lowered.as_text().count('optimization_barrier')
              for side, step in (('before', before), ('ordered', ordered))
          }
      })
  load_end = harness.loadavg()
  rows = [[
      x['model'], x['batch'], x['dtype'],
      harness.fmt_range(x['img_s']['before']),
      harness.fmt_range(x['img_s']['ordered']), ', '.join(f'{v:.3f}' for v in x['ratio_per_round']),
      ' / '.join(_gib(x['xla_memory_gib'][side]) for side in ('before', 'ordered'))
  ] for x in results]
  print('\n### train step: ordered dots vs before\n')
  print(
      harness.markdown_table([
          'model', 'batch', 'dtype', 'img/s before', 'img/s ordered', 'ordered / before per round',
          'XLA planned GiB before / ordered'
      ], rows))
  print(f'\nXLA_FLAGS: {bare_step.machine_info()["xla_flags"]!r}')
  print(f'loadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  harness.write_json(
      args.out, {
          'benchmark': 'ordered_dots',
          'args': vars(args),
          'machine': bare_step.machine_info(),
          'loadavg_start': load_start,
          'loadavg_end': load_end,
          'results': results
      })


if __name__ == '__main__':
  main()
