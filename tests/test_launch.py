"""launch/tpu_vm.py: the gcloud commands of each action, quoting, dry runs, errors."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import console_script
from tests.conftest import UNREACHABLE_GCS
from vit_jax import errors
from vit_jax.launch import tpu_vm

GCLOUD = ['gcloud', 'compute', 'tpus', 'tpu-vm']
QUEUED = ['gcloud', 'compute', 'tpus', 'queued-resources']
NAME, ZONE = 'vit', 'europe-west4-a'
CONFIG = 'finetune:R50+ViT-B_16,cifar10'  # A '+' and a ','.
DATA = '--config.data_dir=gs://b/tfds'
FAKE_GCLOUD = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fake_gcloud.py')


def args(action, *extra):
  return tpu_vm.parse_args([action, '--name', NAME, '--zone', ZONE, *extra])


def build(action, *extra):
  return tpu_vm.build_commands(action, args(action, *extra))


def run_args(*extra, accelerator_type='v3-8', config=CONFIG):
  return ('--accelerator_type', accelerator_type, f'--config={config}', '--workdir=gs://b/w', DATA,
          *extra)


def commands(steps):
  """The argv lists of a plan (the steps that are no command left out)."""
  return [s for s in steps if isinstance(s, list)]


def ssh_prefix(worker='all'):
  return GCLOUD + ['ssh', NAME, '--zone', ZONE, f'--worker={worker}', '--command']


def test_create():
  assert build('create', '--accelerator_type', 'v3-8')[0] == (GCLOUD + [
      'create', NAME, '--zone', ZONE, '--accelerator-type', 'v3-8', '--version',
      'tpu-ubuntu2204-base'
  ])
  cmd, wait = build('create', '--accelerator-type', 'v4-32', '--runtime_version', 'tpu-vm-v4-base',
                    '--api', 'node', '--spot', '--project', 'p', '--internal-ips')
  assert cmd == GCLOUD + [
      'create', NAME, '--zone', ZONE, '--project', 'p', '--accelerator-type', 'v4-32', '--version',
      'tpu-vm-v4-base', '--spot', '--internal-ips'
  ]
  assert wait.cmd == GCLOUD + [
      'describe', NAME, '--zone', ZONE, '--project', 'p', '--format=value(state)'
  ] and wait.until == ('READY',)
  assert build('create', '--accelerator_type', 'v5litepod-16',
               '--preemptible')[0][-3:] == ['--version', 'v2-alpha-tpuv5-lite',
                                            '--preemptible']  # Preemptible: no queued resource.


@pytest.mark.parametrize('extra', [('--accelerator_type', 'v5litepod-8'),
                                   ('--accelerator_type', 'v6e-8'),
                                   ('--accelerator_type', 'v3-8', '--spot'),
                                   ('--accelerator_type', 'v3-8', '--api', 'queued')])
def test_create_queued_resource(extra):
  cmd, wait = build('create', *extra)
  accel = extra[1]
  assert cmd[:13] == QUEUED + [
      'create', NAME, '--zone', ZONE, '--node-id', NAME, '--accelerator-type', accel,
      '--runtime-version'
  ]
  assert cmd[14:] == (['--spot'] if '--spot' in extra else [])
  assert wait.cmd == QUEUED + ['describe', NAME, '--zone', ZONE, '--format=value(state.state)']
  assert wait.until == ('ACTIVE',) and 'FAILED' in wait.fail
  [delete] = build('delete', *extra)
  assert delete == QUEUED + ['delete', NAME, '--zone', ZONE, '--force']


def test_v5e_is_v5litepod(capsys):
  a = args('create', '--accelerator_type', 'v5e-8')
  assert a.accelerator_type == 'v5litepod-8'
  assert tpu_vm.build_commands('create', a)[0][11] == 'v5litepod-8'
  tpu_vm.main([
      'create', '--name', NAME, '--zone', 'us-west4-a', '--accelerator_type', 'v5e-8', '--dry-run'
  ])
  err = capsys.readouterr().err
  assert 'v5e-8 is called v5litepod-8' in err and len(err.strip().splitlines()) == 1


def test_zone_warning():
  assert tpu_vm.zone_warning('v3-8', 'europe-west4-a') is None
  assert tpu_vm.zone_warning('v4-8', 'us-central2-b') is None
  warning = tpu_vm.zone_warning('v4-8', 'europe-west4-a')
  assert 'us-central2-b' in warning and '2026-11' in warning
  assert tpu_vm.zone_warning('v9-8', 'anywhere') is None  # Unknown: no opinion.
  a = args('create', '--accelerator_type', 'v5p-8')  # ZONE is europe-west4-a.
  tpu_vm.build_commands('create', a)
  assert len(a.warnings) == 1 and 'us-east5-a' in a.warnings[0]


@pytest.mark.parametrize('accel,devices', [('v2-8', 8), ('v3-32', 32), ('v4-8', 4), ('v4-32', 16),
                                           ('v5p-8', 4), ('v5litepod-8', 8), ('v6e-16', 16),
                                           ('x1', None), ('v4-9', None), ('v9-8', None)])
def test_num_devices(accel, devices):
  assert tpu_vm.num_devices(accel) == devices


def test_an_unknown_accelerator_type_is_warned_about():
  for known in ('v2-8', 'v3-2048', 'v4-8', 'v4-24', 'v5p-128', 'v5litepod-1', 'v5litepod-4',
                'v6e-256'):
    assert tpu_vm.type_warning(known) is None, known
  # Well-formed, of a generation this tool does not know: Cloud TPU may have it by now.
  a = args('create', '--accelerator_type', 'v9-8', '--runtime_version', 'tpu-ubuntu2204-base')
  tpu_vm.build_commands('create', a)
  assert [w for w in a.warnings if 'not a TPU type' in w] == [
      '--accelerator_type v9-8 is not a TPU type this tool knows (v2, v3, v4, v5litepod, v5p, '
      'v6e; e.g. v4-8, v5litepod-16): check it with gcloud compute tpus accelerator-types list '
      '--zone ZONE; its devices and hosts are not checked'
  ]
  with pytest.raises(tpu_vm.LaunchError, match='--accelerator_type v4-0 has no cores: pass a '
                     'slice size, e.g. v4-8'):
    tpu_vm.build_commands('create', args('create', '--accelerator_type', 'v4-0'))


@pytest.mark.parametrize('accel,hosts', [('v2-8', 1), ('v3-8', 1), ('v3-32', 4), ('v3-256', 32),
                                         ('v4-8', 1), ('v4-32', 4), ('v5p-16', 2),
                                         ('v5litepod-8', 1), ('v5litepod-16', 4), ('v6e-64', 16),
                                         ('tpu', None), (None, None)])
def test_num_hosts(accel, hosts):
  assert tpu_vm.num_hosts(accel) == hosts


def test_setup_removes_its_tarball_when_the_copy_fails(tmp_path):
  """The local tarball had stayed in ~/.cache/vit_jax after a failed scp (auth, a VM not
  ready), and was built before a missing gcloud was found."""
  steps = build('setup')
  assert isinstance(steps[3], tpu_vm.Cleanup)
  called = []

  def call(cmd):
    called.append(cmd[0] if cmd[0] != 'gcloud' else cmd[4])
    return 1 if cmd[:1] == ['gcloud'] else 0  # the scp fails

  with pytest.raises(tpu_vm.LaunchError, match=r'^`gcloud compute tpus tpu-vm scp .* failed '):
    tpu_vm.execute(steps, call=call, out=open(os.devnull, 'w'))
  assert called == ['mkdir', 'tar', 'scp', 'rm']  # rm after the failure, no ssh
  made = tmp_path / 'made'
  with pytest.raises(tpu_vm.LaunchError, match='^no-such-program-here not found'):
    tpu_vm.execute([['touch', str(made)], ['no-such-program-here', 'x']])
  assert not made.exists()  # nothing ran


def test_a_user_without_a_home_is_told_where_the_code_cannot_be_packed(monkeypatch):
  """The tarball had gone to ./~/.cache/vit_jax in the current folder."""
  monkeypatch.delenv('XDG_CACHE_HOME', raising=False)
  monkeypatch.setattr(os.path, 'expanduser', lambda path: path)
  with pytest.raises(
      tpu_vm.LaunchError, match='^no folder to pack the code in: this user has no '
      r'home \(HOME is not set, and no passwd entry\): set HOME or XDG_CACHE_HOME$'):
    tpu_vm.tarball_path(NAME)


def test_setup_copies_the_working_tree():
  mkdir, tar, scp, rm, ssh = build('setup')
  tarball = tpu_vm.tarball_path(NAME)
  assert tarball.startswith(os.path.expanduser('~'))  # Not the shared /tmp.
  assert mkdir == ['mkdir', '-p', os.path.dirname(tarball)] and rm == ['rm', '-f', tarball]
  assert tar[:3] == ['tar', '-czf', tarball] and tar[-3:] == ['-C', tpu_vm.REPO_ROOT, '.']
  assert '--exclude=.venv' in tar and '--exclude=.git' in tar
  assert scp == GCLOUD + ['scp', tarball, f'{NAME}:vit_jax.tar.gz', '--zone', ZONE, '--worker=all']
  assert ssh[:-1] == ssh_prefix()
  script = ssh[-1]
  assert 'tar -xzf vit_jax.tar.gz -C vit_jax' in script
  assert re.fullmatch(r'\d+\.\d+\.\d+', tpu_vm.jax_version())  # constraints.txt's pin
  # The tested stack: constraints.txt pins jax; jax[tpu] brings libtpu from PyPI.
  assert "pip install -q -c constraints.txt '.[tpu]'" in script and 'libtpu' not in script
  assert tpu_vm.default_python() == 'python3.11'  # setup.py: python_requires=">=3.11"
  assert 'python3.11 -m venv vit_jax_venv' in script
  _bash_syntax_ok(script)
  # --internal-ips: ssh and scp reach the workers by their internal addresses.
  _, _, scp, _, ssh = build('setup', '--internal-ips', '--python', 'python3.12')
  assert scp[-2:] == ['--worker=all', '--internal-ip']
  assert ssh[:-1] == ssh_prefix()[:-1] + ['--internal-ip', '--command']
  assert 'python3.12 -m venv' in ssh[-1]


def test_setup_tarball_leaves_out_runs_checkpoints_and_first_look_outputs(monkeypatch, tmp_path):
  """The tar command that setup builds, run on a small tree: the README's first-look outputs
  (shoe.png, figures/) had been shipped to every worker; a figures/ folder deeper down is
  the user's and goes."""
  tree = tmp_path / 'tree'
  for f in ('setup.py', 'constraints.txt', 'vit_jax/train.py', 'shoe.png', 'figures/rollout_00.png',
            'workdirs/q/final.npz', 'ViT-B_16.npz', '.venv/bin/python', 'docs/figures/a.png',
            'configs/shoe.png'):
    (tree / f).parent.mkdir(parents=True, exist_ok=True)
    (tree / f).write_text('x')
  monkeypatch.setattr(tpu_vm, 'REPO_ROOT', str(tree))
  tar = next(c for c in build('setup') if c[:1] == ['tar'])
  tar[2] = str(tmp_path / 'code.tar.gz')
  subprocess.run(tar, check=True)
  listed = subprocess.run(['tar', '-tzf', tar[2]], check=True, capture_output=True, text=True)
  shipped = sorted(m[2:] for m in listed.stdout.split() if not m.endswith('/'))
  assert shipped == [
      'configs/shoe.png', 'constraints.txt', 'docs/figures/a.png', 'setup.py', 'vit_jax/train.py'
  ]
  # A config file in what is left out would not reach the workers: refused, as in workdirs/.
  (tree / 'figures/my.py').write_text('')
  with pytest.raises(tpu_vm.LaunchError, match=r'setup leaves figures out of the tree it ships'):
    tpu_vm.remote_config(str(tree / 'figures/my.py'))


def test_setup_from_a_wheel_needs_repo_url(monkeypatch):
  monkeypatch.setattr(tpu_vm, 'REPO_ROOT', '/usr/lib/python3/site-packages/vit_jax')
  with pytest.raises(tpu_vm.LaunchError, match='installed from a wheel.*--repo_url'):
    build('setup')
  [ssh] = build('setup', '--repo_url', 'https://github.com/me/vit_jax.git')
  assert 'git clone' in ssh[-1]


def test_setup_from_git():
  [ssh] = build('setup', '--repo_url', 'https://github.com/me/vit_jax.git', '--branch', 'main')
  assert ssh[:-1] == ssh_prefix()
  assert ('git clone --depth 1 --branch main https://github.com/me/vit_jax.git vit_jax' in ssh[-1])
  assert 'scp' not in ssh and 'tar -xzf' not in ssh[-1]
  _bash_syntax_ok(ssh[-1])


def _body(cmd):
  """The background body of a start script: `sh -c BODY`, each job `ARGV > LOG 2>&1; ...`."""
  words = shlex.split(cmd[-1])
  return shlex.split(words[words.index('-c') + 1])


def test_run_quotes_the_training_command():
  override = "--config.pretrained_path=gs://b/it's a test.npz"
  a = args('run', *run_args(override))
  *checks, cmd = tpu_vm.build_commands('run', a)
  assert cmd[:-1] == ssh_prefix()
  assert a.warnings == []
  assert [c.what.split()[0] for c in checks] == ['TFDS', '--workdir']
  body = _body(cmd)
  expected = [
      'python3', '-m', 'vit_jax.main', f'--config={CONFIG}', '--workdir=gs://b/w', DATA, override
  ]
  assert body[:len(expected)] == expected
  assert body[len(expected):] == [
      '>', '$HOME/vit_jax_logs/train.log', '2>&1;', 'echo', '$?', '>',
      '$HOME/vit_jax_logs/train.status'
  ]
  assert tpu_vm.train_argv(CONFIG, 'gs://b/w') == expected[:5]
  assert commands(build('run', *run_args(override, '--skip_preflight'))) == [cmd]


@pytest.mark.skipif(not all(shutil.which(c) for c in ('bash', 'setsid', 'nohup')),
                    reason='needs bash, setsid and nohup')
def test_run_script_in_a_shell(tmp_path):
  """The remote scripts themselves, with HOME, the venv and python3 faked: argv arrives
  intact, the exit status lands in train.status, and status_script reports it."""
  venv_bin = tmp_path / 'vit_jax_venv' / 'bin'
  venv_bin.mkdir(parents=True)
  (tmp_path / 'vit_jax').mkdir()
  (venv_bin / 'activate').write_text(f'PATH={venv_bin}:$PATH\n')
  fake = venv_bin / 'python3'
  fake.write_text('#!/bin/sh\nprintf "%s\\0" "$PWD" "$PYTHONSAFEPATH" "$@" > "$HOME/argv"\n'
                  'exit 3\n')
  fake.chmod(0o755)
  override = "--config.pretrained_path=gs://b/it's \"a\" $test.npz"
  [cmd] = commands(build('run', *run_args(override)))
  env = {**os.environ, 'HOME': str(tmp_path)}
  out = subprocess.run(['bash', '-c', cmd[-1]], env=env, capture_output=True, text=True, check=True)
  assert 'started' in out.stdout
  status = tmp_path / 'vit_jax_logs' / 'train.status'
  for _ in range(200):
    if status.exists() and status.read_text().endswith('\n'):
      break
    time.sleep(0.02)
  cwd, safe_path, *argv = (tmp_path / 'argv').read_bytes().decode().rstrip('\0').split('\0')
  assert os.path.realpath(cwd) == os.path.realpath(tmp_path / 'vit_jax')
  assert safe_path == '1'  # The installed vit_jax, not ./vit_jax.
  assert argv == ['-m', 'vit_jax.main', f'--config={CONFIG}', '--workdir=gs://b/w', DATA, override]
  assert (tmp_path / 'vit_jax_logs' / 'run.pid').read_text().strip().isdigit()
  assert status.read_text() == '3\n'
  check = subprocess.run(['bash', '-c', tpu_vm.status_script('train')], env=env,
                         capture_output=True, text=True, check=True)
  assert check.stdout == 'exit 3\n'
  status.unlink()
  for _ in range(200):  # `sh -c` exits just after it wrote the status: then none.
    check = subprocess.run(['bash', '-c', tpu_vm.status_script('train')], env=env,
                           capture_output=True, text=True, check=True)
    if check.stdout != 'running\n':
      break
    time.sleep(0.02)
  assert check.stdout == 'none\n'


@pytest.mark.skipif(not all(shutil.which(c) for c in ('bash', 'setsid', 'nohup')),
                    reason='needs bash, setsid and nohup')
def test_stop_waits_for_the_run_to_save_and_marks_it_stopped(tmp_path):
  """stop's script against a started run that takes a while to save on SIGTERM: it returns
  after the run exited, status_script then says `stopped` (so watch leaves it), and the next
  start clears that."""
  venv_bin = tmp_path / 'vit_jax_venv' / 'bin'
  venv_bin.mkdir(parents=True)
  (tmp_path / 'vit_jax').mkdir()
  (venv_bin / 'activate').write_text(f'PATH={venv_bin}:$PATH\n')
  fake = venv_bin / 'python3'  # vit-train's SIGTERM: save (here 1 s), then exit 143.
  fake.write_text('#!/bin/bash\ntrap \'sleep 1; echo saved > "$HOME/saved"; exit 143\' TERM\n'
                  'echo up > "$HOME/up"\nwhile :; do sleep 0.05; done\n')
  fake.chmod(0o755)
  env = {**os.environ, 'HOME': str(tmp_path)}

  def bash(script):
    return subprocess.run(['bash', '-c', script], env=env, capture_output=True, text=True,
                          check=True).stdout

  [start] = commands(build('run', *run_args('--skip_preflight')))
  [stop] = build('stop')
  assert bash(stop[-1]).endswith('not running\n')
  assert bash(tpu_vm.status_script('train')) == 'stopped\n'
  assert 'started' in bash(start[-1])
  for _ in range(200):
    if (tmp_path / 'up').exists():
      break
    time.sleep(0.02)
  assert bash(tpu_vm.status_script('train')) == 'running\n'
  assert bash(stop[-1]).endswith(': stopped\n')
  assert (tmp_path / 'saved').exists()  # stop returned only once the run had saved and exited.
  assert not (tmp_path / 'vit_jax_logs' / 'run.pid').exists()
  assert bash(tpu_vm.status_script('train')) == 'stopped\n'
  (tmp_path / 'up').unlink()
  bash(start[-1])
  assert bash(tpu_vm.status_script('train')) in ('running\n', 'none\n')
  bash(stop[-1])


def test_workdir_checks():
  with pytest.raises(tpu_vm.LaunchError, match='v3-256 has 32 hosts.*gs://'):
    build('run', '--accelerator_type', 'v3-256', f'--config={CONFIG}', DATA, '--workdir=/tmp/w')
  a = args('run', '--accelerator_type', 'v3-8', f'--config={CONFIG}', DATA, '--workdir=/tmp/w')
  tpu_vm.build_commands('run', a)
  assert len(a.warnings) == 1 and 'single host' in a.warnings[0]
  a = args('run', '--accelerator_type', 'v3-32', f'--config={CONFIG}', '--workdir=gs://b/w',
           '--config.data_dir=/data')
  tpu_vm.build_commands('run', a)
  assert len(a.warnings) == 1 and 'every host' in a.warnings[0]
  with pytest.raises(tpu_vm.LaunchError, match='watch creates the TPU VM again.*gs://'):
    build('watch', '--accelerator_type', 'v3-8', f'--config={CONFIG}', DATA, '--workdir=/tmp/w')
  # The run starts in ~/vit_jax, which the next `setup` deletes: its checkpoints went with it.
  for workdir, where in [('workdirs/qs', 'is relative, so on the VM it would be in ~/vit_jax'),
                         ('~/w', 'is relative, so on the VM it would be in ~/vit_jax'),
                         ('/home/me/vit_jax/w', 'is in ~/vit_jax'),
                         ('/root/vit_jax', 'is in ~/vit_jax')]:
    with pytest.raises(tpu_vm.LaunchError) as e:
      build('run', '--accelerator_type', 'v3-8', f'--config={CONFIG}', DATA, f'--workdir={workdir}')
    assert str(e.value) == (f'--workdir {workdir} {where}, which vit-tpu setup deletes with the '
                            'code it replaces: use --workdir=gs://BUCKET/... (kept after delete '
                            'too), or an absolute path outside ~/vit_jax')
  build('run', '--accelerator_type', 'v3-8', f'--config={CONFIG}', DATA,
        '--workdir=/home/me/vit_jax_runs/w')


def test_preflight_validates_the_config_for_the_slice():
  steps = build('preflight', *run_args())
  assert [type(s).__name__ for s in steps] == ['Check', 'Check']
  assert 'gs://b/tfds' in steps[0].what and 'gs://b/w' in steps[1].what
  # 512 is a multiple of v3-8's 8 devices, not of v3-2048's 2048.
  with pytest.raises(tpu_vm.LaunchError, match=r'v3-2048: 2048 devices.*batch_size 512'):
    build('preflight', *run_args(accelerator_type='v3-2048'))
  with pytest.raises(tpu_vm.LaunchError, match='batch_size 12 .* 8 devices'):
    build('preflight', *run_args('--config.batch_size=12'))
  # v4-8 has 4 devices: 12 fits there (eval_batch_size 512 too).
  build('preflight', *run_args('--config.batch_size=12', accelerator_type='v4-8'))
  with pytest.raises(tpu_vm.LaunchError, match="config has no field 'base_lrr'"):
    build('preflight', *run_args('--config.base_lrr=1'))
  with pytest.raises(tpu_vm.LaunchError, match='no config file'):
    build('preflight', *run_args(config='nope:x'))


def test_preflight_data_dir():
  no_data = ('--accelerator_type', 'v3-8', f'--config={CONFIG}', '--workdir=gs://b/w')
  with pytest.raises(tpu_vm.LaunchError) as e:
    build('preflight', *no_data)
  assert ('--config.data_dir=gs://BUCKET/tensorflow_datasets' in str(e.value)
          and 'vit-tfds-build cifar10' in str(e.value) and '\n' not in str(e.value))
  a = args('preflight', *no_data, '--config.data_dir=/mnt/tfds')  # On the VM: a warning.
  assert [s.what.split()[0] for s in tpu_vm.build_commands('preflight', a)] == ['--workdir']
  assert 'every host' in a.warnings[0]


def test_check_tfds(tmp_path):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with pytest.raises(tpu_vm.LaunchError) as e:
    tpu_vm.check_tfds('cifar10', str(tmp_path))
  assert str(e.value) == (f'TFDS dataset cifar10 is not prepared in {tmp_path}: run '
                          f'`vit-tfds-build cifar10 --data_dir={tmp_path}` once, then this again')
  builder = tfds.builder('cifar10', data_dir=str(tmp_path))
  os.makedirs(builder.data_dir)
  builder.info.write_to_directory(builder.data_dir)  # What `tfds build` leaves, less the data.
  assert 'cifar10 3.0.2 is prepared' in tpu_vm.check_tfds('cifar10', str(tmp_path))
  # A folder whose name TFDS's is_prepared() would read as a glob: the same files count.
  bracketed = tmp_path / 'tfds[1]'
  shutil.copytree(tmp_path / 'cifar10', bracketed / 'cifar10')
  assert 'is prepared' in tpu_vm.check_tfds('cifar10', str(bracketed))
  with pytest.raises(tpu_vm.LaunchError, match='not a TFDS dataset'):
    tpu_vm.check_tfds('cifar10000', str(tmp_path))


def test_check_writable(tmp_path):
  assert 'writable' in tpu_vm.check_writable(str(tmp_path / 'w'))
  assert os.listdir(tmp_path / 'w') == []  # The probe is deleted.
  (tmp_path / 'file').write_text('')
  with pytest.raises(tpu_vm.LaunchError, match='cannot write to --workdir'):
    tpu_vm.check_writable(str(tmp_path / 'file' / 'w'))


def test_preflight_runs_its_checks(monkeypatch, capsys):
  monkeypatch.setattr(tpu_vm, 'check_tfds', lambda name, d: f'TFDS {name} is prepared in {d}')
  monkeypatch.setattr(tpu_vm, 'check_writable', lambda w: f'--workdir {w} is writable')
  assert tpu_vm.main(['preflight', '--name', NAME, '--zone', ZONE, *run_args()]) == 0
  assert capsys.readouterr().out.splitlines() == [
      'vit-tpu: preflight: TFDS cifar10 is prepared in gs://b/tfds',
      'vit-tpu: preflight: --workdir gs://b/w is writable'
  ]

  def not_prepared(name, data_dir):
    raise tpu_vm.LaunchError(f'run `vit-tfds-build {name} --data_dir={data_dir}`')

  monkeypatch.setattr(tpu_vm, 'check_tfds', not_prepared)
  with pytest.raises(SystemExit, match='vit-tfds-build cifar10 --data_dir=gs://b/tfds'):
    tpu_vm.main(['all', '--name', NAME, '--zone', ZONE, *run_args()])
  assert 'create' not in capsys.readouterr().out  # Nothing was created.


def test_readme_commands_build(monkeypatch, capsys):
  """Each `vit-tpu` line of README's Cloud TPU section, as a dry run (tests/test_readme.py
  runs them as a user would)."""
  with open(os.path.join(tpu_vm.REPO_ROOT, 'README.md')) as f:
    text = f.read()
  section = text[text.index('## Run on Cloud TPU'):]
  section = section[:section.index('\n## ', 1)].replace('\\\n', ' ')
  lines = [shlex.split(l) for l in section.splitlines() if l.startswith('vit-tpu ')]
  actions = {argv[1] for argv in lines}
  assert actions >= {
      'preflight', 'create', 'setup', 'run', 'logs', 'stop', 'delete', 'all', 'watch'
  }
  monkeypatch.chdir('/')
  for argv in lines:
    assert tpu_vm.main(argv[1:] + ['--dry-run']) == 0, argv
    assert 'gs://BUCKET' in capsys.readouterr().out or argv[1] not in ('run', 'all')


def test_logs_stop_delete():
  assert build('logs') == [ssh_prefix('0') + ['tail -n 100 vit_jax_logs/train.log']]
  [cmd] = build('logs', '--worker', 'all', '--follow', '--lines', '5', '--log', 'sweep-x')
  assert cmd[:-1] == ssh_prefix('all')
  assert cmd[-1].startswith('tail -n 5 -F vit_jax_logs/sweep-x.log | sed -u')
  [cmd] = build('stop')
  assert cmd[:-1] == ssh_prefix('all') and 'kill -- -' in cmd[-1]
  _bash_syntax_ok(cmd[-1])
  assert build('delete', '--api', 'node') == [GCLOUD + ['delete', NAME, '--zone', ZONE]]
  assert build('delete', '--accelerator_type', 'v3-8',
               '--yes') == [GCLOUD + ['delete', NAME, '--zone', ZONE, '--quiet']]
  [either] = build('delete')  # Which API made it is asked at run time.
  assert either.queued == QUEUED + ['delete', NAME, '--zone', ZONE, '--force']
  assert either.node == GCLOUD + ['delete', NAME, '--zone', ZONE]


def test_all_is_preflight_create_setup_run():
  steps = build('all', *run_args())
  assert [type(s).__name__ for s in steps[:2]] == ['Check', 'Check']
  assert steps[2] == build('create', '--accelerator_type', 'v3-8')[0]
  assert steps[3].cmd == build('create', '--accelerator_type', 'v3-8')[1].cmd
  assert steps[4:8] == build('setup')[:4]  # mkdir, tar, scp, rm
  assert steps[8][-1] == build('setup')[-1][-1]
  assert steps[9] == build('run', *run_args())[-1]
  assert len(steps) == 10
  with pytest.raises(tpu_vm.LaunchError, match='all needs --workdir'):
    build('all', '--accelerator_type', 'v3-8', '--config=c')  # Nothing is created.
  with pytest.raises(tpu_vm.LaunchError, match='batch_size'):
    build('all', *run_args('--config.batch_size=3'))


DRY_RUN_ACTIONS = ('preflight', 'create', 'setup', 'run', 'logs', 'stop', 'delete', 'all', 'resume',
                   'watch')


def test_dry_run_prints_and_runs_nothing(monkeypatch, capsys):

  def forbidden(*a, **k):
    raise AssertionError('dry run executed a command')

  for fn in ('call', 'run', 'Popen', 'check_call', 'check_output'):
    monkeypatch.setattr(subprocess, fn, forbidden)
  monkeypatch.setattr(os, 'system', forbidden)
  monkeypatch.setattr(tpu_vm, 'path_exists', forbidden)
  assert tuple(tpu_vm.ACTIONS) == DRY_RUN_ACTIONS
  for action in DRY_RUN_ACTIONS:
    for extra in ((), ('--spot',)):
      assert tpu_vm.main([action, '--name', NAME, '--zone', ZONE, *run_args(*extra),
                          '--dry-run']) == 0
      out = capsys.readouterr().out
      steps = build(action, *run_args(*extra))
      assert out == ''.join(tpu_vm._show(s) + '\n' for s in steps)  # pylint: disable=protected-access
      # Every line is a command, or a comment: the output reads as a shell script.
      lines = [shlex.split(l, comments=True) for l in out.splitlines()]
      assert [l for l in lines if l
             ] == [l for l in lines if l and l[0] in ('gcloud', 'mkdir', 'tar', 'rm')]


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
  with pytest.raises(tpu_vm.LaunchError) as e:  # It had sent a missing tar to gcloud's docs.
    tpu_vm.execute([['tar', '-czf', 'x']], call=missing)
  assert str(e.value) == 'tar not found: install it, or put it on PATH'


@pytest.mark.parametrize(
    'argv,message',
    [
        (['create', '--name', 'vit', '--zone', ZONE], 'create needs --accelerator_type'),
        (['create', '--zone', ZONE, '--accelerator_type', 'v3-8'], 'create needs --name'),
        (['run', '--name', 'vit'], 'run needs --zone'),
        (['boot', '--name', 'vit', '--zone', ZONE], 'unknown action'),
        (['boot', '--zone', 'z', '--worker', 'x'], "unknown action 'boot'"),
        (['delete', '--name', 'My_TPU', '--zone', ZONE], 'lowercase letters'),
        ([
            'create', '--name', 'vit', '--zone', ZONE, '--accelerator_type', 'v3-8', '--spot',
            '--preemptible'
        ], 'exclude each other'),
        ([
            'create', '--name', 'vit', '--zone', ZONE, '--accelerator_type', 'v3-8', '--api',
            'queued', '--preemptible'
        ], 'use --spot, or --api=node'),
        (['create', '--name', 'vit', '--zone', ZONE, '--accelerator_type', 'v9-8'
         ], 'no default runtime for v9-8: pass --runtime_version'),
        (['create', '--name', 'vit', '--zone', ZONE, '--accelerator_type', 'v3-8', '--api', 'tpu'
         ], "invalid choice: 'tpu'"),
        (['run', '--name', 'vit', '--zone', ZONE, '--config=c', '--workdir=gs://b', '--lr=1'
         ], 'unknown argument'),
        (['run', '--name', 'vit', '--zone', ZONE, '--config=quickstart:x', '--workdir=gs://b'
         ], "--config 'quickstart:x'"),
        (['logs', '--name', 'vit', '--zone', ZONE, '--worker', 'first'], 'worker index'),
        (['logs', '--name', 'vit', '--zone', ZONE, '--worker', '4', '--accelerator_type', 'v4-32'
         ], '--worker 4: v4-32 has 4 hosts, workers 0-3: use one of them, or all'),
        (['logs', '--name', 'vit', '--zone', ZONE, '--lines', 'many'], 'invalid int'),
        (['watch', '--name', 'vit', '--zone', ZONE, '--poll', '0'], '--poll must be > 0'),
        (['watch', '--name', 'vit', '--zone', ZONE, '--config=c', '--workdir=gs://b'
         ], 'watch needs --accelerator_type'),
        ([], 'no action given: vit-tpu ACTION ..., ACTION one of preflight, create, setup, run, '),
        # A path had put the log outside ~/vit_jax_logs, where `logs` and `watch` look.
        (['logs', '--name', 'vit', '--zone', ZONE, '--log', '../x y'
         ], "--log '../x y' is not a log name: use letters, digits, _ and . = , + - (the log is "
         '~/vit_jax_logs/<name>.log on each worker)'),
        # Its files are <name>.log and <name>.status: the run had failed on the worker.
        (['logs', '--name', 'vit', '--zone', ZONE, '--log', 'x' * 249
         ], '--log is 249 bytes long: use a name of at most 248 (the log is '
         '~/vit_jax_logs/<name>.log on each worker)'),
    ])
def test_bad_arguments_give_one_line(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    tpu_vm.main(argv + ['--dry-run'])
  assert message in str(e.value) and '\n' not in str(e.value)
  assert str(e.value).startswith('vit-tpu: error: ')
  assert capsys.readouterr().out == ''


# ---------------------------------------------------------------- against a fake gcloud


@pytest.fixture
def fake_gcloud(tmp_path, monkeypatch):
  """A `gcloud` first on PATH (tests/fake_gcloud.py); returns (write, read) of its state."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  gcloud = bin_dir / 'gcloud'
  gcloud.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} '
                    f'{shlex.quote(FAKE_GCLOUD)} "$@"\n')
  gcloud.chmod(0o755)
  state_file, final = tmp_path / 'gcloud.json', tmp_path / 'final.npz'
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
  monkeypatch.setenv('FAKE_GCLOUD_STATE', str(state_file))
  monkeypatch.setenv('FAKE_GCLOUD_FINAL', str(final))
  # The workdir is gs://b/w; its final.npz is the file the fake's "done" creates.
  monkeypatch.setattr(tpu_vm, 'path_exists', lambda p: p == 'gs://b/w/final.npz' and final.exists())

  def write(**state):
    state_file.write_text(json.dumps(state))

  def read():
    return json.loads(state_file.read_text())

  return write, read


def _verbs(calls):
  """'tpu-vm create', 'queued-resources describe', 'ssh:start', 'ssh:setup', 'ssh:status'."""
  out = []
  for c in calls:
    verb = f'{c[2]} {c[3]}'
    if c[3] == 'ssh':
      command = c[c.index('--command') + 1]
      verb = 'ssh:' + ('start' if 'vit_jax.main' in command else
                       'status' if 'echo running' in command else 'setup')
    out.append(verb)
  return out


FAKE_RUN = ('--accelerator_type', 'v3-8', f'--config={CONFIG}', '--workdir=gs://b/w', DATA,
            '--repo_url', 'https://github.com/me/vit_jax.git', '--poll', '0.01', '--skip_preflight')


def test_create_waits_for_the_queued_resource(fake_gcloud, capsys):
  write, read = fake_gcloud
  write(create_states={
      'queued': ['WAITING_FOR_RESOURCES', 'WAITING_FOR_RESOURCES', 'PROVISIONING', 'ACTIVE']
  })
  assert tpu_vm.main([
      'create', '--name', NAME, '--zone', 'us-east5-b', '--accelerator_type', 'v6e-8', '--poll',
      '0.01'
  ]) == 0
  out = capsys.readouterr().out
  progress = [
      l.split(': ')[2].split()[0] for l in out.splitlines()
      if l.startswith('vit-tpu: queued resource vit:')
  ]
  assert progress == ['WAITING_FOR_RESOURCES', 'PROVISIONING', 'ACTIVE']
  assert _verbs(read()['calls']) == ['queued-resources create'] + ['queued-resources describe'] * 4
  assert read()['nodes'] == {NAME: {'states': ['READY']}}
  # A queued resource that fails: one line, naming the describe command.
  write(create_states={'queued': ['WAITING_FOR_RESOURCES', 'FAILED']})
  with pytest.raises(
      SystemExit, match='queued resource vit is FAILED: `gcloud compute tpus '
      'queued-resources describe'):
    tpu_vm.main([
        'create', '--name', NAME, '--zone', 'us-east5-b', '--accelerator_type', 'v6e-8', '--poll',
        '0.01'
    ])


def test_all_creates_a_node_and_waits_for_ready(fake_gcloud, capsys):
  write, read = fake_gcloud
  write(create_states={'node': ['CREATING', 'CREATING', 'READY']})
  assert tpu_vm.main(['all', '--name', NAME, '--zone', ZONE, *FAKE_RUN]) == 0
  assert _verbs(
      read()['calls']) == ['tpu-vm create'] + ['tpu-vm describe'] * 3 + ['ssh:setup', 'ssh:start']
  assert 'TPU VM vit: READY' in capsys.readouterr().out


def test_delete_finds_which_api_made_it(fake_gcloud):
  write, read = fake_gcloud
  write(queued={NAME: {'states': ['ACTIVE']}}, nodes={NAME: {'states': ['READY']}})
  tpu_vm.main(['delete', '--name', NAME, '--zone', ZONE, '--yes'])
  assert read()['calls'][-1] == QUEUED[1:] + ['delete', NAME, '--zone', ZONE, '--force', '--quiet']
  assert read()['nodes'] == {} and read()['queued'] == {}
  write(nodes={NAME: {'states': ['READY']}})
  tpu_vm.main(['delete', '--name', NAME, '--zone', ZONE, '--yes'])
  assert read()['calls'][-1] == GCLOUD[1:] + ['delete', NAME, '--zone', ZONE, '--quiet']


def test_resume_recreates_a_preempted_node(fake_gcloud, capsys):
  write, read = fake_gcloud
  write(nodes={NAME: {'states': ['PREEMPTED']}}, create_states={'node': ['CREATING', 'READY']})
  assert tpu_vm.main(['resume', '--name', NAME, '--zone', ZONE, *FAKE_RUN, '--api', 'node']) == 0
  assert _verbs(read()['calls']) == [
      'tpu-vm describe', 'tpu-vm delete', 'tpu-vm create', 'tpu-vm describe', 'tpu-vm describe',
      'ssh:setup', 'ssh:start'
  ]
  assert 'vit is PREEMPTED: a preempted TPU VM cannot be restarted' in capsys.readouterr().out
  start = read()['calls'][-1]
  assert 'python3 -m vit_jax.main' in start[-1] and '--workdir=gs://b/w' in start[-1]
  # A READY VM: only the run is started again.
  write(nodes={NAME: {'states': ['READY']}})
  assert tpu_vm.main(['resume', '--name', NAME, '--zone', ZONE, *FAKE_RUN, '--api', 'node']) == 0
  assert _verbs(read()['calls']) == ['tpu-vm describe', 'ssh:start']


def test_watch_recovers_from_preemption_node(fake_gcloud, capsys):
  write, read = fake_gcloud
  write(nodes={NAME: {
      'states': ['READY']
  }}, run_status=['running', 'preempt'], on_start=[{
      'run_status': ['running', 'done']
  }])
  assert tpu_vm.main(['watch', '--name', NAME, '--zone', ZONE, *FAKE_RUN, '--api', 'node']) == 0
  assert _verbs(read()['calls']) == [
      'tpu-vm describe', 'ssh:status', 'tpu-vm describe', 'ssh:status', 'tpu-vm describe',
      'tpu-vm delete', 'tpu-vm create', 'tpu-vm describe', 'ssh:setup', 'ssh:start',
      'tpu-vm describe', 'ssh:status', 'tpu-vm describe', 'ssh:status'
  ]
  out = capsys.readouterr().out
  assert 'vit is PREEMPTED: recovery 1/20' in out
  assert 'the run finished: gs://b/w/final.npz (1 recoveries)' in out


def test_watch_recovers_from_preemption_queued(fake_gcloud, capsys):
  write, read = fake_gcloud
  write(queued={NAME: {
      'states': ['ACTIVE']
  }}, nodes={NAME: {
      'states': ['READY']
  }}, run_status=['preempt'], on_start=[{
      'run_status': ['running', 'done']
  }], create_states={'queued': ['WAITING_FOR_RESOURCES', 'PROVISIONING', 'ACTIVE']})
  assert tpu_vm.main([
      'watch', '--name', NAME, '--zone', 'us-east5-b',
      *[a if a != 'v3-8' else 'v6e-8' for a in FAKE_RUN]
  ]) == 0
  verbs = _verbs(read()['calls'])
  i = verbs.index('queued-resources delete')
  assert verbs[i - 1] == 'queued-resources describe'  # SUSPENDED
  assert verbs[i:i + 5] == ['queued-resources delete', 'queued-resources create'
                           ] + ['queued-resources describe'] * 3
  assert verbs[i + 5:i + 7] == ['ssh:setup', 'ssh:start'] and read()['starts'] == 1
  out = capsys.readouterr().out
  assert 'vit is SUSPENDED: recovery 1/20' in out and 'the run finished' in out


# none: the process was killed outright; exit 143: vit-train's status on SIGTERM, after
# saving a step (it had exited 0).
@pytest.mark.parametrize('stopped', ['none', 'exit 143'])
def test_watch_restarts_a_run_that_stopped_on_a_ready_vm(fake_gcloud, capsys, stopped):
  write, read = fake_gcloud
  write(nodes={NAME: {
      'states': ['READY']
  }}, run_status=[stopped], on_start=[{
      'run_status': ['running', 'done']
  }])
  assert tpu_vm.main(['watch', '--name', NAME, '--zone', ZONE, *FAKE_RUN, '--api', 'node']) == 0
  verbs = _verbs(read()['calls'])
  assert 'tpu-vm delete' not in verbs and verbs.count('ssh:start') == 1
  assert f'the run stopped ({stopped}): recovery 1/20' in capsys.readouterr().out


def test_watch_does_not_start_again_a_run_the_user_stopped(fake_gcloud):
  write, read = fake_gcloud
  write(nodes={NAME: {'states': ['READY']}}, run_status=['running', 'stopped'])
  with pytest.raises(SystemExit, match='stopped with vit-tpu stop, so watch does not start it'):
    tpu_vm.main(['watch', '--name', NAME, '--zone', ZONE, *FAKE_RUN, '--api', 'node'])
  verbs = _verbs(read()['calls'])
  assert verbs.count('ssh:start') == 0 and verbs.count('ssh:status') == 2


def test_watch_creates_a_missing_slice_without_counting_it(fake_gcloud, capsys):
  write, read = fake_gcloud
  write(run_status=['running', 'done'])
  assert tpu_vm.main(['watch', '--name', NAME, '--zone', ZONE, *FAKE_RUN, '--spot']) == 0
  assert _verbs(read()['calls'])[:6] == [
      'queued-resources describe', 'queued-resources create', 'queued-resources describe',
      'ssh:setup', 'ssh:start', 'queued-resources describe'
  ]
  out = capsys.readouterr().out
  assert 'vit does not exist: creating it' in out and '(0 recoveries)' in out


def test_watch_stops_on_a_failed_run_and_at_max_recoveries(fake_gcloud):
  write, read = fake_gcloud
  write(nodes={NAME: {'states': ['READY']}}, run_status=['running', 'exit 1'])
  with pytest.raises(
      SystemExit, match='ended with exit 1 and the VM is READY, not a '
      'preemption: read vit-tpu logs'):
    tpu_vm.main(['watch', '--name', NAME, '--zone', ZONE, *FAKE_RUN, '--api', 'node'])
  assert _verbs(read()['calls']).count('ssh:status') == 3  # Ended: one more poll to be sure.
  # Preempted after every start: two recoveries, then it gives up.
  write(nodes={NAME: {'states': ['PREEMPTED']}}, run_status=['preempt'])
  with pytest.raises(SystemExit, match=r'2 recoveries are done \(--max_recoveries\)'):
    tpu_vm.main([
        'watch', '--name', NAME, '--zone', ZONE, *FAKE_RUN, '--api', 'node', '--max_recoveries', '2'
    ])
  assert read()['starts'] == 2


def _bash_syntax_ok(script):
  if shutil.which('bash'):
    subprocess.run(['bash', '-n', '-c', script], check=True)


# ---------------------------------------------------------------- the console script


def vit_tpu(cwd, *argv):
  return console_script('vit-tpu', cwd, *argv)


def _error_line(p):
  """The one `vit-tpu: error:` line of a failed run (and no traceback)."""
  assert p.returncode == 1, p.stdout + p.stderr
  assert 'Traceback' not in p.stderr, p.stderr
  [line] = [l for l in p.stderr.splitlines() if l.startswith('vit-tpu: error: ')]
  return line


def test_a_config_file_outside_the_shipped_tree_is_refused(tmp_path):
  """setup ships the repository: ./my.py of another directory would not exist on the TPU VM,
  so preflight, run and all refuse it before anything is created."""
  (tmp_path / 'my.py').write_text('from vit_jax.configs.quickstart import get_config\n')
  flags = ('--name', NAME, '--zone', 'us-central2-b', '--accelerator_type', 'v4-8',
           '--config=my.py', '--workdir=tpuwd')
  for argv in (['preflight',
                *flags], ['run', *flags,
                          '--dry-run'], ['all', *flags, '--skip_preflight', '--dry-run']):
    p = vit_tpu(tmp_path, *argv)
    line = _error_line(p)
    assert (f"--config 'my.py' is a file outside {os.path.realpath(tpu_vm.REPO_ROOT)}, the tree "
            'that setup ships to the TPU VM: move it under') in line, argv
    assert 'use a packaged config' in line and p.stdout == ''


def test_preflight_of_a_bucket_out_of_reach_is_its_line_alone(tmp_path):
  """Its line had been 'cannot read gs://B/tfds: cannot read data_dir gs://B/tfds: ...', cut
  before its fix, after five lines of TensorFlow's notices on import."""
  p = console_script('vit-tpu', tmp_path, 'preflight', '--name', NAME, '--zone', 'us-central2-b',
                     '--accelerator_type', 'v4-8', '--config=finetune:ViT-B_16,cifar10',
                     '--workdir=gs://vit-jax-test/run', '--config.data_dir=gs://vit-jax-test/tfds',
                     **UNREACHABLE_GCS)
  line = _error_line(p)
  assert line.startswith('vit-tpu: error: cannot read data_dir gs://vit-jax-test/tfds: '), line
  assert line.endswith(errors.GCS_FIX) and p.stderr.strip() == line, p.stderr


def _started_argv(out):
  """The vit_jax.main argv of the start ssh line that a dry run prints."""
  [line] = [l for l in out.splitlines() if 'vit_jax.main' in l]
  body = _body(shlex.split(line))
  return body[:body.index('>')]


def test_config_files_of_the_shipped_tree_are_named_as_there(tmp_path):
  """From any directory, a config file of the repository is passed to the workers by its
  path in the shipped copy (they run from ~/vit_jax); packaged names stay as they are."""
  finetune = os.path.join(tpu_vm.REPO_ROOT, 'configs', 'finetune.py')
  base = ('--name', NAME, '--zone', ZONE, '--accelerator_type', 'v3-8', '--workdir=gs://b/w',
          '--skip_preflight', '--dry-run')
  for config, remote in [(f'{finetune}:R50+ViT-B_16,cifar10', 'configs/finetune.py:R50+ViT-B_16,'
                          'cifar10'), (CONFIG, CONFIG), ('quickstart', 'quickstart')]:
    p = vit_tpu(tmp_path, 'all', *base, f'--config={config}')
    assert p.returncode == 0, p.stderr
    assert _started_argv(p.stdout)[:4] == ['python3', '-m', 'vit_jax.main',
                                           f'--config={remote}'], config
  p = vit_tpu(tmp_path, 'run', *base, f'--config={finetune}:ViT-B_16,cifar10', '--repo_url',
              'https://github.com/me/vit_jax.git')
  assert p.returncode == 0, p.stderr
  assert '--config=configs/finetune.py:ViT-B_16,cifar10' in _started_argv(p.stdout)
  assert 'configs/finetune.py is read from the clone of https://github.com/me/vit_jax.git' in (
      p.stderr)


def test_remote_config_from_a_wheel(monkeypatch, tmp_path):
  monkeypatch.setattr(tpu_vm, 'REPO_ROOT', '/usr/lib/python3/site-packages/vit_jax')
  monkeypatch.chdir(tmp_path)
  (tmp_path / 'my.py').write_text('')
  assert tpu_vm.remote_config('finetune:ViT-B_16,cifar10') == ('finetune:ViT-B_16,cifar10', [])
  with pytest.raises(tpu_vm.LaunchError, match='commit it to the repository of --repo_url'):
    tpu_vm.remote_config('my.py')
  spec, [warning] = tpu_vm.remote_config('my.py:x', 'https://github.com/me/vit_jax.git')
  assert spec == 'my.py:x' and 'from the root of the clone' in warning


def test_a_failed_delete_names_the_list_commands(fake_gcloud, tmp_path):
  """Deleting what is not there: the error line says how to see what is left."""
  write, _ = fake_gcloud
  write()
  for extra, what, listing in [
      ((), 'TPU VM', "`gcloud compute tpus tpu-vm list --zone europe-west4-a --project p`"),
      (('--api', 'queued'), 'queued resource',
       '`gcloud compute tpus queued-resources list --zone europe-west4-a --project p`')
  ]:
    p = vit_tpu(tmp_path, 'delete', '--name', NAME, '--zone', ZONE, '--project', 'p', '--yes',
                *extra)
    line = _error_line(p)
    assert (f'fix it and delete again; if it says NOT_FOUND, there is no {what} vit in zone '
            f'{ZONE}: ') in line and listing in line, line


@pytest.mark.parametrize(
    'argv,message',
    [
        (('--accelerator_type', 'tpu-v4'),
         "--accelerator_type 'tpu-v4' is not a TPU type: write it "
         'as v<generation>-<size>, e.g. v4-8 or v5litepod-16 (gcloud compute tpus accelerator-types '
         'list --zone ZONE)'),
        (('--accelerator_type', 'v4', '--runtime_version', 'tpu-ubuntu2204-base'),
         "--accelerator_type 'v4' is not a TPU type: write it as v<generation>-<size>, e.g. v4-8 or "
         'v5litepod-16 (gcloud compute tpus accelerator-types list --zone ZONE)'),
        (('--accelerator_type', 'v4-9'), '--accelerator_type v4-9: a v4 slice has a multiple of 8 '
         'TensorCores: pick one, e.g. v4-8 or v4-32'),
        (('--accelerator_type', 'v6e-6'), '--accelerator_type v6e-6: a v6e slice has 1, 4, 8, 16, '
         '32, 64, 128 or 256 chips: pick one, e.g. v6e-8 or v6e-32'),
        # Multiples of 8 that Cloud TPU does not offer (gcloud had refused them after preflight).
        (('--accelerator_type', 'v5litepod-24'), '--accelerator_type v5litepod-24: a v5litepod '
         'slice has 1, 4, 8, 16, 32, 64, 128 or 256 chips: pick one, e.g. v5litepod-8 or '
         'v5litepod-32'),
        (('--accelerator_type', 'v2-16'),
         '--accelerator_type v2-16: a v2 slice has 8, 32, 128, 256 '
         'or 512 TensorCores: pick one, e.g. v2-8 or v2-32'),
        (('--accelerator_type', 'v4-8', '--zone', 'us-central2-bb'),
         "--zone 'us-central2-bb' is not a "
         'zone: write it as <region>-<letter>, e.g. us-central2-b or europe-west4-a (gcloud compute '
         'tpus locations list)'),
    ])
def test_a_malformed_accelerator_type_or_zone_is_refused(tmp_path, argv, message):
  """tpu-v4 was blamed on the runtime ('no default runtime for tpu-v4: pass
  --runtime_version'); v4 (given a runtime), v4-9 and a zone us-central2-bb were only warned
  about, and passed on to gcloud."""
  zone = () if '--zone' in argv else ('--zone', 'us-central2-b')
  p = vit_tpu(tmp_path, 'create', '--name', NAME, *zone, *argv, '--dry-run')
  assert _error_line(p) == p.stderr.splitlines()[-1] == f'vit-tpu: error: {message}'
  assert p.stdout == ''


@pytest.mark.parametrize('argv,message', [
    (('run', '--name', NAME, '--name', 'vit2', '--zone', ZONE, '--dry-run'),
     f"--name is given more than once ({NAME!r}, 'vit2'): give one"),
    (('logs', '--name', NAME, '--zone', ZONE, '--lines', '5', '--lines=6'),
     '--lines is given more than once (5, 6): give one'),
    (('run', '--name', NAME, '--zone', ZONE, '--config=quickstart', '--workdir=gs://b/w',
      '--config.seed=1', '--config.seed=2', '--dry-run'),
     "--config 'quickstart': --config.seed is given more than once ('1', '2'): give one"),
])
def test_a_flag_given_twice_is_refused(tmp_path, argv, message):
  """argparse, and ml_collections for a config field, had taken the last value."""
  p = vit_tpu(tmp_path, *argv)
  assert _error_line(p) == p.stderr.splitlines()[-1] == f'vit-tpu: error: {message}'
  assert p.stdout == ''


def test_an_accelerator_type_and_zone_in_upper_case_are_lowered(tmp_path):
  """V4-8 was refused as 'no default runtime for V4-8'; Cloud TPU names are lower case."""
  p = vit_tpu(tmp_path, 'create', '--name', NAME, '--zone', 'US-CENTRAL2-B', '--accelerator_type',
              'V4-8', '--dry-run')
  assert p.returncode == 0 and p.stderr == '', p.stderr
  assert p.stdout.splitlines()[0] == shlex.join(GCLOUD + [
      'create', NAME, '--zone', 'us-central2-b', '--accelerator-type', 'v4-8', '--version',
      'tpu-ubuntu2204-base'
  ])
