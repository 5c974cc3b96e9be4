r"""The real training loop vs the bare step: how much do data, metrics and checkpoints cost?

  python benchmarks/loop.py --out /tmp/loop.json

Loop: vit_jax.train.train_and_evaluate on `dataset='folder:<tmp>'`, ImageNet-sized JPEGs
written by tests/data_fixtures.write_jpegs (inception crop 224 + flip, tf.data, prefetch to
the mesh), metrics logged every --log_every steps, an orbax checkpoint every
--checkpoint_every steps (and at the stop), SGD momentum + clip, --prefetch batches on the
device. Its throughput is timed from outside, by the metric writer it is given: the wall
time between its first and its last metric write (each follows a device sync), so the
steps between (with their input, metrics and intermediate checkpoints) count, and the
compiling first step and the final save do not. The loop's own report (img/s/core) is
kept beside it. No evaluation runs (eval_every_steps=0, stopped before total_steps). Each
loop run gets a fresh workdir; a persistent compilation cache keeps runs after the first
from recompiling. Bare: the same model, batch and optimizer (bare_step.BareStep:
vit_jax.step's create_train_state and jit, as the loop uses them) on a random batch, over
as many steps. Runs alternate loop, bare, loop, ... With --normal_priority_too, each round
also runs the loop with the input pipeline's threads at normal priority
(vit_jax/pipeline_priority.py off), and the order of the three rotates per round.
"""
import os
import shutil
import sys
import tempfile
import time

import bare_step
import harness
import jax

from tests import data_fixtures
from vit_jax import pipeline_priority
from vit_jax import tensorboard_events
from vit_jax import train

parser = harness.argument_parser(__doc__)
# One model and one dtype; --models and --dtypes (the other scripts' names, which shared
# error messages name) are the same flags.
parser.add_argument('--model', '--models', default='ViT-Ti_16', help='one model')
parser.add_argument('--batch', type=harness.positive_int, default=32)
parser.add_argument('--dtype', '--dtypes', default='float32', help='one dtype')
parser.add_argument('--image_size', type=harness.positive_int, default=224)
parser.add_argument('--steps', type=harness.positive_int, default=13,
                    help='loop steps per run (first: compile)')
parser.add_argument('--rounds', type=harness.positive_int, default=2)
parser.add_argument('--images', type=harness.positive_int, default=256,
                    help='JPEGs written (375x500)')
parser.add_argument('--jpeg_size', default='375,500', type=harness.height_width,
                    help='height,width of the JPEGs')
parser.add_argument('--log_every', type=harness.positive_int, default=4)
parser.add_argument('--checkpoint_every', type=int, default=4)
parser.add_argument('--prefetch', type=int, default=2, help='config.prefetch')
parser.add_argument('--override', action='append', default=[],
                    help='variant field, e.g. --override num_layers=2 (repeatable)')
parser.add_argument('--normal_priority_too', action='store_true',
                    help="also the loop with tf.data's threads at normal CPU priority")
parser.add_argument('--out', default='')
args = parser.parse_args()
for flag, value in (('--model', args.model), ('--dtype', args.dtype)):
  if ',' in value:
    sys.exit(f'loop.py: {flag} {value}: one at a time here: run loop.py once per value')


class _Recorder:
  """Forwards to the loop's usual writer and keeps what it writes, and when."""

  def __init__(self, writer, log):
    self._writer, self._log = writer, log

  def write_scalars(self, step, scalars):
    self._log.append((time.perf_counter(), time.process_time(), int(step), {
        k: float(v) for k, v in scalars.items()
    }))
    return self._writer.write_scalars(step, scalars)

  def __getattr__(self, name):
    return getattr(self._writer, name)


def run_loop(config, tmp):
  log = []
  workdir = tempfile.mkdtemp(dir=tmp, prefix='loop_')
  writer = _Recorder(tensorboard_events.EventWriter(workdir), log)
  try:
    t = time.perf_counter()
    result = train.train_and_evaluate(config, workdir, stop_after_steps=args.steps, writer=writer)
    wall = time.perf_counter() - t
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  assert result['step'] == args.steps, result
  (t_first, cpu_first, s_first, _), (t_last, cpu_last, s_last, _) = log[0], log[-1]
  if s_last <= s_first:
    raise SystemExit(f'--steps {args.steps} with --log_every {args.log_every}: the loop logs '
                     'once only; give more steps or log more often')
  own = [(s, m['img_per_sec_per_core'] * jax.device_count()) for _, _, s, m in log
         if 'img_per_sec_per_core' in m]
  steps = s_last - s_first
  return steps * args.batch / (t_last - t_first), (cpu_last - cpu_first) / steps, steps, wall, own


def cpu_over_bare(loop_cpu, bare_cpu):
  """The loop's CPU seconds per step over the bare step's, per round, as signed percentages:
  median (min–max)."""
  return harness.fmt_range([lc / bc - 1 for lc, bc in zip(loop_cpu, bare_cpu)], '+.1%')


def main():
  bare_step.setup(1, (args.dtype,))
  load_start = harness.loadavg()
  tmp = tempfile.mkdtemp(prefix='vit_bench_loop_')
  jax.config.update('jax_compilation_cache_dir', os.path.join(tmp, 'jax_cache'))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  try:
    data = os.path.join(tmp, 'data')
    h, w = args.jpeg_size
    data_fixtures.write_jpegs(data, args.images, height=h, width=w)
    config = bare_step.make_config(args.model, args.batch, dtype=args.dtype,
                                   image_size=args.image_size,
                                   model_overrides=bare_step.overrides(args.override))
    config.dataset = f'folder:{data}'
    config.train_split = 'train'
    config.eval_split = 'train'
    # Both sides with the folder's head (vit-train refuses a head larger than the dataset's
    # classes; the 1000-class head this had shared differs by <0.1% of ViT-Ti/16's FLOPs).
    classes = len(os.listdir(os.path.join(data, 'train')))
    config.num_classes = classes
    config.shuffle_buffer = args.images
    config.log_every_steps = args.log_every
    config.checkpoint_every_steps = args.checkpoint_every if args.checkpoint_every else 10**9
    config.eval_every_steps = 0
    config.keep_checkpoints = 2
    config.prefetch = args.prefetch
    bare = bare_step.BareStep(config, num_classes=classes)
    bare.run(1)

    loop_rates, bare_rates, walls, logs = [], [], [], []
    loop_cpu, bare_cpu = [], []  # CPU seconds (all threads of this process) per step
    normal_rates, normal_cpu = [], []  # the loop at normal priority (--normal_priority_too)
    sides = ['loop', 'bare'] + (['normal'] if args.normal_priority_too else [])
    timed = None  # the steps the loop times (between its first and last metric write)
    for r in range(args.rounds):
      # Round 1 runs the loop first: the bare step runs as many steps as it timed.
      for side in sides[r % len(sides):] + sides[:r % len(sides)]:
        if side == 'bare':
          cpu = time.process_time()
          times = bare.run(timed)
          bare_cpu.append((time.process_time() - cpu) / timed)
          bare_rates.append(args.batch * len(times) / sum(times))
          continue
        pipeline_priority.ENABLED = side == 'loop'
        try:
          rate, cpu, timed, wall, log = run_loop(config, tmp)
        finally:
          pipeline_priority.ENABLED = True
        if side == 'normal':
          normal_rates.append(rate)
          normal_cpu.append(cpu)
          continue
        loop_rates.append(rate)
        loop_cpu.append(cpu)
        walls.append(wall)
        logs.append(log)
      print(
          f'round {r + 1}/{args.rounds}: loop {loop_rates[-1]:.2f} img/s, bare '
          f'{bare_rates[-1]:.2f}' +
          (f', loop at normal priority {normal_rates[-1]:.2f}' if normal_rates else ''), flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)

  ratio = [a / b for a, b in zip(loop_rates, bare_rates)]
  load_end = harness.loadavg()
  med = harness.summary(ratio)['median']
  payload = {
      'benchmark': 'loop',
      'machine': bare_step.machine_info(),
      'args': vars(args),
      'loadavg_start': load_start,
      'loadavg_end': load_end,
      'loop_img_s_per_round': loop_rates,
      'bare_img_s_per_round': bare_rates,
      'loop_over_bare_per_round': ratio,
      'loop_over_bare_median': med,
      'loop_cpu_s_per_step': loop_cpu,
      'bare_cpu_s_per_step': bare_cpu,
      'loop_wall_s_with_setup': walls,
      'loop_own_rates': logs,
      'target_0p97_met': med >= 0.97,
      'normal_priority_img_s_per_round': normal_rates,
      'normal_priority_cpu_s_per_step': normal_cpu,
      'normal_priority_over_bare_per_round': [a / b for a, b in zip(normal_rates, bare_rates)]
  }
  print(f'\n### loop vs bare step ({args.model}, batch {args.batch}, {args.dtype}, '
        f'{args.steps} steps per run)\n')
  print(
      harness.markdown_table([
          'round', 'loop img/s', 'bare img/s', 'loop / bare', 'CPU s/step loop', 'CPU s/step bare',
          "loop's own report img/s"
      ], [[
          i + 1, f'{a:.2f}', f'{b:.2f}', f'{c:.3f}', f'{lc:.3f}', f'{bc:.3f}', ', '.join(
              f'{r:.2f}' for _, r in own)
      ] for i, (a, b, c, lc, bc,
                own) in enumerate(zip(loop_rates, bare_rates, ratio, loop_cpu, bare_cpu, logs))]))
  print(f'\nloop CPU time per step over the bare step\'s: {cpu_over_bare(loop_cpu, bare_cpu)} '
        '(with the step using every core, the loop can be at most that much slower; less '
        'where it fills cores the step leaves idle)')
  print(f'\nloop / bare: median {med:.3f} (min {min(ratio):.3f}, max {max(ratio):.3f}); '
        f'target ≥0.97: {"met" if med >= 0.97 else "MISSED"}; '
        f'loadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  if normal_rates:
    normal = payload['normal_priority_over_bare_per_round']
    shipped = [a / b for a, b in zip(loop_rates, normal_rates)]
    print(f"\nthe loop with tf.data's threads at normal priority / bare: "
          f"{', '.join(f'{x:.3f}' for x in normal)} (median "
          f"{harness.summary(normal)['median']:.3f}); the loop as shipped over it per round: "
          f"{', '.join(f'{x:.3f}' for x in shipped)}")
  harness.write_json(args.out, payload)


if __name__ == '__main__':
  main()
