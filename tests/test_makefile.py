"""The Makefile's system packages, run through make as a user's shell runs it, with `id`,
`dpkg` and `apt-get` replaced by scripts that play root or not, installed or not, and an
apt-get that works, needs an update first, or fails. Fashion-MNIST is required (the
quickstart reads it and tests/test_faults.py runs the CLI on it); jemalloc is optional, so
its target exits 0 whatever happens."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import ROOT

MAKEFILE = os.path.join(ROOT, 'Makefile')
SHIMS = {
    'id': 'echo "$FAKE_UID"',
    'dpkg': 'exit "$FAKE_DPKG_RC"',  # dpkg -s: 0 installed, 1 not
    # Logs each call; every call works when FAKE_APT=ok, `install` only after an update
    # when =stale, none when =broken.
    'apt-get': '''echo "$*" >> "$APT_LOG"
case "$FAKE_APT:$1" in
  ok:*) exit 0 ;;
  stale:update) touch "$APT_LOG.updated"; exit 0 ;;
  stale:install) [ -f "$APT_LOG.updated" ] ;;
  *) exit 100 ;;
esac''',
}


def make(tmp_path, target, uid, apt='ok', jemalloc_installed=False, dataset=None):
  """(exit status, stdout, the apt-get calls) of `make TARGET` under the fakes; `dataset`:
  the Fashion-MNIST file the Makefile looks for (default: one that does not exist)."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  for name, body in SHIMS.items():
    (bin_dir / name).write_text(f'#!/bin/sh\n{body}\n')
    (bin_dir / name).chmod(0o755)
  log = tmp_path / 'apt.log'
  env = dict(os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}', FAKE_UID=str(uid),
             FAKE_DPKG_RC='0' if jemalloc_installed else '1', FAKE_APT=apt, APT_LOG=str(log))
  dataset = dataset or str(tmp_path / 'absent' / 'train-images-idx3-ubyte.gz')
  out = subprocess.run(['make', '-s', '-f', MAKEFILE, f'FASHION_MNIST={dataset}', target],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
  calls = log.read_text().splitlines() if log.exists() else []
  return out.returncode, out.stdout.strip(), calls


def prerequisites(target):
  with open(MAKEFILE) as f:
    return re.search(rf'^{target}:(.*)$', f.read(), re.MULTILINE).group(1).split()


def test_root_installs_jemalloc_without_an_update_when_the_lists_are_fresh(tmp_path):
  rc, out, calls = make(tmp_path, 'jemalloc', uid=0)
  assert rc == 0
  assert calls == ['install -y -qq libjemalloc2']
  assert out == 'installed libjemalloc2: vit-train runs on jemalloc'


def test_stale_package_lists_are_updated_once_then_jemalloc_installs(tmp_path):
  rc, out, calls = make(tmp_path, 'jemalloc', uid=0, apt='stale')
  assert rc == 0
  assert calls == ['install -y -qq libjemalloc2', 'update -qq', 'install -y -qq libjemalloc2']
  assert out.startswith('installed libjemalloc2')


def test_a_failing_apt_get_is_reported_and_the_quickstart_goes_on(tmp_path):
  rc, out, calls = make(tmp_path, 'jemalloc', uid=0, apt='broken')
  assert rc == 0
  assert 'update -qq' in calls
  assert out == "libjemalloc2 not installed (apt-get failed): vit-train runs on glibc's malloc"


@pytest.mark.parametrize('uid, installed, expected', [
    (1000, False, 'tip: sudo apt-get install libjemalloc2'),
    (0, True, ''),
    (1000, True, ''),
])
def test_without_root_or_once_installed_jemalloc_is_not_installed(tmp_path, uid, installed,
                                                                  expected):
  rc, out, calls = make(tmp_path, 'jemalloc', uid=uid, jemalloc_installed=installed)
  assert rc == 0
  assert calls == []
  assert out.startswith(expected) and bool(out) == bool(expected)


def test_root_installs_a_missing_dataset(tmp_path):
  rc, _, calls = make(tmp_path, 'fashion-mnist', uid=0)
  assert rc == 0
  assert calls == ['update -qq', 'install -y -qq dataset-fashion-mnist']


def test_a_missing_dataset_without_root_stops_with_the_command_to_run(tmp_path):
  rc, out, calls = make(tmp_path, 'fashion-mnist', uid=1000)
  assert rc != 0
  assert calls == []
  assert out == 'Fashion-MNIST is missing: sudo apt-get install dataset-fashion-mnist'


def test_a_present_dataset_is_left_alone(tmp_path):
  present = tmp_path / 'train-images-idx3-ubyte.gz'
  present.write_bytes(b'')
  rc, out, calls = make(tmp_path, 'fashion-mnist', uid=0, dataset=str(present))
  assert (rc, out, calls) == (0, '', [])


def test_both_set_up_commands_get_what_they_need():
  """The quickstart reads the dataset and runs best on jemalloc; the tests need the dataset
  (a fresh machine without it failed 23 of them)."""
  assert {'fashion-mnist', 'jemalloc'} <= set(prerequisites('quickstart'))
  assert 'fashion-mnist' in prerequisites('test')


def make_venv(tmp_path, python_requires, python, venv_python=None):
  """(exit status, stdout + stderr) of `make .venv/installed` in a folder holding a setup.py
  with `python_requires` and, where venv_python is given, a .venv whose python is that script."""
  (tmp_path / 'setup.py').write_text(f'setup(python_requires="{python_requires}")\n')
  (tmp_path / 'constraints.txt').write_text('')
  if venv_python:
    (tmp_path / '.venv' / 'bin').mkdir(parents=True)
    (tmp_path / '.venv' / 'bin' / 'python').write_text(f'#!/bin/sh\n{venv_python}\n')
    (tmp_path / '.venv' / 'bin' / 'python').chmod(0o755)
  out = subprocess.run(['make', '-s', '-f', MAKEFILE, f'PYTHON={python}', '.venv/installed'],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
  return out.returncode, out.stdout + out.stderr


def this_python(tmp_path):
  """This Python as a script in tmp_path: make splits PYTHON=... at spaces, which the venv's
  own path has in a checkout under a folder like 'My Projects'."""
  python = tmp_path / 'this_python'
  python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
  python.chmod(0o755)
  return python


def test_a_python_older_than_setup_py_requires_is_refused_before_a_venv_is_made(tmp_path):
  """pip's refusal came after the venv was made; every later make reused that venv."""
  python = this_python(tmp_path)
  rc, out = make_venv(tmp_path, '>=3.99', python)
  have = '%d.%d' % sys.version_info[:2]
  assert rc != 0
  assert out.splitlines()[0] == (f'{python} is Python {have}; vit_jax needs 3.99 or newer '
                                 '(setup.py): install one and run make .venv/installed '
                                 'PYTHON=python3.99')
  assert not (tmp_path / '.venv').exists()


def test_a_python_newer_than_setup_py_allows_is_refused_before_a_venv_is_made(tmp_path):
  """TensorFlow has no wheels for the newest Python: pip ended in 'No matching distribution'."""
  python = this_python(tmp_path)
  major, minor = sys.version_info[:2]
  rc, out = make_venv(tmp_path, f'>={major}.0,<{major}.{minor}', python)
  assert rc != 0
  assert out.splitlines()[0] == (f'{python} is Python {major}.{minor}; vit_jax needs {major}.0 '
                                 f'to {major}.{minor - 1} (setup.py): install one and run make '
                                 f'.venv/installed PYTHON=python{major}.{minor - 1}')
  assert not (tmp_path / '.venv').exists()


def python_stopping_at_venv(tmp_path):
  """This Python, but `-m venv` prints its arguments and fails: the recipe stops there."""
  python = tmp_path / 'python'
  python.write_text(f'#!/bin/sh\n[ "$1" = -m ] && {{ echo "venv: $*"; exit 3; }}\n'
                    f'exec {shlex.quote(sys.executable)} "$@"\n')
  python.chmod(0o755)
  return python


def test_a_venv_of_another_python_is_made_again(tmp_path):
  """A venv left by a try with an older python3, then make with PYTHON=python3.11: the venv
  is removed and made with the new one."""
  python = python_stopping_at_venv(tmp_path)
  rc, out = make_venv(tmp_path, '>=3.0', python, venv_python='echo "(3, 10)"')
  assert rc != 0
  assert out.splitlines()[:2] == [
      f'.venv was made with another Python: made again with {python}', 'venv: -m venv .venv'
  ]
  assert not (tmp_path / '.venv').exists()


def test_a_venv_of_the_same_python_is_kept(tmp_path):
  python = python_stopping_at_venv(tmp_path)
  rc, out = make_venv(tmp_path, '>=3.0', python,
                      venv_python=f'exec {shlex.quote(sys.executable)} "$@"')
  assert rc != 0
  assert out.splitlines()[0] == 'venv: -m venv .venv'
  assert (tmp_path / '.venv' / 'bin' / 'python').exists()


def test_a_folder_without_symbolic_links_is_refused_before_a_venv_is_made(tmp_path):
  """In a clone on Google Drive (Colab), SMB or FAT, python -m venv had stopped with
  "Error: [Errno 1] Operation not permitted: 'lib' -> '.../.venv/lib64'", a partial .venv
  left behind."""
  (tmp_path / 'setup.py').write_text('setup(python_requires=">=3.0")\n')
  (tmp_path / 'constraints.txt').write_text('')
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'ln').write_text('#!/bin/sh\necho "ln: Operation not permitted" >&2\nexit 1\n')
  (bin_dir / 'ln').chmod(0o755)
  out = subprocess.run(
      ['make', '-s', '-f', MAKEFILE, f'PYTHON={this_python(tmp_path)}', 'quickstart'], cwd=tmp_path,
      capture_output=True, text=True, timeout=60, env=dict(os.environ,
                                                           PATH=f'{bin_dir}:{os.environ["PATH"]}'))
  assert out.returncode != 0
  assert out.stdout.splitlines() == [
      f'{tmp_path} takes no symbolic links, which a venv needs (Google Drive, SMB and FAT '
      'folders refuse them): run make quickstart VENV=DIR with DIR on a local disk (the '
      'workdirs may stay here)'
  ], out.stdout + out.stderr
  assert sorted(os.listdir(tmp_path)) == ['bin', 'constraints.txt', 'setup.py', 'this_python']


def test_venv_names_where_the_venv_is_made(tmp_path):
  python = python_stopping_at_venv(tmp_path)
  (tmp_path / 'setup.py').write_text('setup(python_requires=">=3.0")\n')
  (tmp_path / 'constraints.txt').write_text('')
  venv = tmp_path / 'local' / 'venv'
  out = subprocess.run(
      ['make', '-s', '-f', MAKEFILE, f'PYTHON={python}', f'VENV={venv}', 'quickstart'],
      cwd=tmp_path, capture_output=True, text=True, timeout=60)
  assert out.returncode != 0
  assert out.stdout.splitlines()[0] == f'venv: -m venv {venv}', out.stdout + out.stderr
