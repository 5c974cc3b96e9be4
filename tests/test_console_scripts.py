"""The console scripts as setup.py installs them: Ctrl-C while they import their command's
module (up to a second: TensorFlow, JAX) is one line and status 130; for vit-train SIGTERM
and SIGHUP too, with its start-up's lines."""
import os
import shlex
import signal
import subprocess
import sys

import pytest
from PIL import Image

from tests.conftest import CTRL_C_AS_IN_A_TERMINAL
from tests.conftest import ROOT
from tests.conftest import UNREACHABLE_GCS
from tests.conftest import without_root_override
from vit_jax import errors
from vit_jax.configs import quickstart
from vit_jax import main

COMMAND_MODULES = {
    'vit-train': 'vit_jax.main',
    'vit-evaluate': 'vit_jax.evaluate_cli',
    'vit-inspect': 'vit_jax.inspection',
    'vit-predict': 'vit_jax.predict',
    'vit-sweep': 'vit_jax.launch.sweep',
    'vit-vtab': 'vit_jax.launch.vtab',
    'vit-tpu': 'vit_jax.launch.tpu_vm',
    'vit-tfds-build': 'vit_jax.tfds_build',
}


def _run_with_ctrl_c_in_import(program, module, press):
  """`program --help` through its installed entry point, Ctrl-C (or another signal) sent by
  `press`, a line of code, as `module` is first looked up."""
  child = (CTRL_C_AS_IN_A_TERMINAL + 'import importlib.metadata, os, signal, sys, threading\n'
           'class CtrlC:\n'
           '  def find_spec(self, name, path=None, target=None):\n'
           f'    if name == {module!r}:\n'
           '      sys.meta_path.remove(self)\n'
           f'      {press}\n'
           'sys.meta_path.insert(0, CtrlC())\n'
           f'sys.argv = [{program!r}, "--help"]\n'
           f'[entry] = importlib.metadata.entry_points(group="console_scripts", name={program!r})\n'
           'sys.exit(entry.load()())\n')
  return subprocess.run([sys.executable, '-c', child], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)


@pytest.mark.parametrize('program', sorted(COMMAND_MODULES))
def test_ctrl_c_while_the_command_imports_is_one_line(program):
  """It printed a KeyboardInterrupt traceback of ~40 lines."""
  out = _run_with_ctrl_c_in_import(program, COMMAND_MODULES[program],
                                   'os.kill(os.getpid(), signal.SIGINT)')
  says = (main.exit_line(signal.SIGINT)
          if program == 'vit-train' else f'{program}: interrupted (Ctrl-C)')
  assert (out.returncode, out.stderr.splitlines(), out.stdout) == (130, [says],
                                                                   ''), out.stderr[-3000:]


@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGHUP'])
def test_vit_train_takes_a_signal_while_it_imports_as_in_its_start_up(sig):
  """SIGTERM and SIGHUP in vit-train's first ~0.1 s killed it silently: no line."""
  out = _run_with_ctrl_c_in_import('vit-train', 'vit_jax.main',
                                   f'os.kill(os.getpid(), signal.{sig})')
  signum = getattr(signal, sig)
  assert (out.returncode, out.stderr.splitlines()[-1:],
          out.stdout) == (128 + signum, [main.exit_line(signum)], ''), out.stderr[-3000:]


@pytest.mark.parametrize('after_s', [0.01, 0.03])
def test_ctrl_c_inside_jaxlibs_initialisation_waits_for_it(after_s):
  """Ctrl-C inside jaxlib's extension initialisation (~0.1 s of `import jax`) was dropped
  (the command ran on), became an ImportError traceback, or crashed the process."""
  out = _run_with_ctrl_c_in_import(
      'vit-predict', 'jaxlib._jax',
      f'threading.Timer({after_s}, os.kill, (os.getpid(), signal.SIGINT)).start()')
  assert (out.returncode, out.stderr.splitlines(),
          out.stdout) == (130, ['vit-predict: interrupted (Ctrl-C)'], ''), out.stderr[-3000:]


@pytest.mark.parametrize(
    'argv,says',
    [
        (['vit-evaluate', 'workdirs/quickstart'],
         "vit-evaluate: unexpected argument 'workdirs/quickstart': this command takes flags only (a "
         "run's folder is --workdir=DIR; see --help)"),
        (['vit-train', '--config=quickstart', '--workdir=w', 'extra', 'words'],
         "vit-train: unexpected argument 'extra words': this command takes flags only (a folder is "
         '--workdir=DIR, a config --config=NAME; see --help)'),
        (['vit-train', '--config=quickstart', '--workdir=w', '--coordinator_address=1.2.3.4:5'
         ], 'vit-train: --coordinator_address needs --num_processes and --process_id'),
        # The multi-host flags as a user mistypes them: each had trained alone as process 0 of 1
        # and exited 0 (no address), aborted in C++ (heartbeat 0) or raised JAX's traceback.
        (['vit-train', '--config=quickstart', '--workdir=w', '--num_processes=2', '--process_id=1'
         ], "vit-train: --num_processes and --process_id need --coordinator_address=HOST:PORT "
         "(process 0's): give all three on every host (a Cloud TPU VM needs none of them)"),
        (['vit-train', '--config=quickstart', '--workdir=w', '--heartbeat_timeout_seconds=0'],
         'vit-train: flag --heartbeat_timeout_seconds=0: 0 is not a positive integer (see --help)'),
        ([
            'vit-train', '--config=quickstart', '--workdir=w', '--coordinator_address=1.2.3.4:5',
            '--num_processes=2', '--process_id=2'
        ], 'vit-train: --process_id 2 is not one of the 2 processes: give each host one of 0..1'),
        ([
            'vit-train', '--config=quickstart', '--workdir=w', '--coordinator_address=1.2.3.4',
            '--num_processes=2', '--process_id=0'
        ], "vit-train: --coordinator_address '1.2.3.4' is not HOST:PORT: give process 0's address "
         'and a free port, e.g. 10.0.0.2:1234'),
        (['vit-train', '--config=quickstart', '--workdir=w', '--distributed=on'
         ], 'vit-train: jax.distributed.initialize: coordinator_address should be defined: outside '
         'Cloud TPU and the clusters JAX detects, give --coordinator_address=HOST:PORT, '
         '--num_processes and --process_id (or --distributed=off for one host)'),
    ])
def test_a_stray_word_is_one_line(tmp_path, argv, says):
  """A workdir given without --workdir had printed the whole --help (56 lines), ending
  "Unexpected arguments: ['workdirs/quickstart']"."""
  bin_dir = os.path.dirname(sys.executable)
  out = subprocess.run([os.path.join(bin_dir, argv[0]), *argv[1:]], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
  assert (out.returncode, out.stderr.strip().splitlines()[-1:]) == (1, [says]), out.stderr[-3000:]
  assert len(out.stderr.strip().splitlines()) < 5 and not (tmp_path / 'w').exists()


@pytest.mark.parametrize('argv', [
    ['vit-train', '--config=quickstart', '--help'],
    ['vit-evaluate', '--help'],
    ['vit-vtab', '--model=ViT-B_16', '--workdir=w', '--dry-run'],
])
def test_output_into_a_reader_that_stopped_ends_quietly(tmp_path, argv):
  """`| head -1`: vit-train's --help had ended with 'vit-train: [Errno 32] Broken pipe (see
  --help)' and vit-vtab's with a traceback of ~20 lines; now each exits 141 (as a command
  killed by SIGPIPE) with nothing on stderr. Here the reader has gone before the first
  write, so every write fails."""
  bin_dir = os.path.dirname(sys.executable)
  read_end, write_end = os.pipe()
  os.close(read_end)
  out = subprocess.run([os.path.join(bin_dir, argv[0]), *argv[1:]], cwd=tmp_path, stdout=write_end,
                       stderr=subprocess.PIPE, text=True, timeout=300)
  os.close(write_end)
  assert (out.returncode, out.stderr) == (141, ''), out.stderr[-3000:]


@pytest.mark.parametrize('closed', ['>&-', '>&- 2>&- <&-'])
def test_a_run_whose_standard_streams_are_closed_trains(tmp_path, closed):
  """`vit-train ... >&-` (some daemonizers close them): Python had set sys.stdout to None and
  the command ended in a traceback before it trained. With fd 2 closed, the next file opened
  would have taken it, and TensorFlow's and XLA's C++ log lines would have gone into it."""
  vit_train = os.path.join(os.path.dirname(sys.executable), 'vit-train')
  run = [
      vit_train, '--config=quickstart', '--workdir=w', '--config.total_steps=10',
      '--config.warmup_steps=2', '--config.eval_every_steps=0', '--config.model.num_layers=1',
      '--config.train_split=train[:1024]', '--config.eval_split=test[:256]'
  ]
  out = subprocess.run(['bash', '-c', f'exec {shlex.join(run)} {closed}'], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  log = (tmp_path / 'w' / 'train.INFO').read_text().splitlines()
  assert 'Final test[:256] top-1 accuracy: ' in log[-1], log[-3:]


@pytest.mark.parametrize('argv,path', [
    (['vit-evaluate', '--workdir=gs://vit-jax-test/run'], 'gs://vit-jax-test/run/config.json'),
    (['vit-predict', '--workdir=gs://vit-jax-test/run', '../shoe.png'
     ], 'gs://vit-jax-test/run/config.json'),
    (['vit-inspect', '--workdir=gs://vit-jax-test/run', '--outdir=figures'
     ], 'gs://vit-jax-test/run/config.json'),
    ([
        'vit-train', '--config=quickstart', '--workdir=w',
        '--config.dataset=folder:gs://vit-jax-test/images'
    ], 'gs://vit-jax-test/images'),
    ([
        'vit-sweep', '--config=quickstart', '--workdir=gs://vit-jax-test/sweep',
        '--sweep=config.seed=[0,1]'
    ], 'gs://vit-jax-test/sweep/sweep.json'),
    ([
        sys.executable, '-m', 'vit_jax.launch.sweep', '--config=quickstart',
        '--workdir=gs://vit-jax-test/sweep', '--sweep=config.seed=[0,1]'
    ], 'gs://vit-jax-test/sweep/sweep.json'),
    (['vit-vtab', '--model=ViT-B_16', '--workdir=gs://vit-jax-test/vtab', '--tasks=dtd'
     ], 'gs://vit-jax-test/vtab/dtd/final.npz'),
])
def test_a_bucket_that_cannot_be_read_is_one_line(tmp_path, argv, path):
  """A bucket misnamed, not this machine's or without a network had ended each command in
  TensorFlow's traceback wherever it first read from it ('FailedPreconditionError ... when
  reading metadata of gs://...')."""
  Image.new('L', (28, 28)).save(tmp_path / 'shoe.png')
  cwd = tmp_path / 'cwd'
  cwd.mkdir()
  program = argv[0] if argv[0].startswith('vit-') else 'vit-sweep'
  command = os.path.join(os.path.dirname(sys.executable),
                         argv[0]) if argv[0] == program else argv[0]
  out = subprocess.run([command, *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, **UNREACHABLE_GCS))
  assert out.returncode == 1, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith(f'{program}: cannot access {path}: '), out.stderr[-3000:]
  assert 'Could not connect' in last and last.endswith(f': {errors.GCS_FIX}'), last
  assert 'Traceback' not in out.stderr and os.listdir(cwd) == [], out.stderr[-3000:]
  assert 'oneDNN' not in out.stderr, out.stderr[-3000:]  # TensorFlow's notices on import


def test_only_tensorflows_errors_of_reaching_a_bucket_are_said_so():
  """Errors of a file's contents, and those of other paths, keep their traceback."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  text = ('All 10 retry attempts failed. The last failure: Error executing an HTTP request: '
          "libcurl code 6 meaning 'Could not resolve hostname'\n\t when reading metadata of "
          'gs://b/run/config.json')
  unreachable = tf.errors.FailedPreconditionError(None, None, text)
  assert errors.unreachable_path(unreachable) == (
      "cannot access gs://b/run/config.json: libcurl code 6 meaning 'Could not resolve "
      f"hostname': {errors.GCS_FIX}")
  try:  # as TFDS raises it: a RuntimeError from it
    raise RuntimeError(f'FailedPreconditionError: {text}') from unreachable
  except RuntimeError as e:
    assert errors.unreachable_path(e) == errors.unreachable_path(unreachable)
  assert errors.unreachable_path(tf.errors.InvalidArgumentError(None, None, text)) is None
  assert errors.unreachable_path(tf.errors.PermissionDeniedError(None, None, 'on /x')) is None
  assert errors.unreachable_path(RuntimeError(text)) is None
  # A local folder this user may not read: gfile's words and Python's.
  fix = 'give this user permission there, or run the command as the user who owns it'
  assert errors.unreachable_path(
      tf.errors.PermissionDeniedError(None, None, '/r/checkpoints; Permission denied')) == (
          f'cannot access /r/checkpoints: permission denied: {fix}')
  assert errors.unreachable_path(PermissionError(
      13, 'Permission denied', '/r/c')) == (f'cannot access /r/c: permission denied: {fix}')
  assert errors.unreachable_path(PermissionError(1, 'Operation not permitted')) is None


@pytest.mark.parametrize('argv,last', [
    (['vit-train', '--config=quickstart', '--workdir=w', '--config.dataset=folder:locked'
     ], 'vit-train: Folder {tmp}/locked cannot be read (permission denied): give this user read '
     'permission on the dataset (chmod -R a+rX {tmp}/locked)'),
    ([
        'vit-train', '--config=quickstart', '--workdir=w', '--config.dataset=cifar10',
        '--config.data_dir=locked'
    ], 'vit-train: cannot read data_dir {tmp}/locked: Permission denied '
     '({tmp}/locked/cifar10/3.0.2/dataset_info.json): give this user read permission on it '
     '(chmod -R a+rX {tmp}/locked)'),
    (['vit-tfds-build', 'cifar10', '--data_dir=locked'
     ], 'vit-tfds-build: error: cifar10: cannot read data_dir locked: Permission denied '
     '(locked/cifar10/3.0.2/dataset_info.json): give this user read permission on it '
     '(chmod -R a+rX locked)'),
    (['vit-train', '--config=quickstart', '--workdir=w', '--config.data_dir=locked'
     ], 'vit-train: cannot read data_dir {tmp}/locked: Permission denied '
     '({tmp}/locked/train-images-idx3-ubyte.gz): give this user read permission on it '
     '(chmod -R a+rX {tmp}/locked)'),
    (['vit-evaluate', '--workdir=locked'], 'vit-evaluate: {tmp}/locked/config.json cannot be read '
     "(permission denied): give this user read permission on the run's folder"),
])
def test_a_folder_this_user_cannot_read_is_one_line(tmp_path, argv, last):
  """A folder: dataset had ended vit-train in TensorFlow's PermissionDeniedError traceback; a
  TFDS data_dir had been called not prepared, Fashion-MNIST's missing (`apt-get install`),
  and a run's folder said to have no config.json."""
  (tmp_path / 'locked').mkdir(mode=0)
  try:
    out = subprocess.run([
        *without_root_override(),
        os.path.join(os.path.dirname(sys.executable), argv[0]), *argv[1:]
    ], cwd=tmp_path, capture_output=True, text=True, timeout=300)
  finally:
    (tmp_path / 'locked').chmod(0o755)  # for pytest to delete it
  last = last.format(tmp=tmp_path)
  assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (1, last), out.stderr[-3000:]
  assert os.listdir(tmp_path) == ['locked'] and os.listdir(tmp_path / 'locked') == []


@pytest.mark.parametrize('argv', [
    ['vit-train', '--config=quickstart', '--workdir=run'],
    ['vit-evaluate', '--workdir=run', '--step=5'],
])
def test_a_run_whose_checkpoints_this_user_cannot_read_is_one_line(tmp_path, argv):
  """A colleague's run, its checkpoints/ not readable by others: resuming it or evaluating a
  step had ended in a PermissionDeniedError (or PermissionError) traceback."""
  (tmp_path / 'run').mkdir()
  (tmp_path / 'run' / 'config.json').write_text(quickstart.get_config().to_json())
  (tmp_path / 'run' / 'checkpoints').mkdir(mode=0)
  try:
    out = subprocess.run([
        *without_root_override(),
        os.path.join(os.path.dirname(sys.executable), argv[0]), *argv[1:]
    ], cwd=tmp_path, capture_output=True, text=True, timeout=300)
  finally:
    (tmp_path / 'run' / 'checkpoints').chmod(0o755)
  assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (
      1, f'{argv[0]}: cannot access {tmp_path}/run/checkpoints: permission denied: give this '
      'user permission there, or run the command as the user who owns it'), out.stderr[-3000:]
  assert sorted(os.listdir(tmp_path / 'run')) == ['checkpoints', 'config.json']  # no lock left
