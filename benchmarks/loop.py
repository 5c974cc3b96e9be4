r"""The real training loop vs the bare step: how much do data, metrics and checkpoints cost?

  python benchmarks/loop.py --out /tmp/loop.json

Loop: vit_jax.train.train_and_evaluate on `dataset='folder:<tmp>'`, ImageNet-sized JPEGs
written by tests/data_fixtures.write_jpegs (inception crop 224 + flip, tf.data, prefetch to
the mesh), metrics logged every --log_every steps, an orbax checkpoint every
--checkpoint_every steps (and at the stop), SGD momentum + clip. Its throughput is the one
the loop itself reports (img/s over steps 2..N, from the end of the compiled first step to
the last metrics fetch; intermediate checkpoints included), read from its metric writer.
No evaluation runs (eval_every_steps=0, stopped before total_steps). Each loop run gets a
fresh workdir; a persistent compilation cache keeps runs after the first from recompiling.
Bare: the same model, batch and optimizer via vit_jax.train.make_train_step on a random
device-resident batch, mean img/s over as many steps. Runs alternate loop, bare, loop, ...
"""
import argparse
import os
import shutil
import tempfile
import time

import _common

parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
parser.add_argument('--model', default='ViT-Ti_16')
parser.add_argument('--batch', type=int, default=32)
parser.add_argument('--dtype', default='float32')
parser.add_argument('--image_size', type=int, default=224)
parser.add_argument('--steps', type=int, default=9, help='loop steps per run (first: compile)')
parser.add_argument('--rounds', type=int, default=2)
parser.add_argument('--images', type=int, default=256, help='JPEGs written (375x500)')
parser.add_argument('--jpeg_size', default='375,500', help='height,width of the JPEGs')
parser.add_argument('--log_every', type=int, default=4)
parser.add_argument('--checkpoint_every', type=int, default=4)
parser.add_argument('--override', action='append', default=[],
                    help='variant field, e.g. --override num_layers=2 (repeatable)')
parser.add_argument('--out', default='')
args = parser.parse_args()

_common.setup_devices(1)
import jax  # noqa: E402  pylint: disable=wrong-import-position
from clu import metric_writers  # noqa: E402  pylint: disable=wrong-import-position
import _jaxstep  # noqa: E402  pylint: disable=wrong-import-position
from tests import data_fixtures  # noqa: E402  pylint: disable=wrong-import-position
from vit_jax import input_pipeline  # noqa: E402  pylint: disable=wrong-import-position
from vit_jax import train  # noqa: E402  pylint: disable=wrong-import-position


class _Recorder:
  """Forwards to the loop's usual writer and keeps what it writes."""

  def __init__(self, writer, log):
    self._writer, self._log = writer, log

  def write_scalars(self, step, scalars):
    self._log.append((int(step), {k: float(v) for k, v in scalars.items()}))
    return self._writer.write_scalars(step, scalars)

  def __getattr__(self, name):
    return getattr(self._writer, name)


def run_loop(config, tmp):
  log = []
  workdir = tempfile.mkdtemp(dir=tmp, prefix='loop_')
  writer = _Recorder(metric_writers.create_default_writer(workdir), log)
  try:
    t = time.perf_counter()
    result = train.train_and_evaluate(config, workdir, stop_after_steps=args.steps,
                                      writer=writer)
    wall = time.perf_counter() - t
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  rates = [(s, m['img_per_sec_per_core'] * jax.device_count()) for s, m in log
           if 'img_per_sec_per_core' in m]
  assert result['step'] == args.steps, result
  return rates[-1][1], wall, rates


def main():
  load_start = _common.loadavg()
  tmp = tempfile.mkdtemp(prefix='vit_bench_loop_')
  jax.config.update('jax_compilation_cache_dir', os.path.join(tmp, 'jax_cache'))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  try:
    data = os.path.join(tmp, 'data')
    h, w = (int(x) for x in args.jpeg_size.split(','))
    data_fixtures.write_jpegs(data, args.images, height=h, width=w)
    overrides = _common.parse_overrides(args.override)
    config = _jaxstep.make_config(args.model, args.batch, dtype=args.dtype,
                                  image_size=args.image_size, overrides=overrides)
    config.dataset = f'folder:{data}'
    config.train_split = 'train'
    config.eval_split = 'train'
    config.num_classes = 1000  # the bare step's head; the folder's 4 labels fit in it
    config.shuffle_buffer = args.images
    config.log_every_steps = args.log_every
    config.checkpoint_every_steps = args.checkpoint_every if args.checkpoint_every else 10**9
    config.eval_every_steps = 0
    config.keep_checkpoints = 2
    bare = _jaxstep.BareStep(config, num_classes=1000)
    bare.run(1)

    loop_rates, bare_rates, walls, logs = [], [], [], []
    for r in range(args.rounds):
      rate, wall, log = run_loop(config, tmp)
      loop_rates.append(rate)
      walls.append(wall)
      logs.append(log)
      times = bare.run(args.steps - 1)
      bare_rates.append(args.batch * len(times) / sum(times))
      print(f'round {r + 1}/{args.rounds}: loop {rate:.2f} img/s (run {wall:.0f} s with '
            f'set-up), bare {bare_rates[-1]:.2f} img/s', flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
    input_pipeline._source.cache_clear()  # pylint: disable=protected-access

  ratio = [a / b for a, b in zip(loop_rates, bare_rates)]
  load_end = _common.loadavg()
  med = _common.summary(ratio)['median']
  payload = {'benchmark': 'loop', 'machine': _common.machine_info(), 'args': vars(args),
             'loadavg_start': load_start, 'loadavg_end': load_end,
             'loop_img_s_per_round': loop_rates, 'bare_img_s_per_round': bare_rates,
             'loop_over_bare_per_round': ratio, 'loop_over_bare_median': med,
             'loop_wall_s_with_setup': walls, 'loop_logged_rates': logs,
             'target_within_5pct_met': med >= 0.95,
             'skipped_examples': input_pipeline.skipped_examples()}
  print(f'\n### loop vs bare step ({args.model}, batch {args.batch}, {args.dtype}, '
        f'{args.steps} steps per run)\n')
  print(_common.markdown_table(
      ['round', 'loop img/s', 'bare img/s', 'loop / bare'],
      [[i + 1, f'{a:.2f}', f'{b:.2f}', f'{c:.3f}']
       for i, (a, b, c) in enumerate(zip(loop_rates, bare_rates, ratio))]))
  print(f'\nloop / bare: median {med:.3f} (min {min(ratio):.3f}, max {max(ratio):.3f}); '
        f'target ≥0.95: {"met" if med >= 0.95 else "MISSED"}; '
        f'loadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  _common.write_json(args.out, payload)


if __name__ == '__main__':
  main()
