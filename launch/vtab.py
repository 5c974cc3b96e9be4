r"""VTAB-1k: fine-tune one model on the 19 tasks, then the per-task table and the group means.

  vit-vtab --model=ViT-B_16 --workdir=DIR [--tasks=dtd,clevr_count,...] [--dev]
      [--config.FIELD=VALUE ...] [--dry-run] [--summarize-only]

Task t runs as vit-train runs it, `python -P -m vit_jax.main
--config=finetune:<model>,vtab/<t> --workdir=DIR/<t>` with the --config.* overrides (-P: the
installed vit_jax, not a checkout in the current directory), one task after another (its
output also in DIR/<t>/vtab.log). A task whose DIR/<t>/final.npz exists is finished and
skipped; any other starts, or resumes from its checkpoints. A failed task is recorded and
the others go on. Then DIR/vtab_results.md and DIR/vtab_results.json: each finished task's
final top-1 accuracy on its test split (with --dev: on val200, the configs' development
protocol), the mean of the natural, specialized and structured tasks and the overall mean
over all tasks: the layout of the paper's Table 9 (per task) and Figure 2 (groups). The
overall VTAB score is the mean over the tasks, not the mean of the three group means; a mean
over fewer tasks than its group has says how many it has.
"""
import argparse
import difflib
import json
import shlex
import sys

from vit_jax import cli_help
from vit_jax import console_scripts
from vit_jax import configs
from vit_jax import ctrl_c
from vit_jax import models
from vit_jax import paths
from vit_jax import vtab
from vit_jax.configs import finetune
from vit_jax.launch import sweep

RESULTS = 'vtab_results'  # DIR/vtab_results.md and .json
# Which task a task's config is: an override would train and evaluate every task on the same
# dataset and report it under the tasks' names. (The splits are left free, as other fields of
# the protocol are: the tests run on small ones.)
TASK_FIELDS = ('vtab_task', 'dataset', 'num_classes')


class VtabError(Exception):
  """A bad argument; main prints it as one line."""


def parse_tasks(spec):
  """'dtd,clevr_count' -> ['dtd', 'clevr_count'] (table order); None (no --tasks) -> all 19."""
  if spec is None:
    return vtab.task_names()
  choose = f'choose among {",".join(vtab.VTAB)}, or leave --tasks out for all 19'
  asked = [t.strip() for t in spec.split(',') if t.strip()]
  if not asked:
    raise VtabError(f'--tasks {spec!r} names no task: {choose}')
  unknown = [t for t in asked if t not in vtab.VTAB]
  if unknown:
    close = difflib.get_close_matches(unknown[0].lower(), vtab.VTAB, n=3)
    hint = f' (did you mean {", ".join(close)}?)' if close else ''
    what = 'is not a VTAB-1k task' if len(unknown) == 1 else 'are not VTAB-1k tasks'
    raise VtabError(f'--tasks {spec!r}: {", ".join(unknown)} {what}{hint}; {choose}')
  return [t for t in vtab.task_names() if t in asked]


def check_model(model):
  """A model name vit-train knows (the variant table of vit_jax.models), else VtabError."""
  if model in models.VARIANTS:
    return
  close = difflib.get_close_matches(model, models.VARIANTS, n=3, cutoff=0.5)
  hint = f'did you mean {", ".join(close)}? ' if close else ''
  raise VtabError(f'--model {model!r} is not a model of vit_jax.models: {hint}e.g. '
                  f'{", ".join(finetune.MODELS)} (the ones with a published checkpoint)')


def task_config(model, task, dev):
  return f'finetune:{model},vtab/{task}' + (',dev' if dev else '')


def task_argv(model, task, dev, workdir, overrides, python=sys.executable):
  """The vit-train command line of one task."""
  return [
      python, '-P', '-m', 'vit_jax.main', f'--config={task_config(model, task, dev)}',
      f'--workdir={sweep.join(workdir, task)}', *overrides
  ]


def check_task_models(workdir, model, tasks):
  """Refuses a task folder whose run (its config.json) is of another model than `model`: a
  finished one is skipped and its accuracy reported as `model`'s (a workdir reused for a
  second model had reported the first one's results under the second's name, exit 0)."""
  for task in tasks:
    task_dir = sweep.join(workdir, task)
    recorded = _recorded_model(sweep.join(task_dir, 'config.json'))
    if recorded is not None and recorded != model:
      raise VtabError(f'{task_dir} holds a run of {recorded}, not of --model={model}: use another '
                      f'--workdir for {model} (--model={recorded} summarizes that one)')


def check_finished_configs(workdir, task_configs):
  """A finished task is skipped and its accuracy reported under this command's flags, so its
  run must be of this config as vit-train would check it on a resume (another base_lr, say,
  had been reported as this one's); an unfinished one is checked by its own vit-train."""
  finished = [(task, c) for task, c in task_configs if is_finished(sweep.join(workdir, task))]
  if not finished:
    return  # TensorFlow stays unloaded (a --dry-run answers at once)
  # pylint: disable=g-import-not-at-top,unused-import
  from vit_jax import tensorflow_quietly  # noqa: F401  (TF without its start-up notices)
  from vit_jax import rundir  # (loads TF)
  # pylint: enable=g-import-not-at-top,unused-import
  for task, c in finished:
    try:
      rundir.check_resume_config(rundir.with_absolute_paths(c), sweep.join(workdir, task))
    except ValueError as e:
      raise VtabError(f'task {task}: {e}') from None


def _recorded_model(path):
  """config.json's model_name; None where there is none to read (vit-train reports a
  damaged file itself)."""
  try:
    if not paths.exists(path):
      return None
    with paths.open_file(path, 'r') as f:
      return json.load(f).get('model_name')
  except Exception:  # pylint: disable=broad-except  (a remote file's errors are TensorFlow's)
    return None


def is_finished(task_dir):
  return paths.exists(sweep.join(task_dir, 'final.npz'))


def run_tasks(args, tasks, overrides, runner=sweep.run_local, out=None):
  """Runs each unfinished task in turn; returns {task: status}."""
  out = out or sys.stdout
  statuses = {}
  with sweep.held(args.workdir) as after_a_killed_run, ctrl_c.terminate_like_ctrl_c():
    for i, task in enumerate(tasks):
      statuses[task] = _run_task(args, tasks, i, overrides, runner, out, after_a_killed_run)
  return statuses


def _run_task(args, tasks, i, overrides, runner, out, after_a_killed_run=False):
  """Runs task `i` of `tasks` unless it finished; returns its status."""
  task = tasks[i]
  task_dir = sweep.join(args.workdir, task)
  if is_finished(task_dir):
    print(f'== vtab task {i + 1}/{len(tasks)}: {task}: final.npz present, skipped', file=out,
          flush=True)
    return 'done'
  argv = task_argv(args.model, task, args.dev, args.workdir, overrides)
  print(f'== vtab task {i + 1}/{len(tasks)}: {task}\n{shlex.join(argv)}', file=out, flush=True)
  paths.makedirs(task_dir)
  if after_a_killed_run:
    sweep.wait_for_a_stopping_run(task_dir, 'vtab.log', out, killed='vit-vtab')
  try:
    rc = runner(argv, sweep.join(task_dir, 'vtab.log'))
  except OSError as e:
    rc = f'{type(e).__name__}: {e}'
  except KeyboardInterrupt as e:
    raise sweep.interrupted(
        e, 'task', i, len(tasks), task,
        'the tasks: finished ones are skipped, this one resumes from its last checkpoint') from None
  status = sweep.point_status(rc)
  why = sweep.why_killed(rc, flag='--config.', in_another_workdir=False)
  print(f'== {task}: {status}{why}', file=out, flush=True)
  if rc != 0:
    sweep.stop_if_every_point_would_fail(sweep.join(task_dir, 'vtab.log'), 'task', task)
  return status


def collect(workdir, tasks, statuses=None):
  """Rows {task, group, status, accuracy, steps}: the accuracy of finished tasks only (an
  unfinished run's last evaluation is not its result)."""
  statuses = statuses or {}
  rows = []
  for task in tasks:
    task_dir = sweep.join(workdir, task)
    finished = is_finished(task_dir)
    accuracy = sweep.read_accuracy(task_dir) if finished else []
    status = statuses.get(task) or ('done' if finished else
                                    'not finished' if paths.exists(task_dir) else 'not run')
    rows.append({
        'task': task,
        'group': vtab.VTAB[task].group,
        'status': status,
        'accuracy': accuracy[-1][1] if accuracy else None,
        'steps': accuracy[-1][0] if accuracy else None
    })
  return rows


def means(rows):
  """{group or 'overall': {'mean', 'tasks' (with an accuracy), 'of' (asked)}}."""
  out = {}
  for name in (*vtab.GROUPS, 'overall'):
    asked = [r for r in rows if name in ('overall', r['group'])]
    values = [r['accuracy'] for r in asked if r['accuracy'] is not None]
    out[name] = {
        'mean': sum(values) / len(values) if values else None,
        'tasks': len(values),
        'of': len(asked)
    }
  return out


def _percent(value):
  return '-' if value is None else f'{100 * value:.2f}'


def markdown(model, dev, rows, group_means):
  split = 'val200 (dev)' if dev else 'test'
  lines = [
      f'# VTAB-1k: {model}, top-1 accuracy (%) on each task\'s {split} split', '',
      '| group | task | accuracy | steps | status |', '|---|---|---|---|---|'
  ]
  lines += [
      f'| {r["group"]} | {r["task"]} | {_percent(r["accuracy"])} | '
      f'{"-" if r["steps"] is None else r["steps"]} | {r["status"]} |' for r in rows
  ]
  names = (*vtab.GROUPS, 'overall')
  lines += ['', '| ' + ' | '.join(names) + ' |', '|' + '---|' * len(names)]
  cells = []
  for name in names:
    m = group_means[name]
    size = len(vtab.task_names(None if name == 'overall' else name))
    cells.append(_percent(m['mean']) + ('' if m['tasks'] == size else f' ({m["tasks"]} of {size})'))
  lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def write_results(args, rows):
  """DIR/vtab_results.md and .json; returns the markdown."""
  group_means = means(rows)
  text = markdown(args.model, args.dev, rows, group_means)
  with paths.open_file(sweep.join(args.workdir, f'{RESULTS}.md'), 'w') as f:
    f.write(text)
  record = {
      'model': args.model,
      'split': 'val200' if args.dev else 'test',
      'tasks': rows,
      'means': group_means
  }
  with paths.open_file(sweep.join(args.workdir, f'{RESULTS}.json'), 'w') as f:
    json.dump(record, f, indent=1)
    f.write('\n')
  return text


class _Parser(argparse.ArgumentParser):

  def error(self, message):
    raise VtabError(message)


def parser():
  p = _Parser(
      prog='vit-vtab', description=__doc__.split('\n')[0],
      epilog='Any --config.FIELD=VALUE is passed to every task\'s vit-train and checked '
      'before the first task starts; the fields and their values: vit-train '
      '--config=finetune:ViT-B_16,vtab/dtd --help.')
  p.register('action', None, cli_help.StoreOnce)  # a flag given twice is refused
  p.add_argument('--model', required=True, help='a finetune.py model, e.g. ViT-B_16')
  p.add_argument('--workdir', required=True, help='one sub-directory per task (may be gs://)')
  p.add_argument('--tasks', default=None, help='comma-separated VTAB-1k tasks (default: all 19)')
  p.add_argument('--dev', action='store_true',
                 help='train on train800, evaluate on val200 (the development protocol)')
  p.add_argument('--dry-run', '--dry_run', dest='dry_run', action='store_true',
                 help='print the commands, run nothing')
  p.add_argument('--summarize-only', '--summarize_only', dest='summarize_only', action='store_true',
                 help='only read the results and write the tables')
  return p


def main(argv=None, runner=sweep.run_local, out=None):
  """The CLI; `runner(argv, log_path) -> exit code` runs one task (tests may inject one)."""
  out = out or sys.stdout
  try:
    args, overrides = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    bad = [a for a in overrides if not a.startswith('--config.')]
    if bad:
      raise VtabError(f'unknown argument {bad[0]!r}: pass config fields as --config.FIELD=VALUE')
    for arg in overrides:
      field = arg[len('--config.'):].split('=', 1)[0]
      if field == 'model_name':
        raise VtabError('--config.model_name: vit-vtab takes the model as --model=NAME')
      if field in TASK_FIELDS:
        raise VtabError(f'--config.{field} is set by each task from its VTAB definition: leave it '
                        'out; vit-train --config=finetune:MODEL,vtab/TASK '
                        f'--config.{field}=... runs one task on other data')
    try:
      paths.resolve_run_folder(args.workdir, example='workdirs/vtab')
    except ValueError as e:
      raise VtabError(str(e)) from None
    check_model(args.model)
    tasks = parse_tasks(args.tasks)
    check_task_models(args.workdir, args.model, tasks)
    task_configs = []
    for task in tasks:  # Each task's config with the overrides, as vit-train will build it.
      try:
        task_configs.append((task, configs.load(task_config(args.model, task, args.dev),
                                                overrides)))
      except ValueError as e:
        raise VtabError(str(e).splitlines()[0]) from None
    if not args.summarize_only:  # A bad value or workdir stops here, not every task in turn.
      try:
        sweep.preflight(task_configs, what='task', config_flag='--config.')
        sweep.check_workdir(args.workdir, create=False)  # a file in the way: before the data
        if not args.dry_run:  # A dataset not prepared stops here too, as in vit-sweep.
          unfinished = [(task, c) for task, c in task_configs
                        if not is_finished(sweep.join(args.workdir, task))]
          sweep.check_data(unfinished, what='task', config_flag='--config.')
        sweep.check_workdir(args.workdir, create=not args.dry_run)
      except sweep.SweepError as e:
        raise VtabError(str(e)) from None
    # Also in a summary, which reports the finished tasks under this command's flags.
    check_finished_configs(args.workdir, task_configs)
    statuses = None
    if args.dry_run:
      for task in tasks:
        skip = '# final.npz present, skipped: ' if is_finished(sweep.join(args.workdir,
                                                                          task)) else ''
        print(skip + shlex.join(task_argv(args.model, task, args.dev, args.workdir, overrides)),
              file=out)
      return
    if args.summarize_only:
      if not paths.exists(args.workdir):
        raise VtabError(f'nothing to summarize in {args.workdir}: it does not exist; run without '
                        '--summarize-only first (or pass the --workdir of that run)')
    else:
      statuses = run_tasks(args, tasks, overrides, runner, out)
    print(write_results(args, collect(args.workdir, tasks, statuses)), file=out)
    failed = [t for t, s in (statuses or {}).items() if s.startswith('failed')]
    if failed:
      sys.exit(f'vit-vtab: {len(failed)} of {len(tasks)} tasks failed (the table lists them): see '
               f'{sweep.join(sweep.join(args.workdir, failed[0]), "vtab.log")}')
  except (VtabError, sweep.SweepError) as e:
    sys.exit(f'vit-vtab: error: {e}')
  except sweep.SweepInterrupted as e:
    ctrl_c.stop_with(f'vit-vtab: {e}', e.status)
  except KeyboardInterrupt:  # between tasks, or while checking or summarizing
    ctrl_c.interrupted('vit-vtab')


if __name__ == '__main__':
  console_scripts.run_as_main(main, 'vit-vtab')
