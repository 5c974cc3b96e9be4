"""Injected faults, seen as a user sees them (issue 12: "fail loudly, lose nothing").

Each test runs the CLI as a user does (`python -m vit_jax.main --config=quickstart`, a
relative --workdir, cwd = the test's directory) on the installed Fashion-MNIST, breaks
one thing, and checks the exit status, the last line of the output (one line naming the
fix) and what is on disk before and after. One good run (8 simulated devices) is shared:
tests copy its workdir. Faults found at start-up are also checked in-process (faster).
"""
import errno
import gzip
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from vit_jax import checkpoint
from vit_jax import errors
from vit_jax import rundir
from vit_jax import train
from vit_jax.configs import finetune
from vit_jax.configs import quickstart
from tests.conftest import built_once
from tests.conftest import console_script
from tests.conftest import UNREACHABLE_GCS
from tests.conftest import CTRL_C_AS_IN_A_TERMINAL
from tests.conftest import own_compilation_cache
from tests.conftest import with_flags
from tests.conftest import without_root_override

ARGS = [
    '--config=quickstart', '--config.total_steps=30', '--config.warmup_steps=2',
    '--config.checkpoint_every_steps=10', '--config.eval_every_steps=0',
    '--config.log_every_steps=10', '--config.train_split=train[:2048]',
    '--config.eval_split=test[:512]', '--config.model.num_layers=1', '--config.batch_size=32',
    '--config.eval_batch_size=256', '--config.prefetch=1'
]


def _env(devices=8):
  """The suite's environment with `devices` CPU devices; None: none forced, as a user's
  shell (the config's cpu_devices decides)."""
  flags = '' if devices is None else f'--xla_force_host_platform_device_count={devices}'
  return dict(os.environ, XLA_FLAGS=flags, TF_CPP_MIN_LOG_LEVEL='2')


# A filesystem without symbolic links (Google Drive in Colab, SMB, FAT): os.symlink fails as
# there, with EOPNOTSUPP.
_NO_SYMLINKS = ('import errno, os; '
                'os.symlink = lambda *a, **k: (_ for _ in ()).throw('
                'OSError(errno.EOPNOTSUPP, "Operation not supported")); ')


def _cli(cwd, workdir, *extra, devices=8, file_size_limit=None, memory_limit=None, env_extra=None,
         no_symlinks=False, prefix=()):
  """vit-train's (rc, stderr, last line). file_size_limit: "disk full" for files past it
  (Python ignores SIGXFSZ); memory_limit: bytes of address space, past which allocations
  fail (a test of the memory check cannot then take the host's memory if the check breaks);
  env_extra: variables of the user's environment; no_symlinks: os.symlink fails, as on a
  filesystem without them; prefix: a command that runs it (without_root_override())."""
  command = [
      sys.executable, '-m', 'vit_jax.main', *with_flags([*ARGS, f'--workdir={workdir}'], extra)
  ]
  limits = [
      (name, n) for name, n in (('RLIMIT_FSIZE', file_size_limit), ('RLIMIT_AS', memory_limit)) if n
  ]
  if limits or no_symlinks:
    command[1:3] = [
        '-c', 'import resource, runpy, sys; '
        + ''.join(f'resource.setrlimit(resource.{name}, ({n}, {n})); ' for name, n in limits) +
        (_NO_SYMLINKS if no_symlinks else '')
        + 'sys.argv[0] = "vit_jax.main"; runpy.run_module("vit_jax.main", run_name="__main__")'
    ]
  env = own_compilation_cache(_env(devices)) if file_size_limit else _env(devices)
  env.update(env_extra or {})
  proc = subprocess.run([*prefix, *command], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=400)
  lines = proc.stderr.strip().splitlines()
  return proc.returncode, proc.stderr, lines[-1] if lines else ''


def _steps(workdir):
  path = os.path.join(workdir, 'checkpoints')
  return sorted(os.listdir(path), key=lambda d: (len(d), d)) if os.path.isdir(path) else []


def _read(path):
  with open(path, 'rb') as f:
    return f.read()


def _good_run(cwd):
  old = os.umask(0o022)
  try:
    rc, err, last = _cli(cwd, 'run')
  finally:
    os.umask(old)
  assert rc == 0, err[-3000:]
  assert 'Final test[:512] top-1 accuracy' in last


@pytest.fixture(scope='module')
def good(tmp_path_factory):
  """A finished 30-step run (checkpoints 10, 20, 30 and final.npz), made once for all
  workers: the tests copy it before they change it."""
  return built_once(tmp_path_factory, 'good', _good_run) / 'run'


# Settings of a user's shell that had each ended a run in a traceback.
_USERS_SETTINGS = {
    'JAX_ENABLE_X64': '1',  # at step 1: float64 losses against the compiled float32 step
    'JAX_DISABLE_JIT': '1',  # at compile: the step is compiled ahead of time
    'JAX_DEBUG_NANS': '1',  # a diverged run: ('jit', 'nan') where the guard says which and why
    'PYTHONWARNINGS': 'error',  # at start-up: ml_collections' deprecated load_module()
}


def test_a_users_jax_and_python_settings_change_nothing(tmp_path, good):
  """With the settings above in the environment, the run trains the good run's parameters,
  bit for bit, and its log says which JAX settings it turned off."""
  rc, err, last = _cli(tmp_path, 'run', env_extra=_USERS_SETTINGS)
  assert rc == 0, err[-3000:]
  for variable in ('JAX_ENABLE_X64', 'JAX_DISABLE_JIT', 'JAX_DEBUG_NANS'):
    assert f'{variable}=1: off for this run' in err
  ours, theirs = np.load(tmp_path / 'run' / 'final.npz'), np.load(good / 'final.npz')
  assert sorted(ours) == sorted(theirs)
  for name in ours:
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert ours[name].dtype == theirs[name].dtype


def test_a_diverging_run_under_jax_debug_nans_stops_with_the_guards_line(tmp_path):
  rc, err, last = _cli(tmp_path, 'run', '--config.base_lr=1e6', env_extra={'JAX_DEBUG_NANS': '1'})
  assert rc == 1, err[-3000:]
  assert re.fullmatch(r'vit-train: loss nan, .* at step \d+: training diverged, .*', last), last


@pytest.mark.parametrize('platform, why', [
    ('cuda', "(its runtime is not installed): install its runtime (pip install -c constraints.txt "
     "'.[cuda12]') or unset JAX_PLATFORMS to run on what this machine has"),
    ('tpu', "(Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: "),
])
def test_a_jax_platform_this_machine_lacks_is_one_line(tmp_path, good, platform, why):
  """JAX_PLATFORMS naming a runtime that is not installed had ended every command in 50-110
  lines of chained tracebacks (for cuda, the last a bare AssertionError)."""
  env = dict(_env(devices=None), JAX_PLATFORMS=platform)
  train_run = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', '--config=quickstart', '--workdir=w'], cwd=tmp_path,
      env=env, capture_output=True, text=True, timeout=300)
  evaluate = console_script('vit-evaluate', tmp_path, f'--workdir={good}', **env)
  for program, out in (('vit-train', train_run), ('vit-evaluate', evaluate)):
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f'{program}: JAX cannot start the backend JAX_PLATFORMS='
                               f'{platform} names {why}'), lines[0]
  assert not (tmp_path / 'w').exists()  # no lock, no log


def test_a_sweep_stops_at_its_first_point_where_jax_cannot_start(tmp_path):
  """Each point had failed in turn with the same line, and vit-sweep's own said only how
  many failed."""
  env = dict(_env(devices=None), JAX_PLATFORMS='cuda')
  out = console_script('vit-sweep', tmp_path, '--config=quickstart', '--workdir=sw', '--set',
                       'config.total_steps=20', '--set', 'config.warmup_steps=2', '--sweep',
                       'config.base_lr=[0.001,0.01]', **env)
  assert out.returncode == 1, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1] == (
      'vit-sweep: error: point base_lr=0.001: JAX cannot start the backend JAX_PLATFORMS=cuda '
      "names (its runtime is not installed): install its runtime (pip install -c constraints.txt "
      "'.[cuda12]') or unset JAX_PLATFORMS to run on what this machine has (stopped here: the "
      'later points would fail the same way)')
  assert sorted(os.listdir(tmp_path / 'sw')) == ['base_lr=0.001', 'sweep.json']


def test_a_workdir_without_symbolic_links_logs_to_train_info_itself(tmp_path):
  """On Google Drive in Colab (and SMB, FAT) absl's train.INFO link fails quietly: such a
  workdir had no train.INFO, so `tail -f W/train.INFO` and the README's stops that end there
  found nothing. Each run's log is appended to train.INFO itself now."""
  for _ in range(2):  # the second run resumes the finished first
    rc, err, last = _cli(tmp_path, 'run', no_symlinks=True)
    assert rc == 0, err[-3000:]
  run = tmp_path / 'run'
  assert not os.path.islink(run / 'train.INFO')
  assert [f for f in os.listdir(run) if 'INFO' in f] == ['train.INFO']  # absl's files removed
  log = (run / 'train.INFO').read_text().splitlines()
  assert sum('takes no symbolic links, or it was made as a plain file), so each run\'s log is '
             'appended to it' in line for line in log) == 2, log[:3]
  assert sum(' top-1 accuracy: ' in line for line in log) == 2
  assert log[-1].endswith(last), (log[-1], last)


def _copy(good, tmp_path, name='run'):
  shutil.copytree(good, tmp_path / name)
  os.remove(tmp_path / name / 'train.INFO')  # a link into the copied directory's logs
  return tmp_path / name


def test_good_run_leaves_a_complete_workdir(good):
  assert _steps(good) == ['10', '20', '30']
  assert not os.path.exists(good / 'lock')  # released at the end
  assert os.path.islink(good / 'train.INFO')  # where the filesystem takes links
  assert os.stat(good / 'final.npz').st_mode & 0o777 == 0o644  # follows the umask


# 1. Divergence guard.
def test_divergence_stops_at_once_and_saves_nothing(tmp_path):
  rc, err, last = _cli(tmp_path, 'run', '--config.base_lr=1e6')
  assert rc == 1, err[-3000:]
  assert last.startswith('vit-train: loss nan') and 'training diverged' in last, last
  assert '--config.base_lr' in last and 'warmup_steps' in last
  assert 'step 30/30' not in err and 'Final' not in err
  assert _steps(tmp_path / 'run') == []  # a non-finite state is never checkpointed
  assert not os.path.exists(tmp_path / 'run' / 'final.npz')
  # The log ends with it too (vit-evaluate sends the user there); stderr has it once.
  assert (tmp_path / 'run' / 'train.INFO').read_text().strip().endswith(last)
  assert err.count('training diverged') == 1


def test_a_short_run_that_skips_half_its_steps_in_a_row_stops(tmp_path):
  """40 steps, 39 of them skipped: it had ended with exit 0 and an untrained final.npz."""
  rc, err, last = _cli(tmp_path, 'run', '--config.base_lr=1e30', '--config.on_nonfinite=skip',
                       '--config.total_steps=40')
  assert rc == 1, err[-3000:]
  last_skipped = _skipped_through(last)
  assert 21 <= last_skipped <= 29, last  # 20 in a row from step 2, seen within a few steps
  assert not os.path.exists(tmp_path / 'run' / 'final.npz')


def _skipped_through(last):
  """The last step of the skipped run of steps `last` (vit-train's line) names from step 2."""
  found = re.fullmatch(
      r'vit-train: steps 2-(\d+) all had a non-finite loss, gradient or update and were skipped '
      r'\(on_nonfinite=skip\): training makes no progress, so it stopped .*', last)
  assert found, last
  return int(found.group(1))


def test_an_update_that_overflows_is_never_saved(tmp_path):
  """A finite gradient times lr 1e30 is an inf update: the guard had looked at the loss and
  the gradient only, so step 2's inf parameters were checkpointed (and would have pushed the
  good step 1 out), and the resume diverged at once."""
  small = ['--config.checkpoint_every_steps=1', '--config.keep_checkpoints=1']
  rc, err, last = _cli(tmp_path, 'run', *small, '--config.base_lr=1e30')
  assert rc == 1, err[-3000:]
  assert re.fullmatch(
      r'vit-train: loss [0-9.]+, gradient norm [0-9.]+, update norm inf at step 2: training '
      r'diverged, so it stopped \(the checkpoint of step 1 is kept\); try a lower '
      r'--config.base_lr \(now 1e\+30\), a longer --config.warmup_steps \(now 2\)', last), last
  assert _steps(tmp_path / 'run') == ['1']
  rc, err, last = _cli(tmp_path, 'run', *small, '--config.total_steps=3',
                       '--config.resume_changes=base_lr,total_steps')
  assert rc == 0 and 'Resuming from the checkpoint of step 1 ' in err, err[-3000:]


def test_a_divergence_from_weight_decay_names_it(tmp_path):
  """weight_decay 1e30 (times base_lr: each step flips and grows the kernels) had been told to
  lower base_lr and lengthen the warm-up only."""
  with pytest.raises(train.TrainingError) as e:
    train.train_and_evaluate(_config(weight_decay=1e30), str(tmp_path / 'run'))
  assert str(e.value).endswith('a lower --config.weight_decay (now 1e+30: times base_lr 1e+27, '
                               'which must stay well below 1)'), str(e.value)


def test_a_run_that_skips_every_update_stops(tmp_path):
  """on_nonfinite=skip with lr 1e30 had skipped 297 of 300 steps and exited 0; then it had
  gone on to the next log line (step 110, or 200 at the default log_every_steps), not
  stopped at the 100th skip in a row."""
  rc, err, last = _cli(tmp_path, 'run', '--config.base_lr=1e30', '--config.on_nonfinite=skip',
                       '--config.total_steps=300')
  assert rc == 1, err[-3000:]
  assert 101 <= _skipped_through(last) <= 109, last  # seen within a few steps of the 100th
  assert last.endswith('(on_nonfinite=skip): training makes no progress, so it stopped (the '
                       'checkpoint of step 100 is kept); try a lower --config.base_lr (now '
                       '1e+30), a longer --config.warmup_steps (now 2)'), last
  assert _steps(tmp_path / 'run')[-1] == '100' and 'Final' not in err
  assert not os.path.exists(tmp_path / 'run' / 'final.npz')


def test_turning_polyak_averaging_on_at_resume_names_the_field(good, tmp_path):
  """Even with resume_changes=polyak_decay it had been refused as 'checkpoints of another
  model (the optimizer state differs (another optimizer?))', naming no field."""
  run = _copy(good, tmp_path)
  rc, err, last = _cli(tmp_path, 'run', '--config.polyak_decay=0.99', '--config.total_steps=40',
                       '--config.resume_changes=polyak_decay,total_steps')
  assert rc == 1, err[-3000:]
  assert last == (
      f'vit-train: workdir {run} holds a run with polyak_decay 0.0: 0.99 would turn Polyak '
      'averaging on, which a resume cannot (the checkpoints hold its sums, or none): keep '
      '--config.polyak_decay=0.0, use another --workdir, or fine-tune from that run with '
      f'--config.pretrained_path={run}/final.npz'), last
  assert _steps(run) == ['10', '20', '30'] and 'Traceback' not in err


def test_diverging_resume_keeps_good_checkpoints_and_final(good, tmp_path):
  run = _copy(good, tmp_path)
  final = _read(run / 'final.npz')
  rc, err, last = _cli(tmp_path, 'run', '--config.base_lr=1e30', '--config.total_steps=60',
                       '--config.resume_changes=base_lr,total_steps')
  assert rc == 1, err[-3000:]
  assert 'training diverged' in last and 'the checkpoint of step 30 is kept' in last, last
  assert _steps(run) == ['10', '20', '30']
  assert _read(run / 'final.npz') == final
  # config.json still describes the saved run: the plain command resumes it.
  with open(run / 'config.json') as f:
    assert json.load(f)['base_lr'] == 1e-3


# 3. Resume safety.
def test_changed_config_is_refused(good, tmp_path):
  run = _copy(good, tmp_path)
  config = _read(run / 'config.json')
  rc, err, last = _cli(tmp_path, 'run', '--config.seed=1', '--config.model.hidden_size=32')
  assert rc == 1, err[-3000:]
  assert last.startswith('vit-train: workdir') and 'another config' in last, last
  # A field that shapes the parameters: no resume_changes offered (it had been, and then
  # the checkpoints did not fit); the run's own values are (a config's defaults change
  # between versions of vit_jax).
  assert last == (f'vit-train: workdir {run} holds a run with another config (model.hidden_size '
                  '64 -> 32, seed 0 -> 1): to go on with that run, pass its values '
                  '(--config.model.hidden_size=64 --config.seed=0); model.hidden_size shapes the '
                  'parameters, which a resume cannot change; or use another --workdir'), last
  # The resume_changes given stay in the one offered.
  rc, err, last = _cli(tmp_path, 'run', '--config.seed=1', '--config.total_steps=40',
                       '--config.resume_changes=total_steps')
  assert last.endswith('seed 0 -> 1): to go on with that run, pass its value (--config.seed=0); '
                       'to change it, pass --config.resume_changes=total_steps,seed; or use '
                       'another --workdir'), last
  assert _read(run / 'config.json') == config  # written only after the check passes
  assert _steps(run) == ['10', '20', '30']
  # A mistyped name had let nothing through, and the refusal above named it again.
  rc, err, last = _cli(tmp_path, 'run', '--config.seed=1', '--config.resume_changes=sead')
  assert (rc, last) == (1, "vit-train: resume_changes names 'sead', which is no config field: set "
                        '--config.resume_changes to fields of the config (e.g. '
                        "base_lr,total_steps), or '*' for any"), err[-3000:]
  assert _read(run / 'config.json') == config and _steps(run) == ['10', '20', '30']


def test_a_damaged_config_json_stops_a_resume_with_another_config(good, tmp_path):
  run = _copy(good, tmp_path)
  final = _read(run / 'final.npz')
  with open(run / 'config.json', 'r+') as f:
    f.truncate(50)
  rc, err, last = _cli(tmp_path, 'run', '--config.batch_size=64')
  assert rc == 1, err[-3000:]
  assert re.match(
      r"vit-train: \S+/config.json cannot be read \(.*\), so this config cannot be "
      r"checked .*: restore the file, or pass --config.resume_changes='\*'", last), last
  assert _read(run / 'final.npz') == final


def test_a_lost_config_json_stops_a_resume_until_resume_changes_star(good, tmp_path):
  """Checkpoints without config.json had resumed with no check at all, then recorded the new
  config as the whole run's."""
  run = _copy(good, tmp_path)
  config, final = _read(run / 'config.json'), _read(run / 'final.npz')
  os.remove(run / 'config.json')
  rc, err, last = _cli(tmp_path, 'run', '--config.base_lr=0.01', '--config.total_steps=40')
  assert rc == 1, err[-3000:]
  assert re.match(
      r"vit-train: \S+/config.json is missing, so this config cannot be checked against the "
      r"run's: restore the file, or pass --config.resume_changes='\*'", last), last
  assert not (run / 'config.json').exists() and _steps(run) == ['10', '20', '30']
  rc, err, _ = _cli(tmp_path, 'run', "--config.resume_changes=*")
  assert rc == 0, err[-3000:]
  assert 'config.json is missing: written again from this config' in err
  assert _read(run / 'final.npz') == final
  assert json.loads(_read(run / 'config.json'))['base_lr'] == json.loads(config)['base_lr']


@pytest.mark.parametrize('damage', ['cut short', 'without the model field'])
def test_resume_changes_star_writes_a_damaged_config_json_again(good, tmp_path, damage):
  """vit-evaluate's advice for a damaged config.json (checkpoint.load_run) works: the run's
  command with --config.resume_changes='*' writes it again, even on a finished run. One
  that lacks a field of the model's (edited, or of another version) had been a traceback in
  vit-evaluate and was kept as it was by that command."""
  run = _copy(good, tmp_path)
  config, final = _read(run / 'config.json'), _read(run / 'final.npz')
  if damage == 'cut short':
    (run / 'config.json').write_text('{"broken')
    says = r"config.json is damaged .*resume_changes='\*'"
    warned = 'config.json cannot be read'
  else:
    (run / 'config.json').write_text(
        json.dumps({
            k: v for k, v in json.loads(config).items() if k != 'model'
        }))
    says = (r"config.json has no field 'model' \(edited, or written by another version\): "
            r"restore it, or run the run's vit-train command again with "
            r"--config.resume_changes='\*' to write it again$")
    warned = "config.json has no field 'model."
  with pytest.raises(ValueError, match=says):
    checkpoint.load_run(str(run))
  rc, err, _ = _cli(tmp_path, 'run', "--config.resume_changes=*")
  assert rc == 0, err[-3000:]
  assert warned in err and _read(run / 'final.npz') == final
  assert json.loads(_read(run / 'config.json'))['resume_changes'] == '*'
  assert {
      k: v for k, v in json.loads(_read(run / 'config.json')).items() if k != 'resume_changes'
  } == {
      k: v for k, v in json.loads(config).items() if k != 'resume_changes'
  }
  checkpoint.load_run(str(run))  # vit-evaluate reads it again


def test_a_finished_run_started_again_with_a_change_keeps_its_config(good, tmp_path):
  """Nothing is trained when a finished run starts again: config.json still describes
  final.npz, and the plain command is not refused afterwards."""
  run = _copy(good, tmp_path)
  config, final = _read(run / 'config.json'), _read(run / 'final.npz')
  rc, err, _ = _cli(tmp_path, 'run', '--config.base_lr=0.01', '--config.resume_changes=base_lr')
  assert rc == 0 and 'top-1 accuracy: ' in err, err[-3000:]
  assert _read(run / 'config.json') == config and _read(run / 'final.npz') == final
  rc, err, _ = _cli(tmp_path, 'run')
  assert rc == 0, err[-3000:]


def _unwritable(folder):
  """Makes `folder` refuse new files, for root too (chattr +i; skips where it cannot); the
  undo."""
  if os.geteuid() != 0:
    folder.chmod(0o555)
    return lambda: folder.chmod(0o755)
  if subprocess.run(['chattr', '+i', str(folder)], capture_output=True).returncode:
    pytest.skip('chattr +i does not work here')
  return lambda: subprocess.run(['chattr', '-i', str(folder)], check=True)


def test_checkpoints_the_run_cannot_write_are_refused_before_training(good, tmp_path):
  """A checkpoints folder of another user's (a workdir shared by two, umask 022) had failed
  only at the first save, after training up to it, and the process then waited for ever on
  orbax's threads of the save that never began."""
  run = _copy(good, tmp_path)
  undo = _unwritable(run / 'checkpoints')
  try:
    start = time.monotonic()
    rc, err, last = _cli(tmp_path, 'run', '--config.total_steps=40',
                         '--config.resume_changes=total_steps')
  finally:
    undo()
  assert rc == 1, err[-3000:]
  assert re.fullmatch(
      rf'vit-train: cannot write to {run}/checkpoints: \w.* \({run}/checkpoints/'
      r'\.vit_jax_write_check\.\w+\): .*, or use another --workdir', last), last
  assert 'Compiled the train step' not in err and time.monotonic() - start < 120
  assert _steps(run) == ['10', '20', '30']


@pytest.mark.parametrize('text', ['{"app": "mine"}', '', '[1, 2]'])
def test_a_config_json_of_another_program_is_not_overwritten(tmp_path, text):
  """`--workdir=.` in a folder of the user's own files: their config.json had been replaced
  by the run's without a word."""
  (tmp_path / 'config.json').write_text(text)
  rc, err, last = _cli(tmp_path, '.')
  assert rc == 1, err[-3000:]
  assert last == (f'vit-train: {tmp_path}/config.json is not the config of a vit_jax run, and a '
                  'run records its own there: use another --workdir, or move that file out of it')
  assert sorted(os.listdir(tmp_path)) == ['config.json']
  assert (tmp_path / 'config.json').read_text() == text


def test_the_config_json_of_a_run_that_saved_nothing_is_its_own(good, tmp_path):
  """A run stopped before its first save left its config.json alone: the next run there
  starts and records its own."""
  run = _copy(good, tmp_path)
  shutil.rmtree(run / 'checkpoints')
  os.remove(run / 'final.npz')
  rundir.check_resume_config(quickstart.get_config(), str(run))


# vit-train as a user without a home folder runs it: HOME unset and no passwd entry (an
# arbitrary uid in a container), so that '~' expands to itself. jemalloc's re-exec would
# lose the patch: the C library's malloc is kept.
_WITHOUT_A_HOME = ('import pwd, runpy, sys\n'
                   'def no_entry(uid): raise KeyError(uid)\n'
                   'pwd.getpwuid = no_entry\n'
                   'sys.argv[0] = "vit_jax.main"\n'
                   'runpy.run_module("vit_jax.main", run_name="__main__")\n')


def test_a_user_without_a_home_gets_no_folder_named_tilde(tmp_path):
  """'~' had stayed '~': `--workdir=~/runs/x` trained into ./~/runs/x, and TensorFlow's
  import wrote ./~/.keras/keras.json wherever a command ran (`rm -rf ~` then removes the
  real home)."""
  env = {k: v for k, v in _env().items() if k not in ('HOME', 'XDG_CACHE_HOME', 'KERAS_HOME')}
  env['VIT_JAX_HOST_ALLOCATOR'] = 'system'

  def train(workdir):
    out = subprocess.run([sys.executable, '-c', _WITHOUT_A_HOME, *ARGS, f'--workdir={workdir}'],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    return out.returncode, out.stderr

  rc, err = train('~/runs/x')
  assert (rc, err.strip().splitlines()[-1]) == (
      1, "vit-train: --workdir=~/runs/x: '~' names no home folder here (HOME is not set, and "
      'this user has no home in the passwd file): give the path from /, or set HOME'), err[-3000:]
  # A gs:// run's readable log defaults to ~/vit_jax_logs: it had been a traceback once the
  # run had started, from opening the log.
  rc, err = train('gs://bucket/run')
  assert (rc, err.strip().splitlines()[-1]) == (
      1, "vit-train: --local_log_dir=~/vit_jax_logs: '~' names no home folder here (HOME is not "
      'set, and this user has no home in the passwd file): give the path from /, or set HOME'), (
          err[-3000:])
  rc, err = train('run')
  assert rc == 0 and 'top-1 accuracy' in err.strip().splitlines()[-1], err[-3000:]
  assert os.listdir(tmp_path) == ['run']


def test_total_steps_below_the_saved_step_is_refused(good, tmp_path):
  run = _copy(good, tmp_path)
  config = _read(run / 'config.json')
  rc, err, last = _cli(tmp_path, 'run', '--config.total_steps=20',
                       '--config.resume_changes=total_steps')
  assert rc == 1, err[-3000:]
  assert re.match(
      r'vit-train: workdir \S+ holds a run at step 30, past total_steps 20: set '
      r'--config.total_steps to 30 or more', last), last
  assert _read(run / 'config.json') == config


def test_config_check_fields(good, tmp_path):
  run = _copy(good, tmp_path)
  config = quickstart.get_config()
  with open(run / 'config.json') as f:
    config.update_from_flattened_dict({
        k: v for k, v in _flat(json.load(f)).items() if not isinstance(v, list)
    })
  rundir.check_resume_config(config, str(run))  # the same config
  for field, value in (('log_every_steps', 7), ('checkpoint_every_steps', 0),
                       ('keep_checkpoints', 9), ('eval_batch_size', 64), ('mesh_data', 4),
                       ('fewshot_every_steps', 5), ('accum_steps', 2)):
    changed = config.copy_and_resolve_references()
    changed[field] = value
    rundir.check_resume_config(changed, str(run))  # free to change
  for field, value in (('base_lr', 0.1), ('total_steps', 60), ('batch_size', 64),
                       ('dataset', 'folder:/x'), ('dtype', 'bfloat16'), ('optimizer', 'sgd')):
    changed = config.copy_and_resolve_references()
    changed[field] = value
    with pytest.raises(train.ConfigError, match=f'{field} .* -> '):
      rundir.check_resume_config(changed, str(run))
    changed.resume_changes = field
    rundir.check_resume_config(changed, str(run))  # the override says it is intended
  changed = config.copy_and_resolve_references()
  changed.model.dropout_rate = 0.5
  changed.resume_changes = 'model'  # a prefix names the whole group
  rundir.check_resume_config(changed, str(run))


def _flat(tree, prefix=''):
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, f'{prefix}{k}.') if isinstance(v, dict) else {prefix + k: v})
  return out


# 4. One run per workdir.
def test_second_run_in_a_workdir_is_refused(good, tmp_path):
  run = _copy(good, tmp_path)
  holder = subprocess.Popen(['sleep', '300'])
  try:
    lock = {'host': socket.gethostname(), 'pid': holder.pid, 'started': 'earlier'}
    (run / 'lock').write_text(json.dumps(lock))
    os.symlink('the-holder.INFO', run / 'train.INFO')  # the running run's log
    files = sorted(os.listdir(run))
    rc, err, last = _cli(tmp_path, 'run', '--config.seed=1')
  finally:
    holder.kill()
    holder.wait()
  assert rc == 1, err[-3000:]
  assert f'is in use by pid {holder.pid} on {socket.gethostname()}' in last, last
  assert (run / 'lock').exists()  # the holder's lock is left alone
  assert _steps(run) == ['10', '20', '30']
  # No log of the refused run: train.INFO still leads to the holder's.
  assert sorted(os.listdir(run)) == files
  assert os.readlink(run / 'train.INFO') == 'the-holder.INFO'


@pytest.mark.parametrize('untouched_min', [2, 11])
def test_a_lock_from_another_host_is_taken_over_once_left_untouched(good, tmp_path, untouched_min):
  """A Colab runtime gone (its successor has another host name) or a lost host of a shared
  folder: its lock had to be deleted by hand, as a pid on another host cannot be asked."""
  run = _copy(good, tmp_path)
  (run / 'lock').write_text(json.dumps({'host': 'a-runtime-gone', 'pid': 4242, 'started': 'then'}))
  then = time.time() - untouched_min * 60
  os.utime(run / 'lock', (then, then))
  rc, err, last = _cli(tmp_path, 'run')
  if untouched_min < 10:  # that run may be there: refused, saying when it will not be
    assert (rc, last) == (1, f'vit-train: workdir {run} is in use by pid 4242 on a-runtime-gone '
                          f'(started then, lock {run}/lock): wait for that run to end or use '
                          'another --workdir (that run touches the lock every 60 s: the same '
                          'command takes it over once it is left untouched for 10 minutes, in 8 '
                          'at the earliest)'), err[-3000:]
    assert os.path.getmtime(run / 'lock') == pytest.approx(then)
    return
  assert rc == 0, err[-3000:]
  assert ('Taking over the lock of pid 4242 on a-runtime-gone (started then, lock '
          f'{run}/lock): untouched for 11 minutes (its run touches it every 60 s), that run is '
          'gone') in err, err[-3000:]
  assert not (run / 'lock').exists()  # released at the end


def test_a_held_lock_is_touched_until_released(tmp_path, monkeypatch):
  monkeypatch.setattr(rundir, 'HEARTBEAT_S', 0.05)
  lock = rundir.WorkdirLock(str(tmp_path))
  lock.acquire()
  then = time.time() - 3600
  os.utime(tmp_path / 'lock', (then, then))
  for _ in range(100):
    if os.path.getmtime(tmp_path / 'lock') > then + 60:
      break
    time.sleep(0.05)
  assert os.path.getmtime(tmp_path / 'lock') > then + 60
  lock.release()
  (tmp_path / 'lock').write_text('{}')  # another run's, after this one released its own
  os.utime(tmp_path / 'lock', (then, then))
  time.sleep(0.3)
  assert os.path.getmtime(tmp_path / 'lock') == then


def test_the_lock_of_a_run_ended_but_not_yet_reaped_is_taken_over(tmp_path):
  """A run killed outright whose parent (a notebook's subprocess.Popen, say) has not waited
  for it is a zombie: kill(pid, 0) finds it, and its lock had refused the same command."""
  zombie = subprocess.Popen(['sh', '-c', 'kill -9 $$'])
  for _ in range(200):
    with open(f'/proc/{zombie.pid}/stat') as f:
      if f.read().rsplit(')', 1)[1].split()[0] == 'Z':
        break
    time.sleep(0.05)
  try:
    (tmp_path / 'lock').write_text(json.dumps({'host': socket.gethostname(), 'pid': zombie.pid}))
    lock = rundir.WorkdirLock(str(tmp_path))
    lock.acquire()
    assert json.loads((tmp_path / 'lock').read_text())['pid'] == os.getpid()
    lock.release()
  finally:
    zombie.wait()


def test_stale_lock_is_taken_over(tmp_path, caplog):
  dead = subprocess.Popen(['true'])
  dead.wait()
  (tmp_path / 'lock').write_text(json.dumps({'host': socket.gethostname(), 'pid': dead.pid}))
  lock = rundir.WorkdirLock(str(tmp_path))
  with caplog.at_level(logging.WARNING):
    lock.acquire()
  assert f'Taking over the stale lock of pid {dead.pid} on ' in caplog.text
  # The process ended without its last line: what ends one so.
  assert ("that process ended without removing it (killed outright: kill -9, or the kernel's "
          'out-of-memory killer, which `dmesg | grep -i killed` tells; or a crash)') in caplog.text
  lock.release()
  # An unreadable lock over 10 s old (its writer killed mid-write): said as such; it had
  # read 'the stale lock of an unreadable lock'.
  (tmp_path / 'lock').write_text('{"host": "vm", "pi')
  os.utime(tmp_path / 'lock', (time.time() - 60, time.time() - 60))
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    lock.acquire()
  assert (f'Taking over the lock {tmp_path}/lock, unreadable and over 10 s old: the run that '
          'wrote it is gone') in caplog.text
  assert json.loads((tmp_path / 'lock').read_text())['pid'] == os.getpid()
  with pytest.raises(train.ConfigError, match=f'in use by pid {os.getpid()}'):
    rundir.WorkdirLock(str(tmp_path)).acquire()  # a live holder: refused
  lock.release()
  assert not (tmp_path / 'lock').exists()


def _take_stale_lock(workdir, barrier, holders):
  barrier.wait()
  lock = rundir.WorkdirLock(workdir)
  try:
    lock.acquire()
  except train.ConfigError:
    return
  holders.put(os.getpid())
  time.sleep(0.5)  # held while the other tries


# The forked runs only take a file lock, never calling JAX, whose threads the warning is about.
@pytest.mark.filterwarnings('ignore:os.fork.. was called:RuntimeWarning')
def test_a_stale_lock_is_taken_over_by_one_of_two_runs(tmp_path):
  """Two runs that found the lock stale at once had both taken it over (one removed the lock
  the other had just made): 14 of 30 tries in an audit. One run, and only one, takes it."""
  jax.process_index()  # started before the forks, which only lock
  dead = subprocess.Popen(['true'])
  dead.wait()
  context = multiprocessing.get_context('fork')
  for trial in range(8):
    workdir = tmp_path / str(trial)
    workdir.mkdir()
    (workdir / 'lock').write_text(json.dumps({'host': socket.gethostname(), 'pid': dead.pid}))
    barrier, holders = context.Barrier(2), context.Queue()
    runs = [
        context.Process(target=_take_stale_lock, args=(str(workdir), barrier, holders))
        for _ in range(2)
    ]
    for run in runs:
      run.start()
    for run in runs:
      run.join(60)
    taken = []
    while not holders.empty():
      taken.append(holders.get())
    assert len(taken) == 1, (trial, taken)
    assert not (workdir / 'lock.takeover').exists()


def test_a_lock_that_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
  """A full disk: the lock was created but its text not written, and the same command, run
  again at once as the message says, was refused by that empty 'unreadable lock'."""
  real_fdopen = os.fdopen

  def full_disk(fd, mode):
    os.close(fd)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, 'fdopen', full_disk)
  with pytest.raises(train.ConfigError, match='^cannot write to workdir .*: No space left on dev'):
    rundir.WorkdirLock(str(tmp_path)).acquire()
  monkeypatch.setattr(os, 'fdopen', real_fdopen)
  assert not (tmp_path / 'lock').exists()
  lock = rundir.WorkdirLock(str(tmp_path))
  lock.acquire()  # the same command again, at once
  assert json.loads((tmp_path / 'lock').read_text())['pid'] == os.getpid()
  lock.release()


def test_release_leaves_a_lock_another_run_took(tmp_path):
  lock = rundir.WorkdirLock(str(tmp_path))
  lock.acquire()
  other = {'host': socket.gethostname(), 'pid': os.getpid() + 1}
  (tmp_path / 'lock').write_text(json.dumps(other))  # taken over meanwhile
  lock.release()
  assert json.loads((tmp_path / 'lock').read_text()) == other


# 5. Damaged checkpoints, another model's workdir.
@pytest.mark.parametrize('command', ['vit-train', 'vit-evaluate'])
def test_a_checkpoint_file_this_user_cannot_read_is_one_line_and_kept(good, tmp_path, command):
  """Written by another user under a strict umask, the step is not damaged: it had been moved
  aside as such and the run resumed from the step before (vit-train), or called damaged
  (vit-evaluate --step), after orbax's 'Event loop is closed' traceback."""
  run = _copy(good, tmp_path)
  shutil.rmtree(run / 'checkpoints' / '30')
  os.remove(run / 'final.npz')
  locked = sorted((run / 'checkpoints/20/default/ocdbt.process_0/d').iterdir())[0]
  locked.chmod(0)
  if command == 'vit-train':
    rc, err, last = _cli(tmp_path, 'run', prefix=without_root_override())
  else:
    out = subprocess.run([
        *without_root_override(),
        os.path.join(os.path.dirname(sys.executable), command), '--workdir=run', '--step=20'
    ], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    rc, err, last = out.returncode, out.stderr, out.stderr.strip().splitlines()[-1]
  assert (rc, last) == (
      1, f'{command}: cannot access {locked}: permission denied: give this '
      'user permission there, or run the command as the user who owns it'), err[-3000:]
  assert 'Traceback' not in err, err[-3000:]
  assert _steps(run) == ['10', '20']  # nothing moved aside, nothing trained
  assert not (run / 'final.npz').exists()


def test_damaged_checkpoints_fall_back_to_an_intact_one(good, tmp_path):
  run = _copy(good, tmp_path)
  for name in os.listdir(run / 'checkpoints/30/default/ocdbt.process_0/d'):  # truncated
    os.truncate(run / 'checkpoints/30/default/ocdbt.process_0/d' / name, 100)
  shutil.rmtree(run / 'checkpoints/20/default')  # deleted
  os.remove(run / 'final.npz')
  rc, err, last = _cli(tmp_path, 'run')
  assert rc == 0, err[-3000:]
  assert 'Checkpoint of step 30' in err and 'Checkpoint of step 20' in err
  assert 'Resuming from the checkpoint of step 10' in err
  moved = [d for d in os.listdir(run / 'checkpoints') if '.corrupt-' in d]
  assert sorted(d.split('.')[0] for d in moved) == ['20', '30']  # moved aside, not deleted
  assert {'10', '20', '30'} <= set(_steps(run))
  with np.load(good / 'final.npz') as a, np.load(run / 'final.npz') as b:
    for k in a.files:  # the exact resume from step 10 gives the same parameters
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_when_every_checkpoint_is_damaged_the_run_says_it_starts_again(good, tmp_path):
  run = _copy(good, tmp_path)
  for step in ('10', '20', '30'):
    shutil.rmtree(run / 'checkpoints' / step / 'default')
  os.remove(run / 'final.npz')
  rc, err, last = _cli(tmp_path, 'run')
  assert rc == 0, err[-3000:]
  assert re.search(
      r'No checkpoint in \S+ can be restored \(steps 30, 20, 10 are damaged\): '
      'training starts again from step 0', err), err[-3000:]
  assert 'Resuming' not in err
  with np.load(good / 'final.npz') as a, np.load(run / 'final.npz') as b:
    for k in a.files:  # the same run from step 0 again
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize('damage', ['removed', 'garbled'])
def test_a_checkpoint_without_its_metadata_file_falls_back(good, tmp_path, damage):
  # The step's metadata file holds the checksums and where each array is in the packed
  # buffers (vit_jax/packed_state.py): without it, the step is damaged, not another model's.
  # Garbled, orbax had logged three errors above the warning, each with the file's bytes.
  run = _copy(good, tmp_path)
  metadata = run / 'checkpoints/30/_CHECKPOINT_METADATA'
  if damage == 'removed':
    os.remove(metadata)
  else:
    metadata.write_bytes(b'\x00\x17garbled\xff' * 100)
  rc, err, last = _cli(tmp_path, 'run')
  assert rc == 0, err[-3000:]
  assert 'garbled' not in err and 'Metadata file' not in err, err[-3000:]
  assert re.search(
      r'Checkpoint of step 30 .* cannot be restored \(its metadata is unreadable\): '
      r'moved to', err), err[-3000:]
  assert 'Resuming from the checkpoint of step 20' in err


def test_a_save_cut_short_is_removed_at_the_next_start(good, tmp_path):
  """kill -9 during a save leaves its temporary directory (orbax's name for it); the next
  start removes it and resumes from the last finished step."""
  run = _copy(good, tmp_path)
  cut_short = run / 'checkpoints' / '40.orbax-checkpoint-tmp'
  shutil.copytree(run / 'checkpoints' / '30', cut_short)
  shutil.rmtree(cut_short / 'default')  # the arrays were still being written
  rc, err, last = _cli(tmp_path, 'run', '--config.total_steps=50',
                       '--config.resume_changes=total_steps')
  assert rc == 0, err[-3000:]
  assert 'Resuming from the checkpoint of step 30' in err
  assert f'Removing {cut_short}: a save that did not finish' in err
  assert _steps(run)[-2:] == ['40', '50'] and not any('tmp' in d for d in _steps(run))


def _orbax_arrays(step_dir):
  """Checkpoint `step_dir`'s arrays as orbax alone restores them (numpy, no checksums);
  None when orbax cannot read them."""
  try:
    ckptr = ocp.PyTreeCheckpointer()
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                            ckptr.metadata(step_dir).item_metadata.tree)
    tree = ckptr.restore(step_dir, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
  except Exception:  # pylint: disable=broad-except  (the damage reached orbax's own reads)
    return None
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _overwrite_array_bytes(step_dir):
  """Overwrites 12 bytes in place where orbax still restores every array but some come back
  changed: silent damage that only our checksums can see. Where a write lands depends on how
  orbax split and compressed the arrays into files (it differs from run to run), so offsets
  are tried in turn, each undone unless it has that effect."""
  intact = _orbax_arrays(step_dir)
  data = step_dir / 'ocdbt.process_0/d'
  for name in sorted(os.listdir(data), key=lambda n: -os.path.getsize(data / n)):
    size = os.path.getsize(data / name)
    for fraction in (0.5, 0.3, 0.7, 0.4, 0.6, 0.2, 0.8):
      offset = int(size * fraction)
      with open(data / name, 'r+b') as f:
        f.seek(offset)
        before = f.read(12)
        f.seek(offset)
        f.write(b'\xde\xad\xbe\xef' * 3)
      damaged = _orbax_arrays(step_dir)
      if damaged is not None and any(
          a.tobytes() != b.tobytes() for a, b in zip(intact, damaged, strict=True)):
        return
      with open(data / name, 'r+b') as f:
        f.seek(offset)
        f.write(before)
  pytest.fail(f'no overwrite in {data} left the arrays readable and changed')


def test_a_checkpoint_whose_bytes_changed_is_not_trained_on_or_exported(good, tmp_path):
  # Bits overwritten in place: every file stays readable, and orbax alone would restore
  # the garbage and rewrite final.npz from it with exit status 0.
  run = _copy(good, tmp_path)
  _overwrite_array_bytes(run / 'checkpoints/30/default')
  rc, err, last = _cli(tmp_path, 'run')
  assert rc == 0, err[-3000:]
  assert re.search(
      r'Checkpoint of step 30 .* cannot be restored \(\S+ does not match the '
      r'checksum saved with it \(damaged files\)\): moved to', err), err[-3000:]
  assert 'Resuming from the checkpoint of step 20' in err
  with np.load(good / 'final.npz') as a, np.load(run / 'final.npz') as b:
    for k in a.files:  # retrained from step 20: the same parameters as the good run
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_a_config_json_lacking_fields_is_named_on_resume(good, tmp_path):
  """A run written by an earlier vit_jax (or an edited config.json) lacks fields: the resume
  had gone on under the new config's values for them without a word, then recorded those
  as the run's."""
  run = _copy(good, tmp_path)
  recorded = json.loads(_read(run / 'config.json'))
  del recorded['seed'], recorded['cpu_devices']
  (run / 'config.json').write_text(json.dumps(recorded))
  os.remove(run / 'final.npz')
  shutil.rmtree(run / 'checkpoints' / '30')
  rc, err, last = _cli(tmp_path, 'run', '--config.seed=5')
  assert rc == 0, err[-3000:]
  assert (f'{run}/config.json lacks 2 fields (written by another version of vit_jax, or '
          "edited): the run goes on with this config's values for them (seed=5, cpu_devices=2), "
          'which config.json records from its next save') in err, err[-3000:]
  assert json.loads(_read(run / 'config.json'))['seed'] == 5


def test_workdir_of_another_model_says_so(good, tmp_path):
  """The flag it suggests is quoted for a shell: a workdir with a space had broken it."""
  _copy(good, tmp_path, 'my run')
  rc, err, last = _cli(tmp_path, 'my run', '--config.model.hidden_size=32',
                       '--config.resume_changes=model')
  assert rc == 1, err[-3000:]
  assert 'holds checkpoints of another model' in last, last
  assert 'checkpoint (64,) vs model (32,)' in last
  assert last.endswith(f"--config.pretrained_path='{tmp_path}/my run/final.npz'"), last
  assert 'Traceback' not in err
  # Part-way (no final.npz): that file had been offered all the same.
  os.remove(tmp_path / 'my run' / 'final.npz')
  rc, err, last = _cli(tmp_path, 'my run', '--config.model.hidden_size=32',
                       '--config.resume_changes=model')
  assert last.endswith(f'use another --workdir, or go on with that run under the model of its '
                       f'config ({tmp_path}/my run/config.json)'), last


# 2. Save failures.
def test_failed_save_stops_at_once(tmp_path):
  rc, err, last = _cli(tmp_path, 'run', '--config.total_steps=200', file_size_limit=64 * 1024)
  assert rc == 1, err[-3000:]
  # Which save meets the limit first depends on how orbax chunks its files; whichever it
  # is, the run stops by the next save at the latest, not at the end.
  failed = re.search(r'^vit-train: the checkpoint of step (\d+) could not be written', last)
  assert failed, err[-3000:]
  assert 'File too large' in last and re.search(
      r'raise it \(ulimit -f unlimited\), then run the same command to (resume from step \d+|'
      r'start again \(this run saved no checkpoint\))$', last), last
  # orbax's failed write tasks are reported once, by our line, not as tracebacks.
  assert 'Traceback' not in err and 'never retrieved' not in err, err[-3000:]
  assert f'step {int(failed.group(1)) + 20}/200' not in err
  assert not os.path.exists(tmp_path / 'run' / 'lock')


def test_orphaned_orbax_write_tasks_are_not_printed():
  """The orphaned-task records asyncio writes as a process with a failed save ends (seen
  under load) are dropped once the loop's filters are installed; others are kept."""
  import asyncio  # pylint: disable=import-outside-toplevel
  import gc  # pylint: disable=import-outside-toplevel
  import logging  # pylint: disable=import-outside-toplevel
  # A failed task, and a failed gather (its record names no file; its traceback does).
  source = (
      'import asyncio\n'
      'async def write():\n  raise OSError(27, "File too large")\n'
      'async def start():\n  return [asyncio.ensure_future(write()), asyncio.gather(write())]\n')
  namespace = {}
  records = []

  class Keep(logging.Handler):

    def emit(self, record):
      records.append(record.getMessage())

  def orphan(filename):
    exec(compile(source, filename, 'exec'), namespace)  # pylint: disable=exec-used
    loop = asyncio.new_event_loop()
    futures = loop.run_until_complete(namespace['start']())
    loop.run_until_complete(asyncio.sleep(0.05))
    loop.close()
    del futures
    gc.collect()

  def orphan_future(message):
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(ValueError(message))
    loop.close()
    del future
    gc.collect()

  handler = Keep()
  logging.getLogger().addHandler(handler)
  try:
    train._quiet_library_noise()  # pylint: disable=protected-access
    orphan('/site-packages/orbax/checkpoint/serialization.py')
    assert not any('never retrieved' in r for r in records), records
    orphan('/site-packages/other/module.py')
    assert sum('never retrieved' in r for r in records) == 2, records
    # A bare future of tensorstore's write (no traceback; seen under load in CI): known by
    # the orbax temporary directory its error names. Another bare future is kept.
    records.clear()
    orphan_future('OUT_OF_RANGE: Error writing "params.head.bias/0" in OCDBT database at local '
                  'file "/w/run/checkpoints/10.orbax-checkpoint-tmp/default.orbax-checkpoint-'
                  'tmp/ocdbt.process_0/": File too large')
    assert not any('never retrieved' in r for r in records), records
    orphan_future('something else failed')
    assert sum('never retrieved' in r for r in records) == 1, records
  finally:
    logging.getLogger().removeHandler(handler)


def test_unread_orbax_coroutines_are_not_printed():
  """A damaged checkpoint fails many of orbax's array reads at once; the coroutines of the
  ones never awaited reached sys.unraisablehook, each with a page of traceback (hundreds
  for one checkpoint). Those of other code still are printed."""
  printed = []
  _, on_unraisable = train._quiet_closed_loop(None, printed.append)  # pylint: disable=protected-access
  namespace = {}
  for filename in ('/site-packages/orbax/checkpoint/serialization.py', '/site-packages/x/y.py'):
    exec(compile('async def read():\n  pass\n', filename, 'exec'), namespace)  # pylint: disable=exec-used
    coroutine = namespace['read']()
    on_unraisable(
        types.SimpleNamespace(exc_type=Exception, exc_value=Exception('reading'),
                              exc_traceback=None, err_msg=None, object=coroutine))
    coroutine.close()
  assert [u.object.cr_code.co_filename for u in printed] == ['/site-packages/x/y.py']


# 6. Ctrl-C, a closed terminal.
@pytest.mark.parametrize('sig, says', [(signal.SIGINT, 'interrupted (Ctrl-C) at step '),
                                       (signal.SIGHUP, 'the terminal closed (SIGHUP) at step ')],
                         ids=['ctrl_c', 'sighup'])
def test_ctrl_c_or_a_closed_terminal_saves_then_exits_non_zero(tmp_path, sig, says):
  # A closed terminal (SIGHUP) had ended the run at once: no save, no line, status 129.
  # Both had exited 1, as a failed run does. (SIGTERM: tests/test_preemption.py.)
  proc = subprocess.Popen([
      sys.executable, '-m', 'vit_jax.main', *with_flags(ARGS, [
          '--workdir=run', '--config.total_steps=5000', '--config.log_every_steps=5',
          '--config.checkpoint_every_steps=0'
      ])
  ], cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  log = tmp_path / 'run' / 'train.INFO'
  deadline = time.time() + 200
  while not (log.exists() and 'step 5/' in log.read_text()):
    assert proc.poll() is None and time.time() < deadline, 'the run did not start'
    time.sleep(0.1)
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=200)
  last = err.strip().splitlines()[-1]
  assert proc.returncode == 128 + sig, err[-3000:]  # the shell's: not a failure of the run
  assert last.startswith('vit-train: ' + says), last
  # train.INFO ends with it too: where the user of a closed terminal looks.
  assert log.read_text().strip().splitlines()[-1].endswith(last)
  step = int(last.split('at step ')[1].split(':')[0])
  assert _steps(tmp_path / 'run') == [str(step)]
  assert 'run the same command to resume' in last


def test_a_closed_terminal_still_gets_sighups_status(tmp_path):
  """Where the terminal is gone, writing the last line to it fails (EIO; a pipe: EPIPE): that
  error had become the exit status (1) and the last line's traceback."""
  proc = subprocess.Popen([
      os.path.join(os.path.dirname(sys.executable), 'vit-train'),
      *with_flags(ARGS, [
          '--workdir=run', '--config.total_steps=5000', '--config.log_every_steps=5',
          '--config.checkpoint_every_steps=0'
      ])
  ], cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  log = tmp_path / 'run' / 'train.INFO'
  deadline = time.time() + 200
  while not (log.exists() and 'step 5/' in log.read_text()):
    assert proc.poll() is None and time.time() < deadline, 'the run did not start'
    time.sleep(0.1)
  proc.stderr.close()  # the terminal is gone
  proc.send_signal(signal.SIGHUP)
  assert proc.wait(timeout=200) == 129
  last = log.read_text().strip().splitlines()[-1]
  assert 'vit-train: the terminal closed (SIGHUP) at step ' in last, last


def _patched_cli(tmp_path, code, *extra, **env):
  """The CLI run by `code` (a script that patches vit_jax, then calls main.run()) with the
  suite's flags, --workdir=run and `extra`, in `tmp_path`."""
  return subprocess.run([sys.executable, '-c', code, *with_flags([*ARGS, '--workdir=run'], extra)],
                        cwd=tmp_path, env=dict(_env(),
                                               **env), capture_output=True, text=True, timeout=300)


_STOPPED_OUTSIDE_THE_LOOP = {
    'SIGTERM': (143, 'vit-train: preempted (SIGTERM) outside the training steps (set-up, compile '
                'or wrap-up): {}'),
    'SIGHUP': (129, 'vit-train: the terminal closed (SIGHUP) outside the training steps (set-up, '
               'compile or wrap-up): {} (under nohup, tmux or screen a run outlives its terminal)')
}
# What the line says is left: in a workdir with checkpoints, in a new one, in one not known yet.
_KEPT = 'the saved checkpoints are kept; run the same command to resume'
_NONE_SAVED = 'nothing was saved; run the same command to start again'
_NOT_LOOKED_AT = 'nothing new was saved; run the same command again'


def _outside_the_loop_says(sig, left):
  status, line = _STOPPED_OUTSIDE_THE_LOOP[sig]
  return status, line.format(left)


@pytest.mark.parametrize('sig,lands_in,resumed', [('SIGTERM', 'set-up', False),
                                                  ('SIGTERM', 'a __del__', False),
                                                  ('SIGHUP', 'set-up', False),
                                                  ('SIGHUP', 'a __del__', False),
                                                  ('SIGTERM', 'set-up', True)])
def test_a_signal_before_the_loop_releases_the_lock_and_says_so(tmp_path, lands_in, sig, resumed):
  """A TPU VM preempted (SIGTERM) or a terminal closed (SIGHUP) while the run restores or
  compiles (minutes on a large model) got a plain signal death (143, 129), no message, and
  a lock left behind. Where the signal lands in a garbage-collection callback or a
  __del__, Python drops the handler's exception ("Exception ignored"): the run trained on
  to the end. Each exits with the shell's status for its signal, as in the loop (SIGTERM
  had exited 0, which a resume loop or `&&` reads as a finished run). A new run's line had
  said its saved checkpoints were kept."""
  if resumed:  # a finished run: its rerun restores the state too
    assert _cli(tmp_path, 'run')[0] == 0
  kill = f'os.kill(os.getpid(), signal.{sig})'
  code = ('import os, signal, sys\n'
          'from vit_jax import main, step\n'
          'create = step.create_train_state\n'
          'class Freed:\n'
          f'  def __del__(self): {kill}\n'
          'def restored(*args):  # the state made, the step to compile next\n'
          '  made = create(*args)\n'
          f'  {kill if lands_in == "set-up" else "Freed()"}\n'
          '  return made\n'
          'step.create_train_state = restored\n'
          'main.run()\n')
  proc = _patched_cli(tmp_path, code, VIT_JAX_HOST_ALLOCATOR='system')
  status, says = _outside_the_loop_says(sig, _KEPT if resumed else _NONE_SAVED)
  assert proc.returncode == status, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1] == says
  # Where the user of a closed terminal, or of a preempted TPU VM, looks.
  log = (tmp_path / 'run' / 'train.INFO').read_text()
  assert log.strip().splitlines()[-1].endswith(says), log[-2000:]
  assert not (tmp_path / 'run' / 'lock').exists()
  assert ('Exception ignored' in proc.stderr) == (lands_in == 'a __del__')
  assert 'step 1/' not in proc.stderr
  assert (tmp_path / 'run' / 'final.npz').exists() == resumed


_INTERRUPTED_BEFORE_TRAINING = 'vit-train: interrupted (Ctrl-C) before training started: {}'


@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGHUP', 'SIGINT'])
@pytest.mark.parametrize('lands_in', ['start-up', 'a __del__'])
def test_a_signal_during_start_up_is_its_one_line(tmp_path, sig, lands_in):
  """While vit-train imports TensorFlow and checks the config (~2 s before its workdir),
  SIGTERM and SIGHUP had killed it silently (no line) and Ctrl-C printed a
  traceback. A signal landing in a __del__ or a garbage-collection callback (JAX has one,
  run as TensorFlow imports), where Python drops the handler's exception, had been ignored."""
  kill = f'os.kill(os.getpid(), signal.{sig})'
  code = (CTRL_C_AS_IN_A_TERMINAL + 'import os, signal\n'
          'from vit_jax import tensorflow_quietly, main, rundir  # as main imports them\n'
          'recorded = rundir.recorded_cpu_flags\n'
          'class Freed:\n'
          f'  def __del__(self): {kill}\n'
          'def read(*args):  # TensorFlow imported, the backend not started\n'
          f'  {kill if lands_in == "start-up" else "Freed()"}\n'
          '  return recorded(*args)\n'
          'rundir.recorded_cpu_flags = read\n'
          'main.run()\n')
  proc = _patched_cli(tmp_path, code)  # jemalloc where installed: the re-exec's signal mask
  status, says = dict(_STOPPED_OUTSIDE_THE_LOOP, SIGINT=(130, _INTERRUPTED_BEFORE_TRAINING))[sig]
  says = says.format(_NONE_SAVED)  # a workdir named, not there yet
  assert proc.returncode == status, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [says]
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('after_s', [0.01, 0.03])
def test_sigterm_inside_jaxlibs_initialisation_waits_for_it(tmp_path, after_s):
  """SIGTERM 0.2-0.3 s into vit-train, as it first imported jax, landed inside jaxlib's
  extension initialisation: an ImportError traceback of ~85 lines (exit 1) or a crash
  (SIGSEGV, exit 139)."""
  code = ('import os, signal, sys, threading\n'
          'class Preempt:\n'
          '  def find_spec(self, name, path=None, target=None):\n'
          '    if name == "jaxlib._jax":\n'
          '      sys.meta_path.remove(self)\n'
          f'      threading.Timer({after_s}, os.kill, (os.getpid(), signal.SIGTERM)).start()\n'
          'sys.meta_path.insert(0, Preempt())\n'
          'from vit_jax import main\n'
          'main.run()\n')
  proc = _patched_cli(tmp_path, code, VIT_JAX_HOST_ALLOCATOR='system')
  status, says = _outside_the_loop_says('SIGTERM', _NOT_LOOKED_AT)  # flags not read yet
  assert (proc.returncode, proc.stderr.strip().splitlines()) == (status, [says
                                                                         ]), proc.stderr[-3000:]


def test_a_signal_pending_across_the_allocator_re_exec_lands_after_it(tmp_path):
  """vit-train re-executes itself to preload jemalloc; a signal Python took during the
  execve was lost (the run went on). It is blocked there and lands in the new process."""

  code = ('import os, signal\n'
          'signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])\n'
          'os.kill(os.getpid(), signal.SIGTERM)  # pending, as across the exec\n'
          'from vit_jax import main\n'
          'main.run()\n')
  proc = _patched_cli(tmp_path, code)
  # It lands before the flags are read.
  status, says = _outside_the_loop_says('SIGTERM', _NOT_LOOKED_AT)
  assert proc.returncode == status, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [says]
  assert not (tmp_path / 'run').exists()


def test_a_signal_as_the_checkpoints_open_is_the_last_line(tmp_path):
  """SIGTERM just after the checkpoint manager was made (a save cut short by kill -9 left a
  temporary directory to remove): orbax removed it in a thread of its own, which the exit
  cut short; its error came after the run's last line."""
  cut_short = tmp_path / 'run' / 'checkpoints' / '10.orbax-checkpoint-tmp'
  os.makedirs(cut_short)
  code = ('import os, signal\n'
          'from vit_jax import checkpoint, main\n'
          'make = checkpoint.train_state_manager\n'
          'def made(*args):\n'
          '  manager = make(*args)\n'
          '  os.kill(os.getpid(), signal.SIGTERM)\n'
          '  return manager\n'
          'checkpoint.train_state_manager = made\n'
          'main.run()\n')
  proc = _patched_cli(tmp_path, code, VIT_JAX_HOST_ALLOCATOR='system')
  status, says = _outside_the_loop_says('SIGTERM', _NONE_SAVED)  # an unfinished save only
  assert proc.returncode == status, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1] == says, proc.stderr[-3000:]
  assert not cut_short.exists() and not (tmp_path / 'run' / 'lock').exists()


def test_a_run_under_nohup_ignores_sighup_before_the_loop(tmp_path):
  code = ('import os, signal\n'
          'from vit_jax import main, rundir\n'
          'check = rundir.check_resume_config\n'
          'def hung_up(*args):\n'
          '  os.kill(os.getpid(), signal.SIGHUP)\n'
          '  return check(*args)\n'
          'rundir.check_resume_config = hung_up\n'
          'signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does\n'
          'main.run()\n')
  proc = _patched_cli(tmp_path, code, '--config.total_steps=4', VIT_JAX_HOST_ALLOCATOR='system')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (tmp_path / 'run' / 'final.npz').exists()


# 7. Bad values: one line at start-up.
def test_zero_periods_mean_only_at_the_end(tmp_path):
  rc, err, last = _cli(tmp_path, 'run', '--config.total_steps=12',
                       '--config.checkpoint_every_steps=0', '--config.log_every_steps=0',
                       '--config.keep_checkpoints=-1')
  assert rc == 0, err[-3000:]
  assert _steps(tmp_path / 'run') == ['12']
  assert 'step 12/12' in err and 'step 10/12' not in err


def test_a_pretrained_path_that_cannot_be_read_is_one_line(tmp_path):
  """Missing: refused at start-up, before the workdir exists; damaged: one line, not a
  traceback."""
  rc, err, last = _cli(tmp_path, 'run', '--config.pretrained_path=nope.npz')
  assert rc == 1 and 'Traceback' not in err, err[-3000:]
  assert last.startswith(f'vit-train: pretrained_path {tmp_path / "nope.npz"} does not exist: '
                         'set --config.pretrained_path to a checkpoint .npz'), last
  assert not (tmp_path / 'run').exists()
  (tmp_path / 'damaged.npz').write_bytes(b'not a zip file')
  rc, err, last = _cli(tmp_path, 'run', '--config.pretrained_path=damaged.npz')
  assert rc == 1 and 'Traceback' not in err, err[-3000:]
  assert last.startswith('vit-train: pretrained_path ') and last.endswith(
      'damaged.npz is not a readable .npz (zip) file: check the path and download'), last
  # Pickled (object) arrays: refused unread, and one line (had been a traceback).
  np.savez(tmp_path / 'pickled.npz', a=np.array([{'x': 1}], dtype=object))
  rc, err, last = _cli(tmp_path, 'run', '--config.pretrained_path=pickled.npz')
  assert rc == 1 and 'Traceback' not in err, err[-3000:]
  assert last == (f'vit-train: pretrained_path {tmp_path / "pickled.npz"} holds pickled (object) '
                  'arrays, which are never loaded: re-export it with numeric arrays only (e.g. '
                  'checkpoint.save_npz)'), last
  # Readable, of another model: had been a traceback (in-process: the CLI prints the same
  # ConfigError as above).
  other = tmp_path / 'other.npz'
  np.savez(other, **{'Transformer/encoder_norm/scale': np.ones(8, np.float32)})
  with pytest.raises(train.ConfigError) as e:
    train.train_and_evaluate(_config(pretrained_path=str(other)), str(tmp_path / 'run2'))
  assert str(e.value) == (
      f'pretrained_path {other} does not fit model ViT-Ti_16: Model parameter '
      'Transformer/encoder_norm/bias (and 20 more) '
      'is not in the checkpoint: the checkpoint is of another architecture (e.g. classifier '
      'token vs gap, representation_size); pick the model matching the file')


@pytest.mark.parametrize('bad', ['strings', 'nan'])
def test_a_pretrained_file_of_non_numbers_is_one_line(good, tmp_path, bad):
  """A parameter of strings had been a traceback deep in load_pretrained, and a NaN one a
  'training diverged' line that blamed the learning rate."""
  with np.load(good / 'final.npz', allow_pickle=False) as npz:
    flat = dict(npz)
  key = 'Transformer/encoder_norm/scale'
  flat[key] = np.full(flat[key].shape, 'x') if bad == 'strings' else flat[key] * np.nan
  path = tmp_path / 'bad.npz'
  np.savez(path, **flat)
  with pytest.raises(train.ConfigError) as e:
    train.train_and_evaluate(_config(pretrained_path=str(path)), str(tmp_path / 'run'))
  reason = (f'holds {key} as <U1, not floating-point: re-export it with float arrays'
            if bad == 'strings' else f'holds NaN or infinite values in {key}: it is damaged or '
            'from a diverged run')
  assert str(e.value).startswith(f'pretrained_path {path} {reason}'), str(e.value)


def test_bad_value_is_one_line_from_the_cli(tmp_path):
  rc, err, last = _cli(tmp_path, 'run', '--config.mesh_data=3')
  assert rc == 1
  assert last == ('vit-train: mesh_data 3 does not fit the 8 devices: set --config.mesh_data '
                  'to -1 (all) or a divisor of 8 (1, 2, 4, 8)'), last
  assert 'Traceback' not in err
  rc, err, last = _cli(tmp_path, 'run', '--config.model.num_heads=3')  # was a traceback
  assert rc == 1 and 'Traceback' not in err
  assert last.startswith('vit-train: model.num_heads 3 does not divide model.hidden_size 64'), last
  rc, err, last = _cli(tmp_path, 'run', '--config.eval_split=tset')
  assert rc == 1 and 'Traceback' not in err
  assert last == ("vit-train: eval_split 'tset': Unknown split 'tset'. Should be one of ['train', "
                  "'test']: set --config.eval_split"), last
  # Without XLA_FLAGS, as in a user's shell: the quickstart splits the CPU in two devices.
  rc, err, last = _cli(tmp_path, 'run', '--config.batch_size=33', devices=None)
  assert rc == 1 and 'Traceback' not in err
  assert last == ('vit-train: batch_size 33 must be a multiple of the 2 devices: set '
                  '--config.batch_size or --config.cpu_devices=1'), last
  rc, err, last = _cli(tmp_path, 'run', '--config.batch_size=33')  # XLA_FLAGS: 8 devices
  assert last == ('vit-train: batch_size 33 must be a multiple of the 8 devices: set '
                  '--config.batch_size or another device count (XLA_FLAGS '
                  '--xla_force_host_platform_device_count decides, not cpu_devices)'), last
  rc, err, last = _cli(tmp_path, 'run', '--config.cpu_devices=0', devices=None)
  assert rc == 1 and 'Traceback' not in err
  assert last == ('vit-train: cpu_devices 0 must be a whole number >= 1: set --config.cpu_devices '
                  '(1: the CPU is one device)'), last
  # Typed as a user types them: nan had turned clipping off silently; a grid of a word and
  # a number (a tuple of one string to ml_collections) had been a TypeError's traceback.
  rc, err, last = _cli(tmp_path, 'run', '--config.grad_clip_norm=nan')
  assert rc == 1 and 'Traceback' not in err
  assert last == ('vit-train: grad_clip_norm nan is not a finite number: set '
                  '--config.grad_clip_norm to a number'), last
  rc, err, last = _cli(tmp_path, 'run', '--config.lr_grid=0.01,inf')
  assert rc == 1 and 'Traceback' not in err
  assert last == ("vit-train: lr_grid ('0.01,inf',) must hold learning rates > 0: set "
                  '--config.lr_grid, e.g. to 0.003,0.01'), last
  assert not (tmp_path / 'run').exists()


def test_a_damaged_fashion_mnist_file_is_one_line_that_names_it(tmp_path):
  # Had been an EOFError's traceback (a truncated download) and, for a short file, a
  # reshape error blamed on --config.train_split.
  source = '/usr/share/datasets/fashion-mnist'
  images = 'train-images-idx3-ubyte.gz'
  with gzip.open(os.path.join(source, images)) as f:
    raw = f.read()
  damages = {
      'cut': lambda path: path.write_bytes(_read(os.path.join(source, images))[:50_000]),
      'short': lambda path: path.write_bytes(gzip.compress(raw[:-100])),
      'plain': lambda path: path.write_bytes(raw),
  }
  fix = (': replace it with the original Fashion-MNIST file (`apt-get install --reinstall '
         'dataset-fashion-mnist`)')
  for name, damage in damages.items():
    shutil.copytree(source, tmp_path / name)
    damage(tmp_path / name / images)
    if name == 'cut':  # from the shell once; the others in this process (~20 s a run)
      rc, err, last = _cli(tmp_path, 'run', f'--config.data_dir={name}')
      assert rc == 1 and 'Traceback' not in err, err
    else:
      with pytest.raises(train.ConfigError) as e:
        train.train_and_evaluate(_config(data_dir=str(tmp_path / name)), str(tmp_path / 'run'))
      last = f'vit-train: {e.value}'
    assert last.startswith(f'vit-train: {tmp_path / name / images} '), last
    assert last.endswith(fix) and 'train_split' not in last, last
  assert not (tmp_path / 'run').exists()


def test_a_bad_value_is_refused_before_tensorflow_and_the_backend_start(tmp_path):
  """A value wrong on any machine is one line before TensorFlow loads (most of the ~9 s a
  refused run took) and before the backend starts; what needs the devices comes after."""
  env = dict(_env(None), PYTHONPROFILEIMPORTTIME='1')  # a line of stderr per import
  proc = subprocess.run([
      sys.executable, '-m', 'vit_jax.main', '--config=quickstart', '--workdir=run',
      '--config.model.num_heads=3'
  ], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert lines[-1].startswith('vit-train: model.num_heads 3 does not divide'), lines[-1]
  imported = {l.rsplit('|', 1)[-1].strip() for l in lines if l.startswith('import time:')}
  assert {'jax', 'vit_jax.config_checks'} <= imported, sorted(imported)[:20]
  assert not {'tensorflow', 'vit_jax.rundir', 'vit_jax.train'} & imported
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('workdir', ['', ' '])
def test_an_empty_workdir_is_refused_not_taken_as_the_current_folder(tmp_path, workdir,
                                                                     monkeypatch):
  # `--workdir=$WORKDIR` with the variable unset had trained into the current folder.
  message = ('--workdir is empty (an unset shell variable?): pass a folder, e.g. '
             '--workdir=workdirs/NAME')
  rc, err, last = _cli(tmp_path, workdir)
  assert (rc, last) == (1, f'vit-train: {message}') and 'Traceback' not in err, err[-2000:]
  monkeypatch.chdir(tmp_path)
  with pytest.raises(train.ConfigError, match=re.escape(message)):
    train.train_and_evaluate(_config(), workdir)
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize('workdir, held', [('runs/w[1]', "'['"), ('a\\b', 'a backslash')])
def test_a_workdir_whose_path_orbax_cannot_save_under_is_refused(tmp_path, workdir, held):
  """orbax finds the parts of a save by an unescaped glob of its path. Under runs/w[1] the
  run trained, but its checkpoints were left unmerged: the rerun set them all aside as
  damaged and refused to train again over final.npz. Under a\\b tensorstore wrote them to
  a/b, outside the workdir."""
  message = (f'--workdir={workdir}: orbax cannot save checkpoints under a path holding {held} '
             f"({tmp_path / workdir}): use a --workdir whose path has no '[' or backslash")
  rc, err, last = _cli(tmp_path, workdir)
  assert (rc, last) == (1, f'vit-train: {message}') and 'Traceback' not in err, err[-2000:]
  absolute = str(tmp_path / workdir)
  with pytest.raises(
      train.ConfigError, match=re.escape(f'--workdir={absolute}: orbax cannot save '
                                         f'checkpoints under a path holding {held}:')):
    train.train_and_evaluate(_config(), absolute)
  assert not os.listdir(tmp_path)


def _config(**overrides):
  c = quickstart.get_config()
  c.model.num_layers = 1
  c.update(total_steps=3, warmup_steps=1, batch_size=16, eval_batch_size=16,
           train_split='train[:64]', eval_split='test[:16]')
  for k, v in overrides.items():
    if isinstance(v, dict):
      c[k].update(v)
    else:
      c[k] = v
  return c


def _make_folder(root, empty_class):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  for split in ('train', 'test'):
    for name in ('a', 'b'):
      os.makedirs(root / split / name)
      for i in range(2):
        Image.new('RGB', (28, 28), (i * 40, 0, 0)).save(root / split / name / f'{i}.png')
  os.makedirs(root / 'train' / empty_class)
  return f'folder:{root}'


@pytest.mark.parametrize(
    'overrides,message',
    [
        (dict(mesh_data=3), r'mesh_data 3 does not fit the 8 devices: set --config.mesh_data'),
        (dict(keep_checkpoints=0), r'keep_checkpoints 0 would keep no checkpoint .*-1 keeps all'),
        (dict(log_every_steps=-1), r'log_every_steps -1 is negative: set --config.log_every_steps'),
        (dict(on_nonfinite='ignore'), r"on_nonfinite 'ignore' is unknown"),
        (dict(dtype='float16'), r"dtype 'float16' is unknown: set --config.dtype to one of "
         r"\('float32', 'bfloat16'\)"),
        (dict(num_classes=5), r'num_classes 5 is smaller than the dataset\'s 10 classes .* '
         r'--config.num_classes=10'),
        (dict(num_classes=12), r'^num_classes 12 is more than the dataset\'s 10 classes '
         r'\(fashion_mnist_local\): set --config.num_classes=10 or -1 \(from the dataset\)$'),
        (dict(num_classes=0), r'^num_classes 0 is no head size: set --config.num_classes to the '
         r'number of classes, or -1 \(from the dataset\)$'),
        (dict(num_classes=-10), r'^num_classes -10 is no head size'),
        (dict(shuffle_buffer=0),
         r'^shuffle_buffer 0 must be >= 1: set --config.shuffle_buffer to '),
        (dict(train_split='train[90%:80%]'), r"^train_split 'train\[90%:80%\]': its slice ends "
         r'before it starts \(start=54000, end=48000\): set --config.train_split$'),
        # The evaluations' datasets: the fix is not the run's own data_dir.
        (dict(eval_real=True), r'^eval_real: dataset imagenet2012_real is not prepared in data_dir '
         r'.*: run `vit-tfds-build imagenet2012_real --data_dir=.*` \(its files downloaded by hand .*\) '
         r'or set --config.eval_real=False\.$'),
        (dict(fewshot_every_steps=2, fewshot_datasets=(('mnist', 'train', 'test'),),
              fewshot_data_dir='DATA'),
         r'^fewshot_datasets mnist: dataset mnist is not prepared in data_dir .*DATA: run `vit-tfds-build '
         r'mnist --data_dir=.*DATA` or set --config.fewshot_data_dir to where it is prepared \(or '
         r'leave it out of --config.fewshot_datasets\)\.$'),
        (dict(fewshot_every_steps=2,
              fewshot_cache_mb=-5), r'^fewshot_cache_mb -5 is negative: set '),
        (dict(fewshot_every_steps=2, fewshot_datasets=(('fashion_mnist_local', 'train', 'tst'),)),
         r"^fewshot_datasets fashion_mnist_local held-out split 'tst': Unknown split 'tst'. Should be "
         r"one of \['train', 'test'\]: set --config.fewshot_datasets$"),
        (dict(dataset='mnist', data_dir='DATA'),
         r'dataset mnist is not prepared in data_dir .*DATA: run `vit-tfds-build mnist '
         r'--data_dir=.*DATA` or set --config.data_dir'),
        (dict(dataset='FOLDER'), r'class folder .*/train/c holds no images'),
        (dict(pp=dict(eval_crop='center')),
         r"pp.eval_crop 'center' is unknown: set --config.pp.eval_crop to one of"),
        (dict(pp=dict(inception_min_area=2.0)),
         r'pp.inception_min_area 2.0 is a fraction .* \(0, 1\]'),
        (dict(eval_batch_size=0), r'eval_batch_size 0 must be > 0: set --config.eval_batch_size$'),
        (dict(eval_batch_size=4), r'eval_batch_size 4 is not a multiple of the 8 devices'),
        (dict(label_smoothing=1.0), r'label_smoothing 1.0 is a fraction .* in \[0, 1\)'),
        (dict(model=dict(dropout_rate=2.0)), r'model.dropout_rate 2.0 is a probability: set '
         r'--config.model.dropout_rate to a value in \[0, 1\)'),
        (dict(model=dict(num_heads=3)), r'model.num_heads 3 does not divide model.hidden_size 64 '
         r'.*: set --config.model.num_heads or --config.model.hidden_size'),
        (dict(model=dict(patch_size=0)), r'model.patch_size 0 must be a whole number >= 1: set '
         r'--config.model.patch_size'),
        (dict(image_size=0),
         r'image_size 0 must be >= 1 \(pixels per side\): set --config.image_size'),
        (dict(image_size=-4), r'image_size -4 must be >= 1'),
        (dict(cpu_devices=-1),
         r'cpu_devices -1 must be a whole number >= 1: set --config.cpu_devices'),
        (dict(grad_clip_norm=float('nan')),
         r'^grad_clip_norm nan is not a finite number: set --config.grad_clip_norm to a number$'),
        (dict(pp=dict(central_crop_fraction=float('inf'))),
         r'^pp.central_crop_fraction inf is not a '
         r'finite number: set --config.pp.central_crop_fraction to a number$'),
        (dict(base_lr=1e40), r'^base_lr 1e\+40 is beyond float32, in which the schedule '
         r'computes \(largest 3.4e\+38\): set --config.base_lr to a learning rate, e.g. 0.001$'),
        (dict(lr_grid=(0.01, float('nan'))), r'^lr_grid \(0.01, nan\) is not a finite number: set '
         r'--config.lr_grid to numbers$'),
        (dict(device_memory_mb=-1.0), r'^device_memory_mb -1.0 is negative: set '
         r'--config.device_memory_mb to the memory per device in MiB, or 0 to ask the device$'),
    ])
def test_bad_values_fail_at_start_up(tmp_path, overrides, message):
  # (The nan and inf cases: a comparison with nan is false, so range checks let it through.
  # eval_real and fewshot_datasets: their data is checked before the workdir is made; it
  # had been a traceback once the run had begun.)
  for field in ('data_dir', 'fewshot_data_dir'):
    if overrides.get(field) == 'DATA':
      overrides[field] = str(tmp_path / 'DATA')
  if overrides.get('dataset') == 'FOLDER':
    overrides['dataset'] = _make_folder(tmp_path / 'images', 'c')
  with pytest.raises(train.ConfigError, match=message):
    train.train_and_evaluate(_config(**overrides), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_a_kshot_pool_smaller_than_the_shots_is_one_line_before_the_workdir(tmp_path):
  """It had been found once the step had compiled (minutes on a large model), after the
  workdir and its config.json were written."""
  rc, err, last = _cli(
      tmp_path, 'run', '--config.fewshot_every_steps=2', '--config.fewshot_shots=(1, 10)',
      '--config.fewshot_datasets='
      "(('fashion_mnist_local', 'train[:16]', 'test[:16]'),)")
  assert rc == 1 and 'Traceback' not in err, err[-3000:]
  assert re.fullmatch(
      r'vit-train: few-shot evaluation: Class \d+ \(.*\) has \d examples, fewer than 10 shots: '
      r'.* \(--config.fewshot_datasets, --config.fewshot_shots\)', last), last
  assert not (tmp_path / 'run').exists()


def test_a_relative_folder_dataset_is_recorded_as_an_absolute_path(tmp_path, monkeypatch):
  # vit-evaluate and vit-predict read config.json from other directories.
  _make_folder(tmp_path / 'images', 'c')
  os.rmdir(tmp_path / 'images' / 'train' / 'c')
  monkeypatch.chdir(tmp_path)
  train.train_and_evaluate(
      _config(dataset='folder:images', train_split='train', eval_split='test', batch_size=8,
              eval_batch_size=8), 'run', stop_after_steps=0)
  with open(tmp_path / 'run' / 'config.json') as f:
    assert json.load(f)['dataset'] == f'folder:{tmp_path}/images'


@pytest.mark.parametrize(
    'text,spec,message',
    [
        ('def get_config(:\n', 'my.py', r'my.py:1: invalid syntax: fix the config file'),
        ('import no_such_module\n', 'my.py',
         r"my.py: No module named 'no_such_module': fix the import"),
        ('import ml_collections\ndef get_config():\n  c = ml_collections.ConfigDict()\n'
         '  c.batch_size = 8\n  return c\n', 'my.py', r'my.py: the config lacks \w+, .* and \d+ '
         r'more: start from vit_jax.configs.common.get_config\(\)'),
        # The file's own errors had been bare ("invalid literal for int() ..."), naming no file.
        ('def get_config(arg):\n  return int(arg)\n', 'my.py',
         r"my.py: get_config\(\) failed \(get_config\(\) missing 1 required positional argument: "
         r"'arg'\): fix the config file or the argument after ':' in --config"),
        ('def get_config(arg):\n  return int(arg)\n', 'my.py:abc',
         r"my.py: get_config\('abc'\) failed \(invalid literal for int\(\) with base 10: 'abc'\)"),
        # Any other exception the file raises had been a traceback.
        ('def get_config():\n  c = None\n  c.batch_size = undefined_name\n', 'my.py',
         r"^vit-train: my.py:3: NameError: name 'undefined_name' is not defined: fix the config "
         r'file \(see --help\)$'),
        ('settings = {}\nsize = settings["size"]\n', 'my.py',
         r"^vit-train: my.py:2: KeyError: 'size': fix the config file"),
        # Fields set to None (ConfigDict allows it) had ended in TypeError tracebacks.
        ('from vit_jax.configs import quickstart\ndef get_config():\n'
         '  c = quickstart.get_config()\n  c.dataset = None\n  c.batch_size = None\n'
         '  c.pp.inception_min_area = None\n  return c\n', 'my.py',
         r'^vit-train: my.py: batch_size, dataset, pp.inception_min_area are None: give each a '
         r'value \(configs/common.py says what each field holds\), or leave the default of '
         r'common.get_config\(\)'),
        ('from vit_jax.configs import quickstart\ndef get_config():\n'
         '  c = quickstart.get_config()\n  c.model.dropout_rate = None\n  return c\n', 'my.py',
         r'^vit-train: model.dropout_rate None is a probability: set --config.model.dropout_rate'),
    ])
def test_a_broken_config_file_is_one_line(tmp_path, text, spec, message):
  (tmp_path / 'my.py').write_text(text)
  proc = subprocess.run([sys.executable, '-m', 'vit_jax.main', f'--config={spec}', '--workdir=w'],
                        cwd=tmp_path, env=_env(1), capture_output=True, text=True, timeout=120)
  last = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert re.search(message, last), last


def test_label_beyond_the_head_stops_the_run(tmp_path):
  from tests import data_fixtures  # pylint: disable=g-import-not-at-top
  data = data_fixtures.write_idx(str(tmp_path / 'idx'), num_train=32, num_test=16,
                                 num_classes=12)  # labels 0..11 in 10-class files
  config = _config(data_dir=data, train_split='train', eval_split='test')
  with pytest.raises(train.ConfigError, match='has label 1[01], but Fashion-MNIST has 10'):
    train.train_and_evaluate(config, str(tmp_path / 'run'))


def test_final_npz_honours_the_umask(tmp_path):
  from vit_jax import checkpoint  # pylint: disable=g-import-not-at-top
  old = os.umask(0o027)
  try:
    checkpoint.save_npz(str(tmp_path / 'f.npz'), {'embedding': {'kernel': np.zeros(2)}})
  finally:
    os.umask(old)
  assert os.stat(tmp_path / 'f.npz').st_mode & 0o777 == 0o640


# 8. Elastic resume: checkpointed on 8 devices, resumed on 4.
def test_resume_on_fewer_devices_continues_the_same_run(good, tmp_path):
  run = _copy(good, tmp_path)
  shutil.rmtree(run / 'checkpoints' / '30')
  os.remove(run / 'final.npz')
  rc, err, last = _cli(tmp_path, 'run', devices=4)
  assert rc == 0, err[-3000:]
  assert 'Resuming from the checkpoint of step 20' in err and '4 global devices' in err
  # Local data: the batches are a function of (seed, step), whatever the devices, so the
  # resumed run ends where the 8-device run did (up to reduction order).
  with np.load(good / 'final.npz') as a, np.load(run / 'final.npz') as b:
    for k in a.files:
      np.testing.assert_allclose(a[k], b[k], atol=2e-5, rtol=0, err_msg=k)


def _python(tmp_path, *lines):
  """Runs the lines as a Python program of two CPU devices."""
  return subprocess.run([sys.executable, '-c', '\n'.join(lines)], cwd=tmp_path, env=_env(2),
                        capture_output=True, text=True, timeout=120)


def test_a_run_started_under_nohup_ignores_sighup(tmp_path):
  proc = _python(
      tmp_path, 'import os, signal', 'from vit_jax import train',
      'signal.signal(signal.SIGHUP, signal.SIG_IGN)', 'p = train._Preemption()',
      'signal.raise_signal(signal.SIGHUP)',
      'assert p.requested is None and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN',
      'p.close()', 'signal.signal(signal.SIGHUP, signal.SIG_DFL)', 'p = train._Preemption()',
      'signal.raise_signal(signal.SIGHUP)', 'assert p.requested == "SIGHUP"', 'p.close()',
      'assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL', 'print("ok")')
  assert proc.returncode == 0 and proc.stdout.strip() == 'ok', proc.stderr[-3000:]


@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGHUP'])
def test_a_second_sigterm_or_sighup_while_the_first_unwinds_is_ignored(tmp_path, sig):
  """vit-sweep passes SIGTERM and SIGHUP on to its point, which most often got it from its
  process group too: the second raised again while the first unwound (the lock's release,
  the line), in start-up, outside the loop and in the loop alike. (Each part starts from
  Python's default handler, as the run it stands for.)"""
  kill, fresh = f'signal.raise_signal(signal.{sig})', f'signal.signal(signal.{sig}, signal.SIG_DFL)'
  proc = _python(tmp_path, 'import os, signal', 'from vit_jax import main, train',
                 'main._stop_while_starting()', 'try:', f'  {kill}',
                 'except main._StoppedWhileStarting:', f'  {kill}', fresh,
                 'with train._signals_outside_the_loop():', '  try:', f'    {kill}',
                 '  except (train.PreemptedOutsideTheLoop, train.TerminalClosedOutsideTheLoop):',
                 f'    {kill}', fresh, 'with train._signals_outside_the_loop():',
                 '  p = train._Preemption()', f'  {kill}', f'  {kill}',
                 f'  assert p.requested == "{sig}"', '  p.close()', 'print("ok")')
  assert proc.returncode == 0 and proc.stdout.strip() == 'ok', proc.stderr[-3000:]


def test_second_ctrl_c_aborts_at_once(tmp_path):
  """It had said 'the last complete checkpoint is kept' before any was written. train.INFO
  ends with the line too, as after the other stops, and the run's lock is gone (both had
  been left as they were)."""
  run = tmp_path / 'run'
  run.mkdir()
  (run / 'train.INFO').write_text('W1205 ... Ctrl-C: saving a checkpoint after this step\n')
  proc = _python(tmp_path, 'import os, signal, time', 'from vit_jax import rundir, train',
                 f'rundir.WorkdirLock({str(run)!r}).acquire()',
                 f'p = train._Preemption({str(run)!r})', 'signal.raise_signal(signal.SIGINT)',
                 'assert p.requested == "SIGINT"', 'signal.raise_signal(signal.SIGINT)',
                 'time.sleep(30)')
  assert proc.returncode == 130, proc.stderr[-3000:]
  line = ('vit-train: second Ctrl-C: stopped at once, without saving this step: run the same '
          'command to resume from the last complete checkpoint (from step 0 if none was written)')
  assert proc.stderr.strip().splitlines()[-1] == line
  assert (run / 'train.INFO').read_text().splitlines()[-1] == line
  assert not (run / 'lock').exists()


def test_full_disk_at_start_up_is_one_line(tmp_path):
  rc, err, last = _cli(tmp_path, 'run', file_size_limit=1)
  assert rc == 1, err[-3000:]
  assert last.startswith('vit-train: cannot write to workdir ') and 'File too large' in last, last
  assert 'Traceback' not in err


def test_workdir_that_cannot_be_created_is_one_line(tmp_path):
  (tmp_path / 'a_file').write_text('')
  rc, err, last = _cli(tmp_path, 'a_file/run')
  assert rc == 1
  assert last == (f'vit-train: cannot create workdir {tmp_path}/a_file/run: {tmp_path}/a_file is '
                  'not a directory: choose a writable --workdir'), last
  assert 'Traceback' not in err
  # A link to a folder that is gone (an unmounted disk) had been told 'File exists'.
  os.symlink('gone/data', tmp_path / 'link')
  rc, err, last = _cli(tmp_path, 'link/run')
  assert (rc, last) == (1, f'vit-train: cannot create workdir {tmp_path}/link/run: {tmp_path}/link '
                        f'is a symbolic link to {tmp_path}/gone/data, which does not exist: create '
                        f'{tmp_path}/gone/data (mkdir -p) or choose a writable --workdir'), last


def test_a_bucket_that_cannot_be_written_names_credentials(monkeypatch):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def denied(path):
    raise tf.errors.PermissionDeniedError(None, None, f'403 on {path}')

  monkeypatch.setattr(train.tf.io.gfile, 'makedirs', denied)
  with pytest.raises(
      train.ConfigError, match=r'cannot create workdir gs://b/wd: 403 on gs://b/wd: '
      r'check the bucket name, this machine\'s network and its credentials \(gcloud auth '
      r'application-default login\), or choose another --workdir$'):
    train.train_and_evaluate(_config(), 'gs://b/wd')


@pytest.mark.parametrize('model,note', [
    ('ViT-Ti_16', ' (ViT-Ti_16 is not among the published ImageNet-21k checkpoints this default '
     'path is known for: ViT-B_16, ViT-B_32, ViT-L_16, ViT-L_32, ViT-H_14, R50+ViT-B_16, R50x1, '
     'R101x1, R152x2; set --config.pretrained_path to a ViT-Ti_16 .npz)'),
    ('ViT-B_16', ''),
])
def test_an_unpublished_default_checkpoint_is_named(monkeypatch, tmp_path, model, note):
  """finetune:ViT-Ti_16's default pretrained_path, gs://vit_models/imagenet21k/ViT-Ti_16.npz,
  was never published: out of reach, the fix had been only to download that address."""
  opened, stat = checkpoint.paths.open_file, checkpoint.paths.stat

  def offline(path, *args):
    if str(path).startswith('gs://'):
      raise OSError(f'{path}: could not reach storage.googleapis.com')
    return (opened if args else stat)(path, *args)

  monkeypatch.setattr(checkpoint.paths, 'stat', offline)  # asked before the workdir is made
  monkeypatch.setattr(checkpoint.paths, 'open_file', offline)  # read as the state is made
  path = finetune.pretrained_path(model)
  with pytest.raises(train.ConfigError) as e:
    train.train_and_evaluate(_config(model_name=model, pretrained_path=path), str(tmp_path / 'wd'))
  public = path.replace('gs://', 'https://storage.googleapis.com/')
  assert str(e.value) == (
      f'pretrained_path {path} cannot be read ({path}: could not reach storage.googleapis.com): '
      f'download it (curl -O {public}, or gsutil cp) and pass the local file as '
      f'--config.pretrained_path=FILE{note}')


def test_a_pretrained_path_in_a_bucket_out_of_reach_says_why(tmp_path):
  """With TensorFlow's own error (the test above mocks one): its last line, all that was
  said, is only '\t when reading metadata of gs://...'."""
  out = console_script('vit-train', tmp_path, '--config=quickstart', '--workdir=w',
                       '--config.pretrained_path=gs://vit-jax-test/ViT-B_16.npz', **UNREACHABLE_GCS)
  assert out.returncode == 1, out.stderr[-2000:]
  assert out.stderr.splitlines()[-1].startswith(
      'vit-train: pretrained_path gs://vit-jax-test/ViT-B_16.npz cannot be read (libcurl code 7 '
      "meaning 'Could not connect to server', "), out.stderr[-2000:]
  assert not (tmp_path / 'w').exists()  # asked before the workdir: none left behind


def test_skip_mode_leaves_out_non_finite_updates(tmp_path, caplog):
  import logging  # pylint: disable=g-import-not-at-top
  config = _config(base_lr=1e30, on_nonfinite='skip', total_steps=8, log_every_steps=3,
                   eval_every_steps=0)
  with caplog.at_level(logging.WARNING):  # steps 2 and 3 skipped: fewer than half the 8
    out = train.train_and_evaluate(config, str(tmp_path / 'run'), stop_after_steps=3)
  assert out['step'] == 3
  assert any('their updates were skipped' in r.getMessage() for r in caplog.records)
  import jax  # pylint: disable=g-import-not-at-top
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(out['params']))


# 9. Memory: accum_steps=0 picks the fewest micro-batches that fit; a step that cannot fit
# stops with one line. device_memory_mb simulates the device's memory on CPU.
def test_a_step_far_larger_than_the_host_is_one_line(tmp_path):
  """image_size=7000 (a million tokens per image) had been killed by the kernel at the
  host's 24 GiB: exit 137, no line. On CPU the step is now checked against the host's free
  memory (the 2 CPU devices share it) before its first run."""
  rc, err, last = _cli(tmp_path, 'run', '--config.image_size=7000', devices=None,
                       memory_limit=12 << 30)
  assert rc == 1, err[-3000:]
  assert re.fullmatch(
      r'vit-train: the train step \(batch_size 32, accum_steps 1\) needs [0-9.]+ MiB per '
      r'device, more than the [0-9.]+ MiB available \(its state and its share of the host\'s '
      r'free memory; --config.device_memory_mb sets it\): raise --config.accum_steps .*',
      last), last
  assert 'Traceback' not in err and 'step 1/' not in err


def test_when_no_micro_batch_count_fits_raising_accum_steps_is_not_the_fix(tmp_path):
  """accum_steps=0 had said 'raise --config.accum_steps (0 finds the fewest that fit)' once
  it had tried every count."""
  with pytest.raises(train.ConfigError) as e:  # batch 16 on 8 devices: 1 or 2 micro-batches
    train.train_and_evaluate(_config(accum_steps=0, device_memory_mb=0.01), str(tmp_path / 'r'))
  assert re.fullmatch(
      r'the train step \(batch_size 16 in 2 micro-batches, the most accum_steps 0 tries\) '
      r'needs [0-9.]+ MiB per device, more than the 0.0 MiB available: set '
      r'--config.remat=True, set --config.fsdp=True, or lower --config.batch_size, '
      r'--config.image_size or the model size', str(e.value))
  # Fixes already on are not named: remat and fsdp set, accum_steps at its most.
  with pytest.raises(train.ConfigError) as e:
    train.train_and_evaluate(_config(accum_steps=2, remat=True, fsdp=True, device_memory_mb=0.01),
                             str(tmp_path / 's'))
  assert str(e.value).endswith(
      'available: lower --config.batch_size, --config.image_size or the model size'), str(e.value)


@pytest.mark.parametrize('error,says', [
    ('ResourceExhaustedError', 'reading the training data ran out of host memory before step 1 '
     '(no room): lower --config.batch_size, --config.image_size or --config.prefetch'),
    ('DataLossError', 'reading the training data failed before step 1: no room: check '
     '--config.dataset and --config.pp'),
])
def test_a_failed_read_of_the_training_data_names_its_cause(tmp_path, monkeypatch, error, says):
  """A batch larger than the host's memory (image_size 994 at batch 128) had been reported
  as a data problem: 'check --config.dataset and --config.pp'."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  class Batches:
    skipped = 0

    def __iter__(self):
      raise getattr(tf.errors, error)(None, None, 'no room')
      yield  # pylint: disable=unreachable

  monkeypatch.setattr(train.input_pipeline, 'train_batches', lambda *a, **k: Batches())
  with pytest.raises(train.TrainingError) as e:
    train.train_and_evaluate(_config(), str(tmp_path / 'run'))
  assert str(e.value) == says


def test_accum_steps_0_picks_the_fewest_that_fit(tmp_path, caplog):
  import logging  # pylint: disable=g-import-not-at-top
  small = dict(batch_size=256, train_split='train[:512]', total_steps=1, warmup_steps=0,
               eval_every_steps=0)
  need = {}
  for accum in (2, 4):
    with pytest.raises(train.ConfigError, match=r'needs .* MiB per device') as e:
      train.train_and_evaluate(_config(accum_steps=accum, device_memory_mb=0.01, **small),
                               str(tmp_path / f'm{accum}'))
    need[accum] = float(str(e.value).split('needs ')[1].split(' MiB')[0])
  assert need[2] > need[4] + 0.5
  with caplog.at_level(logging.INFO):
    out = train.train_and_evaluate(  # accum 4 fits, 2 (and 1) do not
        _config(accum_steps=0, device_memory_mb=(need[2] + need[4]) / 2, **small),
        str(tmp_path / 'tight'))
  assert out['step'] == 1
  assert any('accum_steps 0: 4 micro-batch(es) of 64' in r.getMessage() for r in caplog.records)


def test_step_that_does_not_fit_is_one_line(tmp_path):
  rc, err, last = _cli(tmp_path, 'run', '--config.device_memory_mb=1')
  assert rc == 1, err[-3000:]
  assert last.startswith('vit-train: the train step (batch_size 32, accum_steps 1) needs '), last
  for fix in ('--config.accum_steps', '--config.remat=True', '--config.fsdp=True',
              '--config.batch_size'):
    assert fix in last


def test_a_failed_write_is_named_by_its_errno_and_given_its_fix(tmp_path, monkeypatch):
  # tensorstore's message has held the errno text before the code, and (once in CI) the
  # file's JSON spec there instead.
  for text in ('Error writing "a": File too large [os_error_code=27]',
               'Error writing {"driver": "file", "x": true}\'] [os_error_code=\'27\']'):
    assert errors.write_failure(RuntimeError(text), str(tmp_path)) == (
        "File too large (errno 27): a file outgrew the shell's file-size limit (ulimit -f) or "
        "the file system's: raise it (ulimit -f unlimited)")
  assert errors.write_failure(RuntimeError('save failed'), tmp_path).endswith(
      'save failed: free space or fix permissions there')  # no errno, and space to spare
  wrapped = RuntimeError('save failed')
  wrapped.__cause__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  assert errors.write_failure(wrapped, tmp_path) == 'No space left on device: free space there'
  denied = PermissionError(errno.EACCES, 'Permission denied', str(tmp_path / 'x'))
  assert errors.write_failure(denied, tmp_path).endswith(': give this user write permission there')
  # TensorFlow's event writer says only 'Could not flush events file' on a full disk.
  monkeypatch.setattr(shutil, 'disk_usage', lambda _: types.SimpleNamespace(free=3 << 10))
  flush = 'Could not flush events file. [Op:FlushSummaryWriter]'
  assert errors.write_failure(
      RuntimeError(flush),
      tmp_path / 'not yet') == (f'{flush} (3 KiB free on its disk): free space there')
  assert errors.write_failure(RuntimeError(flush), 'gs://b/run').endswith('fix permissions there')


def test_a_first_checkpoint_that_cannot_be_written_says_the_run_starts_again(tmp_path, monkeypatch):
  """With no checkpoint saved, the line had said 'run the same command to resume'."""

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(checkpoint, 'save_train_state', full)
  workdir = str(tmp_path / 'run')
  with pytest.raises(train.TrainingError) as e:
    train.train_and_evaluate(_config(), workdir)
  assert str(e.value) == (f'the checkpoint of step 3 could not be written to {workdir}/checkpoints:'
                          ' No space left on device: free space there, then run the same command '
                          'to start again (this run saved no checkpoint)')


def test_a_final_npz_that_cannot_be_written_is_named_and_written_by_the_same_command(
    tmp_path, monkeypatch):
  """A full disk at the end had said 'cannot write to <workdir>' without naming the file."""
  workdir = str(tmp_path / 'run')
  real_save = checkpoint.save_npz

  def full(path, params):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(checkpoint, 'save_npz', full)
  with pytest.raises(train.TrainingError) as e:
    train.train_and_evaluate(_config(), workdir)
  assert str(e.value) == (f'{workdir}/final.npz could not be written: No space left on device: '
                          'free space there, then run the same command to write it (the '
                          'checkpoint of the last step, 3, is saved)')
  monkeypatch.setattr(checkpoint, 'save_npz', real_save)
  result = train.train_and_evaluate(_config(), workdir)
  assert result['step'] == 3 and os.path.exists(f'{workdir}/final.npz')
