"""launch/sweep.py: grids, the argv of each point, summaries from event files, a real sweep."""
import csv
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest

from vit_jax import parent_death
from vit_jax import tensorboard_events
from vit_jax.launch import sweep
from tests import data_fixtures
from tests.conftest import console_script
from tests.conftest import CTRL_C_AS_IN_A_TERMINAL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINETUNE = 'configs/finetune.py:ViT-B_16,cifar10,dev'


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
  monkeypatch.chdir(REPO)  # Config paths are relative to the repository root.


def write_accuracy(directory, values):
  """Event files as train.py writes them (scalar 'accuracy')."""
  writer = tensorboard_events.EventWriter(str(directory))
  for step, value in values:
    writer.write_scalars(step, {'accuracy': value, 'loss': 1.0})
  writer.close()


@pytest.mark.parametrize('spec,expected', [
    ('config.base_lr=[0.001,0.003, 0.01]', ('base_lr', [0.001, 0.003, 0.01])),
    ('base_lr=[1e-3, 3e-3]', ('base_lr', [0.001, 0.003])),
    ('config.warmup_steps=[100,500]', ('warmup_steps', [100, 500])),
    ('config.pp.train_crop=[resize, inception]', ('pp.train_crop', ['resize', 'inception'])),
    ("config.pp.train_crop=['resize','inception']", ('pp.train_crop', ['resize', 'inception'])),
    ('config.fsdp=[True,False]', ('fsdp', [True, False])),
    ('config.model.dropout_rate=[0.0,0.1]', ('model.dropout_rate', [0.0, 0.1])),
])
def test_parse_sweep(spec, expected):
  assert sweep.parse_sweep(spec) == expected


@pytest.mark.parametrize('spec', [
    'config.base_lr', 'config.base_lr=0.1', 'config.base_lr=[]', 'config.base_lr=[0.1,,0.2]',
    'config.base lr=[0.1]', '=[0.1]', 'config.base_lr=(0.1,0.2)'
])
def test_parse_sweep_errors(spec):
  with pytest.raises(sweep.SweepError, match='--sweep') as e:
    sweep.parse_sweep(spec)
  assert '\n' not in str(e.value)


def test_grid_product_and_names():
  config = sweep.load_config(FINETUNE)
  grid = sweep.build_grid(config,
                          ['config.base_lr=[0.01,0.03]', 'config.pp.train_crop=[resize,inception]'])
  points = sweep.grid_points(grid)
  assert [name for name, _ in points] == [
      'base_lr=0.01,pp.train_crop=resize', 'base_lr=0.01,pp.train_crop=inception',
      'base_lr=0.03,pp.train_crop=resize', 'base_lr=0.03,pp.train_crop=inception'
  ]
  assert points[1][1] == [('base_lr', 0.01), ('pp.train_crop', 'inception')]
  assert sweep.point_name([('x', 'a/b c'), ('y', (1, 2))]) == 'x=a_b_c,y=_1,_2_'
  with pytest.raises(sweep.SweepError, match='swept twice'):
    sweep.build_grid(config, ['config.base_lr=[0.1]', 'base_lr=[0.2]'])


def test_default_grid_is_the_lr_grid_of_table4():
  config = sweep.load_config(FINETUNE)
  assert sweep.build_grid(config, []) == [('base_lr', [0.001, 0.003, 0.01, 0.03])]
  imagenet = sweep.load_config('configs/finetune.py:ViT-L_16,imagenet2012')
  assert sweep.build_grid(imagenet, []) == [('base_lr', [0.003, 0.01, 0.03, 0.06])]
  with pytest.raises(sweep.SweepError, match=r"no lr_grid: pass --sweep 'config.base_lr"):
    sweep.build_grid(sweep.load_config('configs/quickstart.py'), [])


def test_dry_run_argv_per_point(capsys):
  sweep.main([
      f'--config={FINETUNE}', '--workdir=/tmp/sw', '--set', 'config.total_steps=1000', '--dry-run'
  ])
  lines = capsys.readouterr().out.splitlines()
  assert [shlex.split(line) for line in lines] == [[
      sys.executable, '-P', '-m', 'vit_jax.main', f'--config={FINETUNE}',
      f'--workdir=/tmp/sw/base_lr={lr}', '--config.total_steps=1000', f'--config.base_lr={lr}'
  ] for lr in ('0.001', '0.003', '0.01', '0.03')]
  assert not os.path.exists('/tmp/sw/base_lr=0.001')


def test_a_variant_field_the_config_does_not_list_is_swept(capsys):
  sweep.main([
      f'--config={FINETUNE}', '--workdir=/tmp/sw', '--sweep', 'config.model.num_layers=[1,2]',
      '--set', 'config.model.classifier=gap', '--dry-run'
  ])
  lines = capsys.readouterr().out.splitlines()
  assert [shlex.split(line)[-3:] for line in lines] == [[
      f'--workdir=/tmp/sw/model.num_layers={n}', '--config.model.classifier=gap',
      f'--config.model.num_layers={n}'
  ] for n in (1, 2)]


def test_preflight_leaves_the_accelerator_to_the_points(tmp_path):
  """vit-sweep checks every point's config without starting a JAX backend (on a TPU VM that
  would hold the TPU its points need): with a platform this machine lacks, it still runs."""
  env = dict(os.environ, JAX_PLATFORMS='tpu')
  p = subprocess.run([
      os.path.join(os.path.dirname(sys.executable),
                   'vit-sweep'), '--config=finetune:ViT-B_16,cifar10,dev', '--workdir=sw',
      '--sweep', 'config.batch_size=[256,512]', '--dry-run'
  ], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert len(p.stdout.splitlines()) == 2 and os.listdir(tmp_path) == []


def test_data_not_prepared_stops_a_local_sweep_before_its_first_point(tmp_path):

  def runner(argv, log_path):
    raise AssertionError(f'a point ran: {argv}')

  workdir = tmp_path / 'sw'
  with pytest.raises(SystemExit) as e:
    sweep.main([
        f'--config={FINETUNE}', f'--workdir={workdir}', '--set',
        f'config.data_dir={tmp_path / "tfds"}'
    ], runner=runner)
  assert str(e.value).startswith(
      'vit-sweep: error: point base_lr=0.001: dataset cifar10 is not '
      f'prepared in data_dir {tmp_path / "tfds"}: run `vit-tfds-build'), e.value
  # The flag as vit-sweep takes it: it had named --config.data_dir, which vit-sweep refuses.
  assert str(e.value).endswith('or set --set config.data_dir to where it is prepared.'), e.value
  assert '\n' not in str(e.value) and not workdir.exists()


@pytest.mark.parametrize('dry_run', [True, False])
def test_a_workdir_that_is_a_file_stops_the_sweep_at_once(tmp_path, dry_run):
  (tmp_path / 'afile').write_text('')

  def runner(argv, log_path):
    raise AssertionError(f'a point ran: {argv}')

  with pytest.raises(SystemExit) as e:
    sweep.main(
        ['--config=quickstart', f'--workdir={tmp_path}/afile', '--sweep', 'config.base_lr=[0.1]']
        + ['--dry-run'] * dry_run, runner=runner)
  assert str(e.value) == (f'vit-sweep: error: cannot create workdir {tmp_path}/afile: '
                          f'{tmp_path}/afile is not a directory: choose a writable --workdir'
                          if not dry_run else f'vit-sweep: error: --workdir {tmp_path}/afile: '
                          f'{tmp_path}/afile is not a directory: choose another --workdir')


def test_tpu_sweep_chains_the_points(capsys):
  sweep.main([
      '--config=configs/finetune.py:R50+ViT-B_16,cifar10', '--workdir=gs://b/sw', '--sweep',
      'config.base_lr=[0.01,0.03]', '--tpu', 'vit', '--zone', 'us-central2-b', '--dry-run'
  ])
  [line] = capsys.readouterr().out.splitlines()
  cmd = shlex.split(line)
  assert cmd[:-1] == [
      'gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'vit', '--zone', 'us-central2-b',
      '--worker=all', '--command'
  ]
  words = shlex.split(cmd[-1])
  body = shlex.split(words[words.index('-c') + 1])
  for lr in ('0.01', '0.03'):
    argv = [
        'python3', '-m', 'vit_jax.main', '--config=configs/finetune.py:R50+ViT-B_16,cifar10',
        f'--workdir=gs://b/sw/base_lr={lr}', f'--config.base_lr={lr}'
    ]
    i = body.index(argv[-2])
    assert body[i - 4:i + 2] == argv
    assert f'$HOME/vit_jax_logs/sweep-base_lr={lr}.log' in body
  with pytest.raises(SystemExit, match='--tpu needs --workdir=gs://'):
    sweep.main([
        f'--config={FINETUNE}', '--workdir=/tmp/sw', '--tpu', 'vit', '--zone', 'us-central2-b',
        '--dry-run'
    ])


@pytest.mark.parametrize(
    'argv,message',
    [
        (['--config=configs/quickstart.py', '--workdir=w'], 'no lr_grid'),
        (['--config=configs/nope.py', '--workdir=w'], 'no config file configs/nope.py'),
        ([f'--config={FINETUNE}', '--workdir=w', '--sweep', 'config.base_lrr=[1]'
         ], "config.base_lrr: the config has no field 'base_lrr' (did you mean base_lr?)"),
        ([f'--config={FINETUNE}', '--workdir=w', '--set', 'config.model=ViT-L_16'
         ], 'config.model is a group of fields (attention_dropout_rate, dropout_rate, ...): set '
         'one as config.model.FIELD=VALUE; a model variant is chosen with config.model_name='),
        # The flag a value came from: --sweep had been called --set.
        ([f'--config={FINETUNE}', '--workdir=w', '--sweep', 'config.batch_size=[0,4]'
         ], 'point batch_size=0: preflight (devices not checked): batch_size 0 must be > 0: set '
         '--sweep config.batch_size'),
        ([f'--config={FINETUNE}', '--workdir=w', '--set', 'config.batch_size=0'
         ], 'batch_size 0 must be > 0: set --set config.batch_size'),
        ([f'--config={FINETUNE}', '--workdir=w', '--set', 'config.total_steps'], "--set"),
        ([f'--config={FINETUNE}', '--workdir=w', '--set', 'config.base_lr=0.1'], 'both --set and'),
        ([f'--config={FINETUNE}', '--workdir=w', '--tpu', 'vit'], '--tpu needs --zone'),
        # Without --tpu the points would train on this machine.
        ([f'--config={FINETUNE}', '--workdir=w', '--zone', 'us-central2-b'
         ], 'vit-sweep: error: --zone only with --tpu: add --tpu NAME to run on that TPU VM, or '
         'drop it to run here'),
        ([f'--config={FINETUNE}', '--workdir=w', '--zone', 'us-central2-b', '--project', 'p'
         ], '--zone and --project only with --tpu: add --tpu NAME to run on that TPU VM, or drop '
         'them to run here'),
        # Values are checked before any point trains (vit-train refused them only at its point).
        ([f'--config={FINETUNE}', '--workdir=w', '--sweep', 'config.base_lr=[0.001,abc]'
         ], 'config.base_lr=abc: expected a number'),
        ([f'--config={FINETUNE}', '--workdir=w', '--set', 'config.batch_size=1.5'
         ], 'config.batch_size=1.5: expected an integer'),
        ([f'--config={FINETUNE}', '--workdir=w', '--set', 'config.fsdp=maybe'
         ], 'config.fsdp=maybe: expected true or false'),
        # Strings, tuples and ranges: vit-train's start-up checks of every point, up front.
        ([f'--config={FINETUNE}', '--workdir=w', '--sweep', 'config.dtype=[float32,bf16]'
         ], "point dtype=bf16: preflight (devices not checked): dtype 'bf16' is unknown"),
        ([f'--config={FINETUNE}', '--workdir=w', '--sweep', 'config.model.dropout_rate=[0.1,1.0]'
         ], 'point model.dropout_rate=1.0: preflight (devices not checked): model.dropout_rate'),
        # Variant fields the config does not list: checked against the variant, per point.
        ([f'--config={FINETUNE}', '--workdir=w', '--sweep', 'config.model.num_layers=[2,0]'
         ], 'point model.num_layers=0: preflight (devices not checked): model.num_layers 0 must'),
        ([f'--config={FINETUNE}', '--workdir=w', '--set', 'config.model.num_layer=2'
         ], "--config.model.num_layer: model ViT-B_16 has no field 'num_layer' (did you mean"),
        ([
            f'--config={FINETUNE}', '--workdir=w', '--set', 'config.fewshot_every_steps=10',
            '--set', 'config.fewshot_shots=(0,5)'
        ], 'fewshot_shots (0, 5) is not a tuple of whole numbers'),
        (['--workdir=w'], 'required: --config'),
        ([f'--config={FINETUNE}', '--workdir=', '--sweep', 'config.base_lr=[0.1,0.2]'
         ], '--workdir is empty (an unset shell variable?): pass a folder, e.g. '
         '--workdir=workdirs/sweep'),
        ([f'--config={FINETUNE}', '--workdir=sweeps/[b16]', '--sweep', 'config.base_lr=[0.1,0.2]'
         ], "--workdir=sweeps/[b16]: orbax cannot save checkpoints under a path holding '['"),
        (['--config=configs/finetune.py:ViT-B_16', '--workdir=w'], 'Bad finetune argument'),
        # One number written twice: the message had named neither the point nor the value.
        ([f'--config={FINETUNE}', '--workdir=w', '--sweep', 'config.base_lr=[0.001,1e-3]'
         ], 'the grid holds point base_lr=0.001 twice: a swept value is listed twice'),
        ([
            f'--config={FINETUNE}', '--workdir=w', '--sweep',
            'config.dataset=[folder:a/b,folder:a_b]'
        ], "two grid points share the name dataset=folder_a_b (dataset='folder:a/b' and "
         "dataset='folder:a_b'): make the swept values distinct"),
    ])
def test_bad_arguments_give_one_line(argv, message):
  with pytest.raises(SystemExit) as e:
    sweep.main(argv + ['--dry-run'])
  assert message in str(e.value) and '\n' not in str(e.value)


def test_failing_point_does_not_stop_the_sweep(tmp_path, capsys, monkeypatch):
  """A fake runner: points write event files like train.py, one point fails."""
  monkeypatch.setattr(sweep, 'check_data',
                      lambda *args, **kwargs: None)  # no cifar10 here: fake points
  finals = {
      '0.001': [(10, 0.50), (20, 0.70)],
      '0.003': [(10, 0.80), (20, 0.60)],
      '0.01': [(10, 0.95)],
      '0.03': []
  }
  ran = []

  def runner(argv, log_path):
    workdir = next(a.split('=', 1)[1] for a in argv if a.startswith('--workdir='))
    assert log_path == os.path.join(workdir, 'sweep.log')
    lr = argv[-1].split('=')[-1]
    ran.append(lr)
    write_accuracy(workdir, finals[lr])
    if lr == '0.01':
      return 1  # Crashed after an evaluation: its accuracy must not win.
    if lr == '0.03':
      raise OSError('no such interpreter')
    return 0

  workdir = str(tmp_path / 'sw')
  with pytest.raises(SystemExit) as failed:  # the whole sweep exits non-zero, after the summary
    sweep.main([f'--config={FINETUNE}', f'--workdir={workdir}'], runner=runner)
  assert str(failed.value).startswith('vit-sweep: 2 of 4 points failed (the summary lists them)')
  assert ran == ['0.001', '0.003', '0.01', '0.03']
  out = capsys.readouterr().out
  with open(os.path.join(workdir, 'summary.csv')) as f:
    rows = list(csv.DictReader(f))
  assert rows == [{
      'point': 'base_lr=0.001',
      'status': 'ok',
      'final_accuracy': '0.7',
      'best_accuracy': '0.7',
      'steps': '20'
  }, {
      'point': 'base_lr=0.003',
      'status': 'ok',
      'final_accuracy': '0.6',
      'best_accuracy': '0.8',
      'steps': '20'
  }, {
      'point': 'base_lr=0.01',
      'status': 'failed (exit 1)',
      'final_accuracy': '0.95',
      'best_accuracy': '0.95',
      'steps': '10'
  }, {
      'point': 'base_lr=0.03',
      'status': 'failed (exit OSError: no such interpreter)',
      'final_accuracy': '',
      'best_accuracy': '',
      'steps': ''
  }]
  with open(os.path.join(workdir, 'summary.md')) as f:
    md = f.read()
  assert '| base_lr=0.001 | ok | 0.7000 | 0.7000 | 20 |' in md
  assert '| base_lr=0.03 | failed (exit OSError: no such interpreter) | - | - | - |' in md
  assert 'Winner (best final accuracy): **base_lr=0.001**, 0.7000' in md
  assert (f'`vit-train --config={FINETUNE} --config.base_lr=0.001 '
          f'--workdir={workdir}/winner`') in md
  assert md in out  # The table is printed too.

  # Summarize again later: statuses come from the points' sweep_status files, and the exit
  # status is the sweep's (it had been 0).
  with pytest.raises(SystemExit) as failed:
    sweep.main([f'--config={FINETUNE}', f'--workdir={workdir}', '--summarize-only'], runner=None)
  assert str(failed.value).startswith('vit-sweep: 2 of 4 points failed (the summary lists them)')
  with open(os.path.join(workdir, 'summary.md')) as f:
    assert f.read() == md


@pytest.mark.parametrize('flags,warning', [
    (('--config=quickstart', '--sweep', 'config.base_lr=[0.001,0.003]'), None),
    ((), None),
    (('--config=quickstart', '--set', 'config.total_steps=100'), 'vit-sweep: warning: --set '
     'ignored: the summary is of what the sweep in sw ran with (sw/sweep.json)'),
])
def test_summarize_only_names_the_flags_the_points_ran_with(tmp_path, monkeypatch, flags, warning):
  """--summarize-only without the first run's --set flags named the winner's command without
  them (`--config=quickstart --config.base_lr=0.003`, where the points had trained 250
  steps); without --sweep either, it failed as 'the config has no lr_grid'."""
  monkeypatch.setattr(sweep, 'check_data',
                      lambda *args, **kwargs: None)  # no data here: fake points
  monkeypatch.chdir(tmp_path)
  accuracy = {'0.001': 0.5, '0.003': 0.7}

  def runner(argv, log_path):
    write_accuracy(os.path.dirname(log_path), [(250, accuracy[argv[-1].split('=')[-1]])])
    return 0

  sweep.main([
      '--config=quickstart', '--workdir=sw', '--sweep', 'config.base_lr=[0.001,0.003]', '--set',
      'config.total_steps=250', '--set', 'config.warmup_steps=50'
  ], runner=runner)
  (tmp_path / 'sw' / 'summary.md').unlink()
  p = console_script('vit-sweep', tmp_path, '--workdir=sw', *flags, '--summarize-only')
  assert p.returncode == 0, p.stderr
  winner = ('Winner (best final accuracy): **base_lr=0.003**, 0.7000. Run it with: '
            '`vit-train --config=quickstart --config.total_steps=250 --config.warmup_steps=50 '
            '--config.base_lr=0.003 --workdir=sw/winner`')
  assert p.stdout.rstrip('\n').splitlines()[-2] == winner
  assert (tmp_path / 'sw' / 'summary.md').read_text().splitlines()[-2] == winner
  assert [l for l in p.stderr.splitlines() if l.startswith('vit-sweep')
         ] == [warning] * bool(warning)


@pytest.mark.parametrize('config,sets,line', [
    ('quickstart', [], "Note: chosen on eval_split 'test', not on data held out of train_split "
     "'train' as the paper chooses: an accuracy reported on the split that chose the winner "
     "overstates it. To choose on held-out data, add --set 'config.train_split=train[:90%]' "
     "--set 'config.eval_split=train[90%:]'."),
    ('quickstart', [
        ('total_steps', '100'), ('train_split', 'train[:90%]'), ('eval_split', 'train[90%:]')
    ], "Chosen on eval_split 'train[90%:]', held out of train_split 'train[:90%]'; train the "
     'winner on the whole training set: `vit-train --config=quickstart --config.total_steps=100 '
     '--config.base_lr=0.003 --workdir=sw/final`.'),
    (FINETUNE, [], "Chosen on eval_split 'train[98%:]', held out of train_split 'train[:98%]'; "
     'train the winner on the whole training set: `vit-train '
     '--config=configs/finetune.py:ViT-B_16,cifar10 --config.base_lr=0.003 --workdir=sw/final`.'),
    ('finetune:ViT-B_16,cifar10', [], "Note: chosen on eval_split 'test', not on data held out "
     "of train_split 'train' as the paper chooses: an accuracy reported on the split that chose "
     'the winner overstates it. To choose on held-out data, sweep '
     "--config=finetune:ViT-B_16,cifar10,dev (Table 4's development splits)."),
    ('finetune:ViT-B_16,vtab/dtd,dev', [], "Chosen on eval_split 'validation[:200]', held out "
     "of train_split 'train[:800]'; train the winner on the whole training set: "
     '`vit-train --config=finetune:ViT-B_16,vtab/dtd --config.base_lr=0.003 '
     '--workdir=sw/final`.'),
    ('quickstart', [('eval_split', 'train')], "Note: chosen on eval_split 'train', not on data "
     "held out of train_split 'train' as the paper chooses: an accuracy reported on the split "
     "that chose the winner overstates it. To choose on held-out data, add --set "
     "'config.train_split=train[:90%]' --set 'config.eval_split=train[90%:]'."),
])
def test_the_summary_says_what_the_winner_was_chosen_on(config, sets, line):
  """The paper chooses on data held out of the training set, then trains the winner on all of
  it; a sweep on the split results are reported on had named its winner without a word.
  The final run's line is a vit-train command to paste (it had been its flags alone)."""
  assert sweep.selection_line(config, sets, [('base_lr', 0.003)], 'sw') == line


def test_a_workdir_of_another_sweep_is_refused(tmp_path, monkeypatch):
  """A second vit-sweep into a sweep's workdir wrote its sweep.json over the first one's
  (exit 0, no warning): the summary and --summarize-only lost the first sweep's points. The
  same flags, written otherwise (1e-3, the values reordered), still resume it."""
  monkeypatch.setattr(sweep, 'check_data',
                      lambda *args, **kwargs: None)  # no data here: fake points
  monkeypatch.chdir(tmp_path)
  ran = []

  def runner(argv, log_path):
    ran.append(argv[-1])
    write_accuracy(os.path.dirname(log_path), [(20, 0.5)])
    return 0

  flags = ['--set', 'config.total_steps=20', '--set', 'config.warmup_steps=2']
  sweep.main(['--config=quickstart', '--workdir=sw', '--sweep', 'config.base_lr=[0.001,0.003]']
             + flags, runner=runner)
  record = (tmp_path / 'sw' / 'sweep.json').read_bytes()
  refusal = ("vit-sweep: error: sw holds another sweep, whose --sweep differs (sw/sweep.json: "
             "--config quickstart --sweep 'config.base_lr=[0.001,0.003]' --set "
             'config.total_steps=20 --set config.warmup_steps=2): use another --workdir, or give '
             'those flags to resume it (or --summarize-only to summarize it)')
  for dry_run in ([], ['--dry-run']):  # a dry run shows what would run: refused as well
    p = console_script('vit-sweep', tmp_path, '--config', 'quickstart', '--workdir', 'sw',
                       '--sweep', 'config.seed=[1]', *flags, *dry_run)
    assert p.returncode == 1 and p.stdout == '', p.stdout + p.stderr
    assert p.stderr.splitlines()[-1] == refusal, p.stderr
  assert (tmp_path / 'sw' / 'sweep.json').read_bytes() == record
  assert sorted(os.listdir(tmp_path / 'sw')) == [
      'base_lr=0.001', 'base_lr=0.003', 'summary.csv', 'summary.md', 'sweep.json'
  ]
  p = console_script('vit-sweep', tmp_path, '--config', 'quickstart', '--workdir', 'sw', '--set',
                     'config.total_steps=30', '--set', 'config.warmup_steps=2', '--sweep',
                     'config.base_lr=[0.001,0.003]', '--dry-run')
  assert p.returncode == 1 and 'whose --set differs' in p.stderr.splitlines()[-1], p.stderr
  # The same sweep again (resumed), its flags written otherwise.
  p = console_script('vit-sweep', tmp_path, '--config', 'quickstart', '--workdir', 'sw', '--sweep',
                     'base_lr=[3e-3,1e-3]', *flags[2:], *flags[:2], '--dry-run')
  assert p.returncode == 0 and len(p.stdout.splitlines()) == 2, p.stderr
  sweep.main(['--config=quickstart', '--workdir=sw', '--sweep', 'config.base_lr=[1e-3,3e-3]']
             + flags, runner=runner)
  assert ran == ['--config.base_lr=0.001', '--config.base_lr=0.003'] * 2


def test_summarize_only_of_a_workdir_without_its_record(tmp_path):
  """A sweep of a vit-sweep before sweep.json, summarized with --workdir alone: the flags
  are asked for (it had said 'the following arguments are required: --config')."""
  write_accuracy(tmp_path / 'sw' / 'base_lr=0.001', [(10, 0.5)])
  p = console_script('vit-sweep', tmp_path, '--workdir=sw', '--summarize-only')
  assert p.returncode == 1 and p.stdout == '', p.stdout + p.stderr
  assert p.stderr.splitlines()[-1] == (
      'vit-sweep: error: sw has no sweep.json (a sweep started by an older vit-sweep): pass the '
      '--config, --sweep and --set flags it ran with')


def test_summary_without_status_files(tmp_path):
  """As after a TPU sweep: no sweep_status, events and final.npz only; a second event file
  wins. A point without final.npz is not finished, and not the winner: it had been 'done',
  and won with the accuracy of a run stopped part-way (a preempted TPU VM)."""
  points = sweep.grid_points([('base_lr', [0.01, 0.03, 0.1, 0.3, 1.0])])
  write_accuracy(tmp_path / 'base_lr=0.01', [(100, 0.3)])
  write_accuracy(tmp_path / 'base_lr=0.03', [(100, 0.4), (200, 0.2)])
  write_accuracy(tmp_path / 'base_lr=0.03', [(200, 0.5)])  # Resumed: re-evaluated at 200.
  write_accuracy(tmp_path / 'base_lr=0.1', [(50, 0.6)])  # Stopped at 50 of 200.
  for done in ('base_lr=0.01', 'base_lr=0.03'):
    (tmp_path / done / 'final.npz').write_bytes(b'')
  (tmp_path / 'base_lr=1.0' / 'checkpoints' / '100').mkdir(
      parents=True)  # stopped before evaluating
  rows, winner = sweep.summarize(str(tmp_path), points)
  assert [(r['status'], r['final_accuracy'], r['best_accuracy'], r['steps']) for r in rows
         ] == [('done', pytest.approx(0.3), pytest.approx(0.3), 100),
               ('done', pytest.approx(0.5), pytest.approx(0.5), 200),
               ('not finished', pytest.approx(0.6), pytest.approx(0.6), 50),
               ('not run', None, None, None), ('not finished', None, None, None)]
  assert winner == 'base_lr=0.03'
  assert sweep.summarize(str(tmp_path / 'none'), points[3:4]) == ([{
      'point': 'base_lr=0.3',
      'status': 'not run',
      'final_accuracy': None,
      'best_accuracy': None,
      'steps': None
  }], None)


def test_a_later_event_file_wins_whatever_its_counter(tmp_path):
  """Event files are named <seconds>.<host>.<pid>.<n>.v2, n counting one process's writers:
  the file with n=10 was written after n=9 in the same second, though it sorts first as text."""
  for n, value in ((9, 0.4), (10, 0.5)):
    write_accuracy(tmp_path / 'tmp', [(200, value)])
    (written,) = (tmp_path / 'tmp').iterdir()
    written.rename(tmp_path / f'events.out.tfevents.1795747739.vm.internal.6870.{n}.v2')
  assert sweep.read_accuracy(str(tmp_path)) == [(200, pytest.approx(0.5))]


@pytest.mark.parametrize('sweep_dir', ['sw?', 'sw*'])
def test_the_accuracy_of_a_sweep_folder_named_like_a_pattern_is_its_own(tmp_path, sweep_dir):
  """The event files had been globbed: a '?' or '*' in the folder's name also matched the
  folders beside it, whose accuracies were then read as this one's."""
  write_accuracy(tmp_path / sweep_dir / 'p', [(200, 0.5)])
  write_accuracy(tmp_path / 'sw1' / 'p', [(200, 0.9)])  # written later: it had won
  assert sweep.read_accuracy(str(tmp_path / sweep_dir / 'p')) == [(200, pytest.approx(0.5))]


# A point's vit-train as far as Ctrl-C goes: it saves, says so, exits 1.
_POINT_THAT_SAVES_ON_CTRL_C = '\n'.join([
    'import signal, sys, time',
    'def saved(*_):',
    '  print("vit-train: interrupted (Ctrl-C) at step 7: checkpoint saved", flush=True)',
    '  sys.exit(1)',
    'signal.signal(signal.SIGINT, saved)',
    'print("step 1", flush=True)',
    'open("point_started", "w").close()',
    'time.sleep(120)',
])


def _sweep_of_two_points(tmp_path, point_code):
  """The argv of a sweep of two points (base_lr 0.1, 0.2) in tmp_path/sw, each point's run
  being `point_code` in its own Python; Ctrl-C reaches the sweep as in a terminal."""
  data = data_fixtures.write_idx(str(tmp_path / 'data'), num_train=64, num_test=32)
  code = (CTRL_C_AS_IN_A_TERMINAL + 'import sys\n'
          'from vit_jax.launch import sweep\n'
          f'point = [sys.executable, "-c", {point_code!r}]\n'
          'sweep.main(sys.argv[1:], runner=lambda argv, log: sweep.run_local(point, log))\n')
  return [
      sys.executable, '-c', code, '--config=quickstart', '--workdir=sw', '--sweep',
      'config.base_lr=[0.1,0.2]', '--set', f'config.data_dir={data}'
  ]


def test_ctrl_c_lets_the_point_save_then_stops_the_sweep_with_one_line(tmp_path):
  """Ctrl-C (sent by the terminal to the sweep and its point) printed the sweep's
  traceback while the point's run was still saving; its last lines were not shown."""
  proc = subprocess.Popen(_sweep_of_two_points(tmp_path, _POINT_THAT_SAVES_ON_CTRL_C), cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  deadline = time.time() + 120
  while not (tmp_path / 'point_started').exists():
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
    time.sleep(0.1)
  os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in the terminal: the sweep and its point
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err[-2000:]
  assert err.strip().splitlines() == [
      "vit-sweep: interrupted (Ctrl-C) at point 1/2, base_lr=0.1 (its run's last line above "
      'says what it saved): run the same command to resume the sweep, each point from its '
      'last checkpoint'
  ]
  last = out.strip().splitlines()[-1]
  assert last == 'vit-train: interrupted (Ctrl-C) at step 7: checkpoint saved'
  assert 'checkpoint saved' in (tmp_path / 'sw' / 'base_lr=0.1' / 'sweep.log').read_text()
  assert not (tmp_path / 'sw' / 'base_lr=0.2').exists()


# A point's vit-train as far as SIGTERM and SIGHUP go: it saves, says so, exits 128 + the
# signal's number; a second signal while it saves changes nothing (vit-train ignores it).
_POINT_THAT_SAVES_ON_A_STOP_SIGNAL = '\n'.join([
    'import signal, sys, time',
    'got = []',
    'def saved(signum, _):',
    '  got.append(signum)',
    '  if len(got) > 1:',
    '    return',
    '  time.sleep(1)  # saving',
    '  print(f"vit-train: stopped at step 7: checkpoint saved ({len(got)} signals)", flush=True)',
    '  sys.exit(128 + signum)',
    'signal.signal(signal.SIGTERM, saved)',
    'signal.signal(signal.SIGHUP, saved)',
    'print("step 1", flush=True)',
    'open("point_started", "w").close()',
    'time.sleep(120)',
])


@pytest.mark.parametrize('sig, says', [('SIGTERM', 'stopped (SIGTERM)'),
                                       ('SIGHUP', 'the terminal closed (SIGHUP)')])
@pytest.mark.parametrize('to', ['the sweep', 'its process group'])
def test_sigterm_or_sighup_lets_the_point_save_then_stops_the_sweep(tmp_path, sig, says, to):
  """SIGTERM to the sweep alone (docker stop, kill PID) had killed it at once and left its
  point training on, orphaned, the workdir locked; to the process group (a scheduler, a
  closed terminal), the point saved and exited 0 (a preempted run: the sweep recorded it
  'ok' and started the next point) while the sweep was gone."""
  proc = subprocess.Popen(_sweep_of_two_points(tmp_path, _POINT_THAT_SAVES_ON_A_STOP_SIGNAL),
                          cwd=tmp_path, env=dict(os.environ,
                                                 PYTHONPATH=REPO), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  deadline = time.time() + 120
  while not (tmp_path / 'point_started').exists():
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
    time.sleep(0.1)
  signum = getattr(signal, sig)
  if to == 'the sweep':
    proc.send_signal(signum)
  else:
    os.killpg(proc.pid, signum)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 128 + signum, err[-2000:]
  assert err.strip().splitlines() == [
      f"vit-sweep: {says} at point 1/2, base_lr=0.1 (its run's last line above says what it "
      'saved): run the same command to resume the sweep, each point from its last checkpoint'
  ]
  assert out.strip().splitlines()[-1].startswith('vit-train: stopped at step 7: checkpoint saved')
  assert 'checkpoint saved' in (tmp_path / 'sw' / 'base_lr=0.1' / 'sweep.log').read_text()
  assert not (tmp_path / 'sw' / 'base_lr=0.2').exists()


def test_real_local_sweep(tmp_path, monkeypatch, capsys):
  """Two points of the offline quickstart, each a real vit_jax.main subprocess."""
  data = data_fixtures.write_idx(str(tmp_path / 'data'), num_train=64, num_test=32)
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=1')
  workdir = str(tmp_path / 'sw')
  argv = [
      '--config=configs/quickstart.py', f'--workdir={workdir}', '--sweep',
      'config.base_lr=[0.001,0.003]', '--set', 'config.total_steps=4', '--set',
      'config.warmup_steps=1', '--set', 'config.batch_size=16', '--set',
      'config.eval_batch_size=16', '--set', f'config.data_dir={data}', '--set',
      'config.model.num_layers=1'
  ]
  sweep.main(argv)
  out = capsys.readouterr().out
  with open(os.path.join(workdir, 'summary.csv')) as f:
    rows = list(csv.DictReader(f))
  assert [(r['point'], r['status'], r['steps']) for r in rows] == [('base_lr=0.001', 'ok', '4'),
                                                                   ('base_lr=0.003', 'ok', '4')]
  for r in rows:
    assert 0.0 <= float(r['final_accuracy']) == float(r['best_accuracy']) <= 1.0
  with open(os.path.join(workdir, 'summary.md')) as f:
    md = f.read()
  assert '| point | status | final accuracy | best accuracy | steps |' in md
  assert 'Winner (best final accuracy): **base_lr=0.00' in md
  logs = {}
  for point in ('base_lr=0.001', 'base_lr=0.003'):
    with open(os.path.join(workdir, point, 'sweep.log')) as f:
      logs[point] = f.read()
    assert 'Final test top-1 accuracy' in logs[point]
    assert os.path.exists(os.path.join(workdir, point, 'final.npz'))
  assert 'Final test top-1 accuracy' in out  # Streamed.
  # The same command again: the finished points are not started, compiled and evaluated
  # once more (their sweep.log had been overwritten by that), and the summary is the same.
  sweep.main(argv)
  again = capsys.readouterr().out
  assert [l for l in again.splitlines() if l.startswith('== ')] == [
      '== sweep point 1/2: base_lr=0.001: finished (final.npz), skipped',
      '== sweep point 2/2: base_lr=0.003: finished (final.npz), skipped'
  ]
  for point, log in logs.items():
    with open(os.path.join(workdir, point, 'sweep.log')) as f:
      assert f.read() == log
  with open(os.path.join(workdir, 'summary.md')) as f:
    assert f.read() == md


# Swept keys whose point names are longer than a file name may be (255 bytes), and differ
# only past that: os.makedirs had raised 'File name too long' as a traceback at the first
# point. A shorter grid of long values could fail so only at its last point, hours in.
_MANY_KEYS = [
    'config.base_lr=[0.001]', 'config.model.attention_dropout_rate=[0.0]',
    'config.model.dropout_rate=[0.0]', 'config.warmup_steps=[1]', 'config.grad_clip_norm=[1.0]',
    'config.model.hidden_size=[64]', 'config.weight_decay=[0.0001]', 'config.total_steps=[2]',
    'config.eval_every_steps=[2]', 'config.checkpoint_every_steps=[2]',
    'config.log_every_steps=[1]', 'config.model.mlp_dim=[128]', 'config.shuffle_buffer=[1000,2000]'
]

# A point that only finishes: final.npz in its --workdir.
_POINT_THAT_FINISHES = ('import sys\n'
                        'from vit_jax.launch import sweep\n'
                        'def finish(argv, log):\n'
                        '  [w] = [a[10:] for a in argv if a.startswith("--workdir=")]\n'
                        '  open(w + "/final.npz", "w").close()\n'
                        '  return 0\n'
                        'sweep.main(sys.argv[1:], runner=finish)\n')


def test_points_with_names_too_long_for_a_folder_each_run_in_their_own(tmp_path):
  flags = [f for k in _MANY_KEYS for f in ('--sweep', k)]
  argv = [sys.executable, '-c', _POINT_THAT_FINISHES, '--config=quickstart', '--workdir=sw', *flags]
  env = dict(os.environ, PYTHONPATH=REPO)
  first = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr[-2000:]
  names = sorted(n for n in os.listdir(tmp_path / 'sw') if n.startswith('base_lr='))
  assert len(names) == 2 and all(len(n.encode()) <= 255 for n in names), names
  assert all(
      re.fullmatch(r'base_lr=0\.001,model\.attention_dropout_rate=.*\+[0-9a-f]{12}', n)
      for n in names), names
  for n in names:
    assert (tmp_path / 'sw' / n / 'sweep_status').read_text() == 'ok\n'
  # The same command again finds the same folders: each point is finished, not run again.
  again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-2000:]
  assert [l for l in again.stdout.splitlines() if l.startswith('== ')] == [
      f'== sweep point {i}/2: {n}: finished (final.npz), skipped' for i, n in enumerate(names, 1)
  ]
  # On a TPU VM each point's log is ~/vit_jax_logs/sweep-<point>.log, and .status beside it.
  p = console_script('vit-sweep', tmp_path, '--config=quickstart', '--workdir=gs://b/sw', *flags,
                     '--tpu', 'vit', '--zone', 'us-central2-b', '--dry-run')
  assert p.returncode == 0, p.stderr[-2000:]
  logs = re.findall(r'vit_jax_logs/(sweep-[^ ;"\']*)\.log', p.stdout)
  assert len(set(logs)) == 2 and all(len(f'{n}.status'.encode()) <= 255 for n in logs), logs


def test_a_name_is_cut_between_letters():
  name = 'é' * 200
  cut = sweep.fitted(name, 255)
  assert len(cut.encode()) <= 255 and cut.startswith('é' * 120) and cut != sweep.fitted(
      'é' * 201, 255)
  assert sweep.fitted('base_lr=0.1', 255) == 'base_lr=0.1'


def test_python_m_launch_sweep_with_its_streams_closed_runs_its_points(tmp_path):
  """`python -m launch.sweep ... >&- 2>&- <&-` had exited 1 before its first point: the
  streams were prepared only by the vit-sweep console script."""
  data = data_fixtures.write_idx(str(tmp_path / 'data'), num_train=64, num_test=32)
  argv = [
      sys.executable, '-m', 'launch.sweep', '--config=quickstart', f'--workdir={tmp_path}/sw',
      '--sweep', 'config.base_lr=[0.001]', '--set', 'config.total_steps=2', '--set',
      'config.warmup_steps=1', '--set', 'config.batch_size=16', '--set',
      'config.eval_batch_size=16', '--set', f'config.data_dir={data}', '--set',
      'config.model.num_layers=1', '--set', 'config.cpu_devices=1'
  ]
  out = subprocess.run(['bash', '-c', f'exec {shlex.join(argv)} >&- 2>&- <&-'], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0
  with open(tmp_path / 'sw' / 'summary.csv') as f:
    assert [(r['point'], r['status'], r['steps']) for r in csv.DictReader(f)] == [('base_lr=0.001',
                                                                                   'ok', '2')]


SWEEP_FLAGS = ['--config=finetune:ViT-B_16,cifar10,dev', '--workdir=sw']


@pytest.mark.parametrize(
    'argv,message',
    [
        ([*SWEEP_FLAGS, '--config.total_steps=3', '--dry-run'], "unknown argument "
         "'--config.total_steps=3': vit-sweep sets a config field for every point with --set "
         "'config.total_steps=3'"),
        ([*SWEEP_FLAGS, '--config.total_steps', '3', '--dry-run'
         ], "--set 'config.total_steps=VALUE'"),
        ([*SWEEP_FLAGS, '--bogus', '--dry-run'], 'unrecognized arguments: --bogus'),
        ([*SWEEP_FLAGS, '--summarize-only'], 'nothing to summarize in sw: it does not exist; run '
         'without --summarize-only first'),
        ([
            '--config=my.py', '--workdir=gs://b/sw', '--tpu=vit', '--zone=us-central2-b',
            '--dry-run'
        ], "--config 'my.py' is a file outside"),
        # argparse had taken the last value, and --set the last of a field.
        ([*SWEEP_FLAGS, '--workdir=sw2', '--dry-run'
         ], "--workdir is given more than once ('sw', 'sw2'): give one"),
        ([*SWEEP_FLAGS, '--config', 'quickstart', '--dry-run'],
         "--config is given more than once ('finetune:ViT-B_16,cifar10,dev', 'quickstart'): give "
         'one'),
        ([*SWEEP_FLAGS, '--set', 'config.total_steps=3', '--set=config.total_steps=4', '--dry-run'
         ], "config.total_steps is given more than once in --set ('3', '4'): give one"),
    ])
def test_bad_arguments_from_the_command_line(tmp_path, argv, message):
  """Refused before any point runs or any file is written: one line, exit 1."""
  (tmp_path / 'my.py').write_text('from vit_jax.configs.finetune import get_config as g\n'
                                  'def get_config():\n  return g("ViT-B_16,cifar10,dev")\n')
  p = console_script('vit-sweep', tmp_path, *argv)
  assert p.returncode == 1 and p.stdout == '', p.stdout + p.stderr
  [line] = [l for l in p.stderr.splitlines() if l.startswith('vit-sweep: ')]
  assert line.startswith('vit-sweep: error: ') and message in line, p.stderr
  assert 'Traceback' not in p.stderr and os.listdir(tmp_path) == ['my.py']


@pytest.mark.parametrize('flags,message', [
    (('--tpu', 'vit', '--zone', 'us-central2-bb'), "--zone 'us-central2-bb' is not a zone: write "
     'it as <region>-<letter>, e.g. us-central2-b or europe-west4-a (gcloud compute tpus '
     'locations list)'),
    (('--tpu', 'My_TPU', '--zone', 'us-central2-b'), "--tpu 'My_TPU': use lowercase letters, "
     'digits and hyphens, starting with a letter'),
])
def test_the_tpu_flags_are_checked_as_vit_tpu_checks_them(tmp_path, flags, message):
  """A zone or TPU VM name that vit-tpu refuses went into the dry run's ssh command."""
  p = console_script('vit-sweep', tmp_path, '--config=finetune:ViT-B_16,cifar10,dev',
                     '--workdir=gs://b/sw', *flags, '--dry-run')
  assert p.returncode == 1 and p.stdout == '', p.stdout + p.stderr
  assert p.stderr.splitlines()[-1] == f'vit-sweep: error: {message}', p.stderr


def test_tpu_sweep_names_a_config_file_as_the_workers_see_it(tmp_path, capsys, monkeypatch):
  """The workers run from their copy of the repository: a config file of it, given from
  another directory, is passed by its path there."""
  monkeypatch.chdir(tmp_path)
  sweep.main([
      f'--config={REPO}/{FINETUNE}', '--workdir=gs://b/sw', '--tpu', 'vit', '--zone',
      'us-central2-b', '--dry-run'
  ])
  out = capsys.readouterr().out
  assert f'--config={FINETUNE}' in out and REPO not in out


# A point whose last line is in the pipe as the sweep gets Ctrl-C: it says so, then sends
# Ctrl-C to the sweep alone.
_POINT_SAVED_THEN_CTRL_C = '\n'.join([
    'import os, signal, sys, time',
    'print("vit-train: interrupted (Ctrl-C) at step 7: checkpoint saved", flush=True)',
    'os.kill(os.getppid(), signal.SIGINT)',
    'time.sleep(0.5)',
    'sys.exit(1)',
])


def test_the_points_last_line_is_kept_when_ctrl_c_comes_with_it(tmp_path):
  """Ctrl-C landing just after the sweep read the point's line, before it wrote it, lost
  that line (seen on a loaded CI host): the console and sweep.log ended without it."""
  out = subprocess.run(_sweep_of_two_points(tmp_path, _POINT_SAVED_THEN_CTRL_C), cwd=tmp_path,
                       env=dict(os.environ,
                                PYTHONPATH=REPO), capture_output=True, text=True, timeout=120)
  assert out.returncode == 130, out.stderr[-2000:]
  saved = 'vit-train: interrupted (Ctrl-C) at step 7: checkpoint saved'
  assert out.stdout.strip().splitlines()[-1] == saved, out.stdout[-2000:]
  log = (tmp_path / 'sw' / 'base_lr=0.1' / 'sweep.log').read_text().splitlines()
  assert log[0].startswith('== ') and log[-1] == saved  # the point's command, then its lines


def test_a_points_lines_are_in_its_log_and_on_the_console_as_they_come(tmp_path):
  """sweep.log was written through a buffer: `tail -f` on it showed nothing of a running
  point until its end or a buffer's worth; so was vit-sweep's own output into a pipe."""
  go = tmp_path / 'go'
  point = ('import os, sys, time\n'
           'from vit_jax.launch import sweep\n'
           'point = [sys.executable, "-c", "import os, time\\n'
           'print(\\"step 1\\", flush=True)\\n'
           f'while not os.path.exists({str(go)!r}): time.sleep(0.05)"]\n'
           'sys.exit(sweep.run_local(point, "sweep.log"))\n')
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONUNBUFFERED'}  # as a user's shell
  proc = subprocess.Popen([sys.executable, '-c', point], cwd=tmp_path,
                          env=dict(env, PYTHONPATH=REPO), stdout=subprocess.PIPE, text=True)
  first = []
  reader = threading.Thread(target=lambda: first.append(proc.stdout.readline()), daemon=True)
  reader.start()
  reader.join(60)  # a buffered line would come only at the end, which waits for `go`
  try:
    assert first == ['step 1\n']
    assert (tmp_path / 'sweep.log').read_text().endswith('\nstep 1\n')  # after the command
  finally:
    go.touch()
    proc.communicate(timeout=60)
  assert proc.returncode == 0


def test_a_swept_dataset_not_there_names_the_sweep_flag(tmp_path):
  """A swept folder dataset that is not there: the fix had said `set --set config.dataset=`,
  which the sweep refuses for a swept field."""
  p = console_script('vit-sweep', tmp_path, '--config=quickstart', '--workdir=sw', '--sweep',
                     'config.dataset=[fashion_mnist_local,folder:nope]', '--set',
                     'config.total_steps=10', '--set', 'config.warmup_steps=2')
  assert p.returncode == 1 and p.stdout == '', p.stdout + p.stderr
  assert p.stderr.splitlines()[-1] == (
      'vit-sweep: error: point dataset=folder_nope: Folder dataset nope not found: '
      'set --sweep config.dataset=folder:<dir> to where it is, <dir>/<split>/<class>/<image>')
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('command', ['vit-sweep', 'vit-vtab'])
def test_a_second_sweep_in_the_same_dir_is_refused_before_its_first_point(
    tmp_path, monkeypatch, command):
  """Two at once in one DIR: the second had run beside the first, recorded the point the first
  was running as failed (its vit-train refused by the point's lock) over the first's ok, and
  each had then reported failures that were not."""
  # pylint: disable-next=g-import-not-at-top
  from vit_jax.launch import vtab as vtab_launch
  monkeypatch.setattr(sweep, 'check_data', lambda *args, **kwargs: None)  # no data: fake points
  workdir = tmp_path / 'sw'
  workdir.mkdir()
  ran = []
  first = subprocess.Popen(['sleep', '300'])
  try:
    (workdir / 'lock').write_text(
        json.dumps({
            'host': socket.gethostname(),
            'pid': first.pid,
            'started': 'then'
        }))
    with pytest.raises(SystemExit) as e:
      if command == 'vit-sweep':
        sweep.main([f'--config={FINETUNE}', f'--workdir={workdir}'],
                   runner=lambda argv, log: ran.append(argv) or 0)
      else:
        vtab_launch.main(['--model=ViT-B_16', f'--workdir={workdir}', '--tasks=dtd'],
                         runner=lambda argv, log: ran.append(argv) or 0)
  finally:
    first.kill()
    first.wait()
  assert str(e.value) == (
      f'{command}: error: workdir {workdir} is in use by pid {first.pid} on '
      f'{socket.gethostname()} (started then, lock {workdir}/lock): wait for that run to end or '
      'use another --workdir (delete the lock file only if that run is gone)')
  assert ran == []
  assert set(os.listdir(workdir)) <= {'lock', 'sweep.json'}  # no point's folder, no summary


def _until(condition, what, timeout=180):
  deadline = time.time() + timeout
  while not condition():
    assert time.time() < deadline, f'no {what} in {timeout} s'
    time.sleep(0.2)


def _holder_pid(workdir):
  try:
    return json.loads((workdir / 'lock').read_text())['pid']
  except (OSError, ValueError, KeyError):
    return None


def _gone(pid):
  """Whether process `pid` has ended: gone, or a zombie (an orphan's new parent, PID 1 of a
  container, may never reap it)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] == 'Z'
  except FileNotFoundError:
    return True


def test_a_sweep_killed_outright_stops_its_point_and_the_rerun_resumes_it(tmp_path):
  """kill -9 of vit-sweep (or the OOM killer) had left its point's vit-train training on,
  unwatched; the same command run again had found that point's workdir locked and marked
  the point failed. Now the point is sent SIGTERM as the sweep dies, saves and exits, and
  the sweep run again waits for that save, then resumes the point from it."""
  data = data_fixtures.write_idx(str(tmp_path / 'data'), num_train=64, num_test=32)
  argv = [
      os.path.join(os.path.dirname(sys.executable), 'vit-sweep'), '--config=quickstart',
      '--workdir=sw', '--sweep', 'config.base_lr=[0.001]', '--set', 'config.total_steps=100000',
      '--set', 'config.batch_size=16', '--set', f'config.data_dir={data}', '--set',
      'config.model.num_layers=1', '--set', 'config.cpu_devices=1'
  ]
  point = tmp_path / 'sw' / 'base_lr=0.001'
  with open(tmp_path / 'first.out', 'w') as out:
    first = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
  rerun = orphan = None
  try:
    _until(lambda: 'Compiled the train step' in _read(point / 'train.INFO'), 'first step')
    orphan = _holder_pid(point)
    os.kill(orphan, signal.SIGSTOP)  # held where it is: the rerun meets it still running
    first.kill()
    first.wait()
    with open(tmp_path / 'rerun.out', 'w') as out:
      rerun = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    _until(lambda: '== waiting up to 5 minutes for pid' in _read(tmp_path / 'rerun.out'),
           "the rerun's wait")
    assert not _gone(orphan)
    os.kill(orphan, signal.SIGCONT)  # the SIGTERM sent as the first sweep died is delivered
    _until(lambda: _gone(orphan), 'exit of the killed sweep\'s point', timeout=180)
    _until(lambda: 'Compiled the train step' in _read(tmp_path / 'rerun.out'), 'resumed step')
    rerun.send_signal(signal.SIGTERM)
    rerun.wait(timeout=180)
  finally:
    for p in (first, rerun):
      if p is not None and p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    if orphan is not None and not _gone(orphan):  # a failure above: not left stopped
      os.kill(orphan, signal.SIGKILL)
  said = _read(tmp_path / 'rerun.out')
  stopped = [l for l in _read_logs(point) if 'vit-train: preempted (SIGTERM) at step' in l]
  assert len(stopped) == 2, stopped  # the orphan's save, then the rerun's
  first_step = int(re.search(r'at step (\d+):', stopped[0]).group(1))
  assert f'Resuming from the checkpoint of step {first_step} ' in said, said[-3000:]
  assert (f'== it exited; its log ends: vit-train: preempted (SIGTERM) at step {first_step}: '
          'checkpoint saved in') in said, said[-3000:]
  assert 'in use by' not in said and 'failed' not in said, said[-3000:]
  assert rerun.returncode == 128 + signal.SIGTERM, said[-2000:]


def _read(path):
  try:
    return path.read_text()
  except OSError:
    return ''


def _read_logs(run_dir):
  """The lines of every vit-train log in `run_dir` (one per run: train.INFO is the last's),
  in the order the runs started."""
  names = sorted(n for n in os.listdir(run_dir) if '.log.INFO.' in n)
  return [l for n in names for l in (run_dir / n).read_text().splitlines()]


def test_a_point_is_started_without_fork_hooks_and_named_its_sweep(tmp_path):
  """The point learns which process started it from its environment. It had been started
  through a preexec_fn, which runs Python's at-fork hooks: in a process where JAX had
  started (a sweep run from Python), JAX's hook warned 'os.fork() was called ... will likely
  lead to a deadlock'."""
  jax = pytest.importorskip('jax')
  jax.devices()  # a started backend installs JAX's at-fork hook
  point = [sys.executable, '-c', f'import os; print(os.environ.get("{parent_death.STARTER_PID}"))']
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    assert sweep.run_local(point, str(tmp_path / 'sweep.log')) == 0
  assert [str(w.message) for w in caught if 'fork' in str(w.message)] == []
  assert (tmp_path / 'sweep.log').read_text().splitlines()[-1] == str(os.getpid())


def test_a_point_killed_by_sigkill_is_named_with_what_sends_it(tmp_path):
  """A point the out-of-memory killer ended (its log stops mid-run, without a line) had been
  recorded as 'failed (exit -9)' and said nothing more."""
  point = 'import os, signal\nprint("step 1", flush=True)\nos.kill(os.getpid(), signal.SIGKILL)'
  p = subprocess.run(_sweep_of_two_points(tmp_path, point), cwd=tmp_path, capture_output=True,
                     text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
  assert p.returncode == 1, p.stderr[-2000:]
  said = [l for l in p.stdout.splitlines() if l.startswith('== base_lr=')]
  assert said == [
      f'== base_lr={lr}: failed (SIGKILL): the kernel\'s out-of-memory killer ends processes '
      'with SIGKILL (`dmesg | grep -i killed` tells whether it did); in another --workdir, '
      '--set config.accum_steps=0 (the fewest micro-batches that fit) or --set '
      'config.remat=True trains in less memory' for lr in ('0.1', '0.2')
  ], p.stdout[-3000:]
  with open(tmp_path / 'sw' / 'summary.csv') as f:
    assert [r['status'] for r in csv.DictReader(f)] == ['failed (SIGKILL)'] * 2


@pytest.mark.parametrize('command', ['vit-sweep', 'vit-vtab'])
def test_after_a_killed_sweep_its_point_still_saving_is_waited_for(tmp_path, monkeypatch, capsys,
                                                                   command):
  """The same command run again after a kill -9 takes over the sweep's lock; the point the
  killed one ran may still be saving (sent SIGTERM as it died): started beside it, the
  point's vit-train had been refused and the point marked failed."""
  # pylint: disable-next=g-import-not-at-top
  from vit_jax.launch import vtab as vtab_launch
  monkeypatch.setattr(sweep, 'check_data', lambda *args, **kwargs: None)  # no data: fake points
  workdir = tmp_path / 'sw'
  first = 'base_lr=0.001' if command == 'vit-sweep' else 'dtd'
  (workdir / first).mkdir(parents=True)
  gone = subprocess.Popen(['true'])
  gone.wait()
  # Saving until the file `saved` appears, which the sweep's first second of waiting makes;
  # started by a shell that exits at once, as the killed sweep's point is an orphan.
  saved = tmp_path / 'saved'
  saving = int(
      subprocess.run(
          ['sh', '-c', f'(while [ ! -e {saved} ]; do sleep 0.05; done) >/dev/null 2>&1 & echo $!'],
          capture_output=True, text=True, check=True).stdout)
  real_sleep = time.sleep
  monkeypatch.setattr(time, 'sleep', lambda s: saved.touch() or real_sleep(s))
  for folder, pid in ((workdir, gone.pid), (workdir / first, saving)):
    (folder / 'lock').write_text(
        json.dumps({
            'host': socket.gethostname(),
            'pid': pid,
            'started': 'then'
        }))
  (workdir / first / 'train.INFO').write_text(
      'I1206 23:58:01.534337 1397 train.py:669] step 800/3000  loss 0.5824\n'
      'E1206 23:58:02.049764 1397 main.py:488] vit-train: preempted (SIGTERM) at step 813: '
      'checkpoint saved\n')
  started = []

  def runner(argv, log):
    started.append((os.path.basename(os.path.dirname(log)), _gone(saving)))
    return 0

  try:
    if command == 'vit-sweep':
      sweep.main([f'--config={FINETUNE}', f'--workdir={workdir}'], runner=runner)
    else:
      vtab_launch.main(['--model=ViT-B_16', f'--workdir={workdir}', '--tasks=dtd'], runner=runner)
  except SystemExit:  # no accuracy from the fake points
    pass
  finally:
    saved.touch()
  said = capsys.readouterr().out
  assert (f'== waiting up to 5 minutes for pid {saving} on {socket.gethostname()} (started '
          f'then, lock {workdir / first}/lock) to save and exit: the {command} before this one '
          'was killed, and its run there was sent SIGTERM') in said, said
  assert started[0] == (first, True)  # run once the one saving there had ended
  # How it ended, which the killed command never wrote to the point's log: there too.
  ended = '== it exited; its log ends: vit-train: preempted (SIGTERM) at step 813: checkpoint saved'
  assert ended in said.splitlines(), said
  log = (workdir / first / ('sweep.log' if command == 'vit-sweep' else 'vtab.log')).read_text()
  assert ended in log.splitlines(), log


def test_a_point_still_running_after_the_wait_is_started_anyway_and_said(tmp_path, capsys):
  """Past the wait the point is run (its vit-train names what holds the workdir), and the
  sweep says why; a point log it cannot write (here a folder) does not stop the sweep."""
  (tmp_path / 'lock').write_text(
      json.dumps({
          'host': socket.gethostname(),
          'pid': os.getppid(),
          'started': 'then'
      }))
  (tmp_path / 'sweep.log').mkdir()
  sweep.wait_for_a_stopping_run(str(tmp_path), 'sweep.log', sys.stdout, timeout_s=0)
  assert capsys.readouterr().out.splitlines()[-1] == (
      f'== pid {os.getppid()} on {socket.gethostname()} (started then, lock {tmp_path}/lock) '
      'still runs after 0 minutes: the point is started anyway')


def test_ctrl_c_while_waiting_for_a_killed_sweeps_point_says_it_goes_on(
    tmp_path, monkeypatch, capsys):
  """Ctrl-C while the sweep waits for the killed one's point to save had said only
  'vit-sweep: interrupted (Ctrl-C)': that run is still saving, outside this terminal's Ctrl-C."""
  monkeypatch.setattr(sweep, 'check_data', lambda *args, **kwargs: None)
  workdir = tmp_path / 'sw'
  (workdir / 'base_lr=0.001').mkdir(parents=True)
  gone = subprocess.Popen(['true'])
  gone.wait()
  for folder, pid in ((workdir, gone.pid), (workdir / 'base_lr=0.001', os.getppid())):
    (folder / 'lock').write_text(
        json.dumps({
            'host': socket.gethostname(),
            'pid': pid,
            'started': 'then'
        }))

  def ctrl_c(seconds):
    raise KeyboardInterrupt

  monkeypatch.setattr(time, 'sleep', ctrl_c)
  with pytest.raises(SystemExit) as stop:
    sweep.main([f'--config={FINETUNE}', f'--workdir={workdir}'], runner=lambda argv, log: 0)
  assert stop.value.code == 130
  assert capsys.readouterr().err.splitlines()[-1] == (
      f'vit-sweep: interrupted (Ctrl-C) while waiting for pid {os.getppid()} on '
      f'{socket.gethostname()} (started then, lock {workdir}/base_lr=0.001/lock) to save and '
      'exit (it goes on): run the same command to resume, once it has exited')
  assert (workdir / 'base_lr=0.001' / 'lock').exists()  # the other run's, left to it
  assert not (workdir / 'lock').exists()  # the sweep's own, removed
