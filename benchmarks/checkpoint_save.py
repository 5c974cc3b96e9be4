r"""What one checkpoint save of the train state costs: packed, as vit_jax saves, against
every array saved as itself (orbax's tree of the state, as vit_jax saved it before).

  python benchmarks/checkpoint_save.py --out /tmp/checkpoint_save.json

The state is the loop's (vit_jax.step.create_train_state: parameters, SGD momentum, step)
for each of --models. Each save goes to an orbax manager as the loop's
(`checkpoint.train_state_manager`), with the checksums the loop stores; the first save of
each side is untimed. Timed: the call on the caller's thread (what the loop waits for), and
the whole save until written (`wait_until_finished`), in wall seconds and CPU seconds of the
process (every thread: orbax's and TensorStore's writers too). Sides alternate, the first
side swapping each round; ratio per round: the CPU of the save as itself over packed.
"""
import os
import resource
import shutil
import tempfile
import time

import bare_step
import harness
import jax
import orbax.checkpoint as ocp

from vit_jax import checkpoint
from vit_jax import models
from vit_jax import optim
from vit_jax import sharding
from vit_jax import step as step_lib

parser = harness.argument_parser(__doc__)
parser.add_argument('--models', default='ViT-Ti_16,ViT-B_16')
parser.add_argument('--rounds', type=harness.positive_int, default=6)
parser.add_argument('--override', action='append', default=[],
                    help='variant field, e.g. --override num_layers=2 (repeatable)')
parser.add_argument('--out', default='')
args = parser.parse_args()


def cpu_s():
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def save_packed(manager, step, state):
  checkpoint.save_train_state(manager, step, state, force=True)


def save_each_array_as_itself(manager, step, state):
  manager.save(step, args=ocp.args.StandardSave(state), force=True,
               custom_metadata={'vit_jax_checksums': checkpoint.state_checksums(state)})


SIDES = {'packed': save_packed, 'as itself': save_each_array_as_itself}


def timed_save(save, directory, state):
  """{call/total wall/CPU s, saved arrays, MB on disk} of a second save into a new manager."""
  manager = checkpoint.train_state_manager(directory, 2)
  save(manager, 0, state)  # untimed: orbax's first save sets itself up
  manager.wait_until_finished()
  wall, cpu = time.perf_counter(), cpu_s()
  save(manager, 1, state)
  call_wall, call_cpu = time.perf_counter() - wall, cpu_s() - cpu
  manager.wait_until_finished()
  result = {
      'call_wall_s': call_wall,
      'call_cpu_s': call_cpu,
      'total_wall_s': time.perf_counter() - wall,
      'total_cpu_s': cpu_s() - cpu,
      'saved_arrays': len(jax.tree.leaves(manager.item_metadata(1))),
      'disk_mb': sum(
          os.path.getsize(os.path.join(root, f))
          for root, _, files in os.walk(os.path.join(directory, '1')) for f in files) / 1e6
  }
  manager.close()
  return result


def train_state(model_name):
  config = bare_step.make_config(model_name, 8, model_overrides=bare_step.overrides(args.override))
  tx = optim.make_optimizer(config, optim.total_steps(config))
  model = models.from_config(config, 1000)
  state, _ = step_lib.create_train_state(config, model, tx, sharding.make_mesh(config), 1000)
  del state['guard']  # never saved (train.py)
  return state


def main():
  bare_step.setup(1)
  load_start = harness.loadavg()
  tmp = tempfile.mkdtemp(prefix='vit_bench_ckpt_')
  results = []
  try:
    for model_name in args.models.split(','):
      state = train_state(model_name)
      runs = {side: [] for side in SIDES}
      for r in range(args.rounds):
        order = list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]
        for side in order:
          runs[side].append(timed_save(SIDES[side], os.path.join(tmp, f'{r}_{side}'), state))
          shutil.rmtree(os.path.join(tmp, f'{r}_{side}'))
        print(
            f'{model_name} round {r + 1}/{args.rounds}: '
            + ', '.join(f'{side} {runs[side][-1]["total_cpu_s"]:.3f} CPU s' for side in SIDES),
            flush=True)
      leaves = jax.tree.leaves(state)
      results.append({
          'model': model_name,
          'arrays': len(leaves),
          'mb': sum(x.nbytes for x in leaves) / 1e6,
          'runs': runs,
          'ratio_cpu_per_round': [
              a['total_cpu_s'] / p['total_cpu_s'] for a, p in zip(runs['as itself'], runs['packed'])
          ],
      })
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  load_end = harness.loadavg()
  series = lambda res, side, key: [run[key] for run in res['runs'][side]]
  rows = []
  for res in results:
    for side in SIDES:
      rows.append([
          res['model'], f'{res["arrays"]} ({res["mb"]:.1f} MB)', side,
          series(res, side, 'saved_arrays')[0],
          harness.fmt_range(series(res, side, 'call_cpu_s'), '.3f'),
          harness.fmt_range(series(res, side, 'total_cpu_s'), '.3f'),
          harness.fmt_range(series(res, side, 'total_wall_s'),
                            '.3f'), f'{series(res, side, "disk_mb")[0]:.1f}',
          ', '.join(f'{x:.2f}' for x in res['ratio_cpu_per_round']) if side == 'packed' else ''
      ])
  print(f'\n### one checkpoint save of the train state ({harness.cores()} cores; median '
        '(min–max) over rounds)\n')
  print(
      harness.markdown_table([
          'model', 'state arrays', 'saved', 'arrays saved', 'call CPU s', 'save CPU s',
          'save wall s', 'MB on disk', 'CPU as itself / packed, per round'
      ], rows))
  print(f'\nloadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  harness.write_json(
      args.out, {
          'benchmark': 'checkpoint_save',
          'machine': bare_step.machine_info(),
          'args': vars(args),
          'loadavg_start': load_start,
          'loadavg_end': load_end,
          'results': results
      })


if __name__ == '__main__':
  main()
