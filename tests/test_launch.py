"""launch/tpu_vm.py: the gcloud commands of each action, quoting, dry runs, errors."""
import os
import re
import shlex
import shutil
import subprocess
import time

import pytest

from vit_jax.launch import tpu_vm

GCLOUD = ['gcloud', 'compute', 'tpus', 'tpu-vm']
NAME, ZONE = 'vit', 'europe-west4-a'
CONFIG = 'configs/finetune.py:R50+ViT-B_16,cifar10'  # A '+' and a ','.


def args(action, *extra):
  return tpu_vm.parse_args([action, '--name', NAME, '--zone', ZONE, *extra])


def build(action, *extra):
  return tpu_vm.build_commands(action, args(action, *extra))


def run_args(*extra):
  return ('--accelerator_type', 'v3-8', f'--config={CONFIG}', '--workdir=gs://b/w', *extra)


def ssh_prefix(worker='all'):
  return GCLOUD + ['ssh', NAME, '--zone', ZONE, f'--worker={worker}', '--command']


def test_create():
  assert build('create', '--accelerator_type', 'v3-8') == [
      GCLOUD + ['create', NAME, '--zone', ZONE, '--accelerator-type', 'v3-8',
                '--version', 'tpu-ubuntu2204-base']]
  [cmd] = build('create', '--accelerator-type', 'v4-32', '--runtime_version', 'tpu-vm-v4-base',
                '--spot', '--project', 'p')
  assert cmd == GCLOUD + ['create', NAME, '--zone', ZONE, '--project', 'p', '--accelerator-type',
                          'v4-32', '--version', 'tpu-vm-v4-base', '--spot']
  assert build('create', '--accelerator_type', 'v5litepod-16', '--preemptible')[0][-3:] == [
      '--version', 'v2-alpha-tpuv5-lite', '--preemptible']


@pytest.mark.parametrize('accel,hosts', [('v2-8', 1), ('v3-8', 1), ('v3-32', 4), ('v3-256', 32),
                                         ('v4-8', 1), ('v4-32', 4), ('v5p-16', 2),
                                         ('v5litepod-8', 1), ('v5litepod-16', 4),
                                         ('v6e-64', 16), ('tpu', None), (None, None)])
def test_num_hosts(accel, hosts):
  assert tpu_vm.num_hosts(accel) == hosts


def test_setup_copies_the_working_tree():
  tar, scp, ssh = build('setup')
  tarball = tpu_vm.tarball_path(NAME)
  assert tar[:3] == ['tar', '-czf', tarball] and tar[-3:] == ['-C', tpu_vm.REPO_ROOT, '.']
  assert '--exclude=.venv' in tar and '--exclude=.git' in tar
  assert scp == GCLOUD + ['scp', tarball, f'{NAME}:vit_jax.tar.gz', '--zone', ZONE,
                          '--worker=all']
  assert ssh[:-1] == ssh_prefix()
  script = ssh[-1]
  assert 'tar -xzf vit_jax.tar.gz -C vit_jax' in script
  pin = f'jax[tpu]=={tpu_vm.jax_version()}'
  assert re.fullmatch(r'\d+\.\d+\.\d+', tpu_vm.jax_version())  # constraints.txt's pin
  assert f"pip install -q -e ./vit_jax '{pin}' -f {tpu_vm.LIBTPU_URL}" in script
  assert 'python3.11 -m venv vit_jax_venv' in script
  _bash_syntax_ok(script)


def test_setup_from_git():
  [ssh] = build('setup', '--repo_url', 'https://github.com/me/vit_jax.git', '--branch', 'main')
  assert ssh[:-1] == ssh_prefix()
  assert ('git clone --depth 1 --branch main https://github.com/me/vit_jax.git vit_jax'
          in ssh[-1])
  assert 'scp' not in ssh and 'tar -xzf' not in ssh[-1]
  _bash_syntax_ok(ssh[-1])


def test_run_quotes_the_training_command():
  override = "--config.pp.train_crop=it's a test"
  a = args('run', *run_args('--config.data_dir=gs://b/tfds', override))
  [cmd] = tpu_vm.build_commands('run', a)
  assert cmd[:-1] == ssh_prefix()
  assert a.warnings == []
  # The background body: `sh -c BODY`, each job `ARGV > LOG 2>&1`.
  words = shlex.split(cmd[-1])
  body = shlex.split(words[words.index('-c') + 1])
  expected = ['python3', '-m', 'vit_jax.main', f'--config={CONFIG}', '--workdir=gs://b/w',
              '--config.data_dir=gs://b/tfds', override]
  assert body[:len(expected)] == expected
  assert body[len(expected):] == ['>', '$HOME/vit_jax_logs/train.log', '2>&1']
  assert tpu_vm.train_argv(CONFIG, 'gs://b/w') == expected[:5]


@pytest.mark.skipif(not all(shutil.which(c) for c in ('bash', 'setsid', 'nohup')),
                    reason='needs bash, setsid and nohup')
def test_run_script_in_a_shell(tmp_path):
  """The remote script itself, with HOME, the venv and python3 faked: argv arrives intact."""
  venv_bin = tmp_path / 'vit_jax_venv' / 'bin'
  venv_bin.mkdir(parents=True)
  (tmp_path / 'vit_jax').mkdir()
  (venv_bin / 'activate').write_text(f'PATH={venv_bin}:$PATH\n')
  fake = venv_bin / 'python3'
  fake.write_text('#!/bin/sh\nprintf "%s\\0" "$PWD" "$@" > "$HOME/argv"\n')
  fake.chmod(0o755)
  override = "--config.pp.train_crop=it's \"a\" $test"
  [cmd] = build('run', *run_args(override))
  env = {**os.environ, 'HOME': str(tmp_path)}
  out = subprocess.run(['bash', '-c', cmd[-1]], env=env, capture_output=True, text=True,
                       check=True)
  assert 'started' in out.stdout
  argv_file = tmp_path / 'argv'
  for _ in range(100):
    if argv_file.exists() and argv_file.read_bytes().endswith(b'\0'):
      break
    time.sleep(0.02)
  cwd, *argv = argv_file.read_bytes().decode().rstrip('\0').split('\0')
  assert os.path.realpath(cwd) == os.path.realpath(tmp_path / 'vit_jax')
  assert argv == ['-m', 'vit_jax.main', f'--config={CONFIG}', '--workdir=gs://b/w', override]
  assert (tmp_path / 'vit_jax_logs' / 'run.pid').read_text().strip().isdigit()


def test_workdir_checks():
  with pytest.raises(tpu_vm.LaunchError, match='v3-256 has 32 hosts.*gs://'):
    build('run', '--accelerator_type', 'v3-256', '--config=c', '--workdir=/tmp/w')
  a = args('run', '--accelerator_type', 'v3-8', '--config=c', '--workdir=/tmp/w')
  tpu_vm.build_commands('run', a)
  assert len(a.warnings) == 1 and 'single host' in a.warnings[0]
  a = args('run', '--accelerator_type', 'v3-32', '--config=c', '--workdir=gs://b/w',
           '--config.data_dir=/data')
  tpu_vm.build_commands('run', a)
  assert len(a.warnings) == 1 and 'every host' in a.warnings[0]


def test_logs_stop_delete():
  assert build('logs') == [ssh_prefix('0') + ['tail -n 100 vit_jax_logs/train.log']]
  [cmd] = build('logs', '--worker', 'all', '--follow', '--lines', '5', '--log', 'sweep-x')
  assert cmd[:-1] == ssh_prefix('all')
  assert cmd[-1].startswith('tail -n 5 -F vit_jax_logs/sweep-x.log | sed -u')
  [cmd] = build('stop')
  assert cmd[:-1] == ssh_prefix('all') and 'kill -- -' in cmd[-1]
  _bash_syntax_ok(cmd[-1])
  assert build('delete') == [GCLOUD + ['delete', NAME, '--zone', ZONE]]
  assert build('delete', '--yes') == [GCLOUD + ['delete', NAME, '--zone', ZONE, '--quiet']]


def test_all_is_create_setup_run():
  commands = build('all', *run_args())
  assert [c[4] for c in commands[:1]] == ['create']
  assert commands[1][0] == 'tar' and commands[2][4] == 'scp'
  assert commands[3][-1] == build('setup')[-1][-1]
  assert commands[4] == build('run', *run_args())[0]
  with pytest.raises(tpu_vm.LaunchError, match='run needs --workdir'):
    build('all', '--accelerator_type', 'v3-8', '--config=c')  # Nothing is created.


def test_dry_run_prints_and_runs_nothing(monkeypatch, capsys):
  def forbidden(*a, **k):
    raise AssertionError('dry run executed a command')
  for fn in ('call', 'run', 'Popen', 'check_call', 'check_output'):
    monkeypatch.setattr(subprocess, fn, forbidden)
  monkeypatch.setattr(os, 'system', forbidden)
  for action in ('create', 'setup', 'run', 'logs', 'stop', 'delete', 'all'):
    tpu_vm.main([action, '--name', NAME, '--zone', ZONE, *run_args(), '--dry-run'])
    lines = capsys.readouterr().out.splitlines()
    expected = build(action, *run_args())
    assert [shlex.split(line) for line in lines] == expected


def test_execute_stops_at_the_first_failure(capsys):
  calls = []
  def call(cmd):
    calls.append(cmd)
    return 0 if len(calls) == 1 else 3
  with pytest.raises(tpu_vm.LaunchError, match=r'failed \(exit 3\)'):
    tpu_vm.execute([['a'], ['b'], ['c']], call=call)
  assert calls == [['a'], ['b']]
  def missing(cmd):
    raise FileNotFoundError(cmd[0])
  with pytest.raises(tpu_vm.LaunchError, match='install the Google Cloud CLI'):
    tpu_vm.execute([['gcloud']], call=missing)


@pytest.mark.parametrize('argv,message', [
    (['create', '--name', 'vit', '--zone', 'z'], 'create needs --accelerator_type'),
    (['create', '--zone', 'z', '--accelerator_type', 'v3-8'], 'create needs --name'),
    (['run', '--name', 'vit'], 'run needs --zone'),
    (['boot', '--name', 'vit', '--zone', 'z'], 'unknown action'),
    (['delete', '--name', 'My_TPU', '--zone', 'z'], 'lowercase letters'),
    (['create', '--name', 'vit', '--zone', 'z', '--accelerator_type', 'v3-8', '--spot',
      '--preemptible'], 'exclude each other'),
    (['create', '--name', 'vit', '--zone', 'z', '--accelerator_type', 'x9-8'], '--runtime_version'),
    (['run', '--name', 'vit', '--zone', 'z', '--config=c', '--workdir=gs://b', '--lr=1'],
     'unknown argument'),
    (['logs', '--name', 'vit', '--zone', 'z', '--worker', 'first'], 'worker index'),
    (['logs', '--name', 'vit', '--zone', 'z', '--lines', 'many'], 'invalid int'),
])
def test_bad_arguments_give_one_line(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    tpu_vm.main(argv + ['--dry-run'])
  assert message in str(e.value) and '\n' not in str(e.value)
  assert str(e.value).startswith('tpu_vm: error: ')
  assert capsys.readouterr().out == ''


def _bash_syntax_ok(script):
  if shutil.which('bash'):
    subprocess.run(['bash', '-n', '-c', script], check=True)
