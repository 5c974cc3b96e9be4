"""vit-tfds-build, run as a user runs it: the command the refusals of a dataset not prepared
name (TFDS's `tfds build` does not start without apache-beam)."""
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests import data_fixtures
from tests.conftest import CTRL_C_AS_IN_A_TERMINAL, UNREACHABLE_GCS, console_script

CATALOG = 'see https://www.tensorflow.org/datasets/catalog'

# A dataset TFDS prepares here without a network: registered by the Python that runs the
# command, then prepared by it as any TFDS dataset is.
_WITH_A_DATASET_OF_OUR_OWN = '''
import sys
import numpy as np
import tensorflow_datasets as tfds
from vit_jax import tfds_build

class VitJaxTestDigits(tfds.core.GeneratorBasedBuilder):
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(shape=(8, 8, 1)),
        'label': tfds.features.ClassLabel(num_classes=2)}))

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(20), 'test': self._generate_examples(10)}

  def _generate_examples(self, n):
    for i in range(n):
      yield i, {'image': np.full((8, 8, 1), i, np.uint8), 'label': i % 2}

tfds_build.main(sys.argv[1:])
'''


def test_a_dataset_is_prepared_once(tmp_path):
  run = [sys.executable, '-c', _WITH_A_DATASET_OF_OUR_OWN, 'vit_jax_test_digits', '--data_dir=d']
  first = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr[-2000:]
  assert first.stdout.splitlines()[-1] == ('vit_jax_test_digits: prepared in '
                                           'd/vit_jax_test_digits/1.0.0 (train: 20, test: 10 '
                                           'examples)'), first.stdout
  assert os.path.exists(tmp_path / 'd' / 'vit_jax_test_digits' / '1.0.0' / 'dataset_info.json')
  again = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-2000:]
  assert again.stdout.splitlines() == [
      'vit_jax_test_digits: already prepared in d/vit_jax_test_digits/1.0.0, left as it is'
  ]


def test_a_dataset_prepared_by_tfds_is_left_as_it_is(tmp_path):
  """As `tfds build` left it; the data_dir's path holds a space and '['."""
  data_fixtures.write_tfds_cifar10(str(tmp_path / 'my data[1]'), num_train=20, num_test=10)
  out = console_script('vit-tfds-build', tmp_path, 'cifar10', '--data_dir=my data[1]')
  assert (out.returncode, out.stdout) == (
      0, 'cifar10: already prepared in my data[1]/cifar10/3.0.2, left as it is\n'), out.stderr


@pytest.mark.parametrize('argv,line', [
    (['cifar1O'], f'cifar1O: TFDS has no dataset of that name (did you mean cifar10?): {CATALOG}'),
    (['cifar10/foo'], f'cifar10/foo: BuilderConfig foo not found with version 3.0.2: {CATALOG}'),
    (['a b'], 'a b: not a TFDS name (TFDS reads name[/config][:version], e.g. cifar10 or '
     f'oxford_iiit_pet:3.*.*): {CATALOG}'),
    (['cifar10', '--data_dir=a', '--data_dir=b'], "--data_dir is given more than once ('a', 'b'): "
     'give one'),
    ([], 'the following arguments are required: NAME'),
])
def test_a_name_or_flag_tfds_refuses_is_one_line(tmp_path, argv, line):
  out = console_script('vit-tfds-build', tmp_path, *argv)
  assert (out.returncode, out.stdout) == (1, ''), out.stderr[-2000:]
  assert out.stderr.splitlines()[-1] == f'vit-tfds-build: error: {line}', out.stderr[-2000:]
  assert os.listdir(tmp_path) == []


def test_a_dataset_downloaded_by_hand_names_where_its_files_go(tmp_path):
  """TFDS reads imagenet2012 from the manual folder only. Preparing it had also needed
  importlib_resources, which TFDS 4.9.10 uses on every Python but requires before 3.9 only:
  every dataset of TFDS's had stopped with ModuleNotFoundError."""
  out = console_script('vit-tfds-build', tmp_path, 'imagenet2012', '--data_dir=d', timeout=600)
  assert out.returncode == 1, out.stderr[-2000:]
  last = out.stderr.splitlines()[-1]
  assert last.startswith('vit-tfds-build: error: imagenet2012: Manual directory '
                         'd/downloads/manual does not exist or is empty.'), last
  assert 'ILSVRC2012_img_train.tar' in last and last.endswith(' Then run this command again.')


def test_a_dataset_needing_a_module_not_installed_names_its_package(tmp_path):
  """VTAB's sun397, kitti and diabetic_retinopathy_detection import cv2 as TFDS prepares
  them (after their download): a traceback of TFDS's lazy import had ended the command."""
  if importlib.util.find_spec('cv2'):
    pytest.skip('cv2 is installed here')
  code = _WITH_A_DATASET_OF_OUR_OWN.replace(
      "    return {'train'", "    tfds.core.lazy_imports.cv2.imread  # as sun397's does\n"
      "    return {'train'")
  out = subprocess.run([sys.executable, '-c', code, 'vit_jax_test_digits', '--data_dir=d'],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  assert out.stderr.splitlines()[-1] == (
      'vit-tfds-build: error: vit_jax_test_digits: preparing it needs the Python module cv2, '
      'which vit_jax does not install: pip install opencv-python-headless, then run this '
      'command again'), out.stderr[-2000:]


def test_a_dataset_not_downloaded_names_its_url_and_what_to_copy(tmp_path):
  """Without a network: the URL and its cause in one line (not requests' 'Max retries
  exceeded', which repeats them), and the folder to copy from a machine that has one."""
  code = _WITH_A_DATASET_OF_OUR_OWN.replace(
      "    return {'train'", "    dl_manager.download('http://vit-jax-test.invalid/digits.tar')\n"
      "    return {'train'").replace(
          'from vit_jax import tfds_build', 'from vit_jax import tfds_build\n'
          'from tensorflow_datasets.core.download import downloader\n'
          'downloader.MAX_RETRIES = 0  # TFDS retries 10 times with backoff: 3.5 minutes')
  # What the data_dir held before is kept, another download's folder under way too.
  earlier = tmp_path / 'd' / 'downloads' / 'vit_jax_test_digits' / f'a.tar.tmp.{"0" * 32}'
  earlier.mkdir(parents=True)
  (earlier / 'a.tar').write_bytes(b'part')
  (tmp_path / 'd' / 'mnist').mkdir()
  held = _tree(tmp_path / 'd')
  out = subprocess.run([sys.executable, '-c', code, 'vit_jax_test_digits', '--data_dir=d'],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  last = out.stderr.splitlines()[-1]
  assert last.startswith('vit-tfds-build: error: vit_jax_test_digits: cannot download its files '
                         '(http://vit-jax-test.invalid/digits.tar: '), last
  assert "Failed to resolve 'vit-jax-test.invalid'" in last and 'Max retries' not in last, last
  assert last.endswith('): check this machine\'s network, or prepare it on a machine that has '
                       'one and copy d/vit_jax_test_digits/1.0.0 to the same path here'), last
  # Not TFDS's folder of the failed download (d/downloads/vit_jax_test_digits/<file>.tmp.<uuid>),
  # d/downloads/extracted or d/vit_jax_test_digits, which it had left.
  assert _tree(tmp_path / 'd') == held


def _tree(folder):
  return sorted(
      os.path.relpath(os.path.join(d, f), folder) for d, subfolders, files in os.walk(folder)
      for f in subfolders + files)


def test_a_preparation_cut_off_leaves_nothing(tmp_path):
  """Ctrl-C as the examples are written: the folders TFDS had made for it are gone with its
  incomplete.* (d/downloads/extracted and d/vit_jax_test_digits had been left, empty)."""
  code = CTRL_C_AS_IN_A_TERMINAL + _WITH_A_DATASET_OF_OUR_OWN.replace(
      "      yield i, {", "      open('writing', 'w').close()\n"
      "      __import__('time').sleep(60)\n"
      "      yield i, {").replace(
          'tfds_build.main(sys.argv[1:])', 'from vit_jax import console_scripts\n'
          "console_scripts.run_as_main(tfds_build.main, 'vit-tfds-build')")
  with subprocess.Popen([sys.executable, '-c', code, 'vit_jax_test_digits', '--data_dir=d'],
                        cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                        text=True) as command:
    for _ in range(600):
      if (tmp_path / 'writing').exists() or command.poll() is not None:
        break
      time.sleep(0.2)
    assert (tmp_path / 'd' / 'vit_jax_test_digits').exists()
    command.send_signal(signal.SIGINT)
    try:
      stderr = command.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:  # Ctrl-C not taken: not 30 minutes of examples more
      command.kill()
      raise
  assert (command.returncode, stderr.strip().splitlines()[-1]) == (
      130, 'vit-tfds-build: interrupted (Ctrl-C)'), stderr[-2000:]
  assert not (tmp_path / 'd').exists(), (_tree(tmp_path / 'd'), stderr[-2000:])


def test_a_data_dir_that_cannot_be_read_is_one_line(tmp_path):
  """A bucket this machine cannot read had ended the command in TFDS's traceback."""
  out = console_script('vit-tfds-build', tmp_path, 'cifar10', '--data_dir=gs://vit-jax-test/tfds',
                       **UNREACHABLE_GCS)
  assert (out.returncode, out.stdout) == (1, ''), out.stderr[-2000:]
  last = out.stderr.splitlines()[-1]
  assert last.startswith('vit-tfds-build: error: cifar10: cannot read data_dir '
                         'gs://vit-jax-test/tfds: '), last
  assert 'Could not connect' in last and 'Traceback' not in out.stderr, out.stderr[-2000:]


# The dataset of our own, whose examples wait for a file 'go' (each command says it began
# writing them in 'writing.<pid>'), run as the console script is.
_WAITING_FOR_GO = CTRL_C_AS_IN_A_TERMINAL + _WITH_A_DATASET_OF_OUR_OWN.replace(
    "      yield i, {", "      import os, time\n"
    "      open(f'writing.{os.getpid()}', 'w').close()\n"
    "      while not os.path.exists('go'):\n"
    "        time.sleep(0.1)\n"
    "      yield i, {").replace(
        'tfds_build.main(sys.argv[1:])', 'from vit_jax import console_scripts\n'
        "console_scripts.run_as_main(tfds_build.main, 'vit-tfds-build')")


def _until(condition, what):
  deadline = time.time() + 300
  while not condition():
    assert time.time() < deadline, f'no {what} in 300 s'
    time.sleep(0.2)


@pytest.mark.parametrize('first_ends', ['prepared', 'cut off'])
def test_two_preparations_of_one_dataset_at_once_prepare_it_once(tmp_path, first_ends):
  """A second command for a dataset the first is preparing: both had written it, and the
  second to finish had failed (`Cannot rename ... Destination ... already exists`); one
  that failed had removed the other's downloads under way. The second waits, then leaves
  the first's as it is, or prepares it where the first was cut off."""
  run = [sys.executable, '-c', _WAITING_FOR_GO, 'vit_jax_test_digits', '--data_dir=d']
  commands = []
  try:
    for name in ('first', 'second'):
      with open(tmp_path / f'{name}.out', 'w') as out:
        commands.append(
            subprocess.Popen(run, cwd=tmp_path, stdout=out, stderr=subprocess.PIPE, text=True))
      if name == 'first':
        _until(lambda: any(f.startswith('writing.') for f in os.listdir(tmp_path)), 'first example')
    first, second = commands
    _until(lambda: 'waiting for it to end' in (tmp_path / 'second.out').read_text(),
           'wait of the second')
    assert (tmp_path / 'second.out').read_text() == (
        f'vit_jax_test_digits: pid {first.pid} on {socket.gethostname()} is preparing it in d: '
        'waiting for it to end\n')
    if first_ends == 'cut off':
      first.send_signal(signal.SIGINT)
      assert first.wait(timeout=120) == 130
    (tmp_path / 'go').touch()
    outs = [c.communicate(timeout=300)[1] for c in commands]
  finally:
    for c in commands:
      c.kill()
  assert second.returncode == 0, outs[1][-2000:]
  lines = (tmp_path / 'second.out').read_text().splitlines()
  writers = sorted(int(f.split('.')[1]) for f in os.listdir(tmp_path) if f.startswith('writing.'))
  if first_ends == 'prepared':
    assert first.returncode == 0, outs[0][-2000:]
    assert lines[-1] == ('vit_jax_test_digits: prepared in d/vit_jax_test_digits/1.0.0 by the '
                         'command it waited for, left as it is')
    assert writers == [first.pid]
  else:
    assert lines[-1] == ('vit_jax_test_digits: prepared in d/vit_jax_test_digits/1.0.0 (train: '
                         '20, test: 10 examples)')
    assert writers == sorted([first.pid, second.pid])
  assert os.path.exists(tmp_path / 'd' / 'vit_jax_test_digits' / '1.0.0' / 'dataset_info.json')
  assert not os.path.exists(tmp_path / 'd' / 'downloads' / 'vit_jax_test_digits')  # its lock


def test_a_data_dir_on_a_filesystem_without_locks_is_prepared_unlocked(tmp_path):
  """A mount whose flock fails (ENOSYS: a FUSE filesystem without locks, as a bucket mounted
  as a folder may be): the lock that keeps two commands apart must not stop the one there is
  (it had: `cannot prepare it in ...: Function not implemented`)."""
  no_locks = ('import errno, fcntl\n'
              'def flock(fd, op):\n'
              '  raise OSError(errno.ENOSYS, "Function not implemented")\n'
              'fcntl.flock = flock\n')
  run = [
      sys.executable, '-c', no_locks + _WITH_A_DATASET_OF_OUR_OWN, 'vit_jax_test_digits',
      '--data_dir=d'
  ]
  out = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines()[-1].startswith('vit_jax_test_digits: prepared in '
                                                'd/vit_jax_test_digits/1.0.0 (train: 20')
  assert not os.path.exists(tmp_path / 'd' / 'downloads' / 'vit_jax_test_digits')
