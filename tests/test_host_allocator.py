"""VIT_JAX_HOST_ALLOCATOR: vit-train re-executes itself with the chosen allocator preloaded."""
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, harmless_preload, installed_jemalloc
from vit_jax import host_allocator
from vit_jax import xla_cpu_flags

PRELOADED = host_allocator.PRELOADED
IDX_SIZES = (64, 32)  # train, test examples of the idx_dir fixture


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch):
  monkeypatch.setattr(xla_cpu_flags, 'accelerator_plugin_installed', lambda: False)


def _installed_at(tmp_path, monkeypatch):
  """A stand-in libjemalloc.so.2 where a distribution installs it."""
  (tmp_path / 'x86_64-linux-gnu').mkdir()
  library = tmp_path / 'x86_64-linux-gnu' / 'libjemalloc.so.2'
  library.write_bytes(b'')
  monkeypatch.setattr(host_allocator, 'LIBRARY_GLOBS',
                      (str(tmp_path / '*-linux-gnu' / 'libjemalloc.so.2'),))
  return str(library)


def test_by_default_jemalloc_is_preloaded_where_installed(tmp_path, monkeypatch):
  library = _installed_at(tmp_path, monkeypatch)
  for default in ({}, {host_allocator.CHOICE: 'auto'}, {host_allocator.CHOICE: ''}):
    env = host_allocator.reexec_environment({**default, 'PATH': '/bin'})
    assert env['LD_PRELOAD'] == library and env[PRELOADED] == library
    assert env['MALLOC_CONF'] == host_allocator.MALLOC_CONF and env['PATH'] == '/bin'
  # An allocator the user preloads is theirs (Colab preloads tcmalloc); system is malloc.
  for theirs in ('/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4', '/x/libmimalloc.so /y/lib.so'):
    assert host_allocator.reexec_environment({'LD_PRELOAD': theirs}) is None
    assert host_allocator.describe({
        'LD_PRELOAD': theirs
    }).startswith('host allocator: as '
                  'LD_PRELOAD says')
  assert host_allocator.reexec_environment({host_allocator.CHOICE: 'system'}) is None
  # Another preload is kept beside jemalloc.
  env = host_allocator.reexec_environment({'LD_PRELOAD': '/opt/other.so'})
  assert env['LD_PRELOAD'] == f'{library}:/opt/other.so'
  # A process not started as vit-train starts: installed, not in use (it had said "no
  # libjemalloc.so.2 installed" and given the apt-get line on a host that had it).
  assert host_allocator.describe({}) == (
      f"host allocator: the C library's malloc ({library} is installed, but this process was "
      'not started under it, as vit-train starts)')


def test_by_default_the_c_library_malloc_where_jemalloc_is_not_installed(monkeypatch):
  monkeypatch.setattr(host_allocator, 'LIBRARY_GLOBS', ('/nowhere/libjemalloc.so.2',))
  assert host_allocator.reexec_environment({}) is None
  assert 'apt-get install libjemalloc2' in host_allocator.describe({})
  assert host_allocator.describe({host_allocator.CHOICE: 'system'
                                 }) == ("host allocator: the C library's malloc")


def test_a_library_path_is_preloaded_with_the_malloc_conf(tmp_path):
  library = tmp_path / 'libjemalloc.so.2'
  library.write_bytes(b'')
  env = host_allocator.reexec_environment({
      host_allocator.CHOICE: str(library),
      'LD_PRELOAD': '/opt/other.so',
      'PATH': '/bin'
  })
  assert env['LD_PRELOAD'] == f'{library}:/opt/other.so'  # the user's preload is kept
  assert env['MALLOC_CONF'] == host_allocator.MALLOC_CONF
  assert env[PRELOADED] == str(library) and env['PATH'] == '/bin'
  # A MALLOC_CONF of the user's own wins.
  mine = host_allocator.reexec_environment({
      host_allocator.CHOICE: str(library),
      'MALLOC_CONF': 'narenas:1'
  })
  assert mine['MALLOC_CONF'] == 'narenas:1'


def test_a_child_process_can_be_given_back_the_c_library_malloc(tmp_path):
  library = tmp_path / 'libjemalloc.so.2'
  library.write_bytes(b'')
  user = {'LD_PRELOAD': '/opt/other.so', 'PATH': '/bin'}
  env = host_allocator.reexec_environment({**user, host_allocator.CHOICE: str(library)})
  child = host_allocator.without_preload(env)
  assert child == {**user, host_allocator.CHOICE: str(library)}
  # Nothing of the user's is taken away: their own MALLOC_CONF, or a run not re-executed.
  mine = host_allocator.reexec_environment({
      host_allocator.CHOICE: str(library),
      'MALLOC_CONF': 'narenas:1'
  })
  assert host_allocator.without_preload(mine)['MALLOC_CONF'] == 'narenas:1'
  assert host_allocator.without_preload({'LD_PRELOAD': '/x.so'}) == {'LD_PRELOAD': '/x.so'}
  alone = host_allocator.reexec_environment({host_allocator.CHOICE: str(library)})
  assert host_allocator.without_preload(alone) == {host_allocator.CHOICE: str(library)}


def test_jemalloc_is_found_where_distributions_install_it(tmp_path, monkeypatch):
  library = _installed_at(tmp_path, monkeypatch)
  env = host_allocator.reexec_environment({host_allocator.CHOICE: 'jemalloc'})
  assert env['LD_PRELOAD'] == library


def test_no_second_exec_and_no_override_of_the_users_own_preload(tmp_path):
  library = tmp_path / 'libjemalloc.so.2'
  library.write_bytes(b'')
  chosen = {host_allocator.CHOICE: str(library)}
  # Once re-executed (even if the loader refused the library), never again: no loop.
  assert host_allocator.reexec_environment({**chosen, PRELOADED: str(library)}) is None
  assert host_allocator.reexec_environment({
      **chosen, 'LD_PRELOAD': '/usr/lib/libjemalloc.so.2'
  }) is None


def test_not_where_an_accelerator_plugin_is_installed(tmp_path, monkeypatch):
  library = tmp_path / 'libjemalloc.so.2'
  library.write_bytes(b'')
  monkeypatch.setattr(xla_cpu_flags, 'accelerator_plugin_installed', lambda: True)
  assert host_allocator.reexec_environment({host_allocator.CHOICE: str(library)}) is None


def test_bad_values_name_the_fix(monkeypatch):
  with pytest.raises(
      ValueError, match=r'VIT_JAX_HOST_ALLOCATOR=/no/such\.so: no such file; '
      'set it to auto, jemalloc, system, or the path'):
    host_allocator.reexec_environment({host_allocator.CHOICE: '/no/such.so'})
  monkeypatch.setattr(host_allocator, 'LIBRARY_GLOBS', ('/nowhere/libjemalloc.so.2',))
  with pytest.raises(ValueError, match='apt-get install libjemalloc2'):
    host_allocator.reexec_environment({host_allocator.CHOICE: 'jemalloc'})


def _quickstart(tmp_path, idx_dir, allocator):
  env = {k: v for k, v in os.environ.items() if k not in ('LD_PRELOAD', 'MALLOC_CONF', PRELOADED)}
  env[host_allocator.CHOICE] = allocator
  return subprocess.run([
      sys.executable, '-m', 'vit_jax.main', '--config=quickstart', '--workdir=workdirs/alloc',
      f'--config.data_dir={idx_dir}', '--config.total_steps=3', '--config.warmup_steps=1',
      '--config.batch_size=16', '--config.eval_every_steps=0'
  ], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_vit_train_re_executes_with_the_library_preloaded(tmp_path, idx_dir):
  # As a user runs it, from the shell with a relative workdir: the re-executed process gets
  # the same arguments, the library is mapped in it, and the log says so.
  library = harmless_preload()
  proc = _quickstart(tmp_path, idx_dir, library)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f'host allocator: {library}, preloaded at start-up' in proc.stderr
  assert os.path.exists(tmp_path / 'workdirs' / 'alloc' / 'final.npz')
  assert proc.stderr.count('Final test top-1 accuracy') == 1


def test_vit_train_by_default_runs_on_jemalloc_where_installed(tmp_path, idx_dir):
  proc = _quickstart(tmp_path, idx_dir, 'auto')
  assert proc.returncode == 0, proc.stderr[-3000:]
  if installed_jemalloc():
    assert f'host allocator: {installed_jemalloc()}, preloaded at start-up' in proc.stderr
  else:
    assert "host allocator: the C library's malloc (no libjemalloc.so.2 installed" in proc.stderr
  assert proc.stderr.count('Final test top-1 accuracy') == 1


def test_a_bad_allocator_value_stops_vit_train_in_one_line(tmp_path, idx_dir):
  proc = _quickstart(tmp_path, idx_dir, 'jemallok')
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines() == [
      'vit-train: VIT_JAX_HOST_ALLOCATOR=jemallok: no such file; set it to auto, jemalloc, '
      'system, or the path of a libjemalloc.so.2'
  ]
  assert not os.path.exists(tmp_path / 'workdirs')


@pytest.mark.skipif(installed_jemalloc() is None, reason='jemalloc is not installed on this host')
def test_under_jemalloc_release_freed_purges_its_arenas():
  code = ('from vit_jax import host_allocator, host_memory; '
          'print(host_memory.release_freed(), host_allocator.describe())')
  env = dict(os.environ, LD_PRELOAD=installed_jemalloc(), MALLOC_CONF=host_allocator.MALLOC_CONF)
  env[PRELOADED] = installed_jemalloc()
  out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                       check=True, cwd=ROOT).stdout
  assert out.startswith(f'True host allocator: {installed_jemalloc()}, preloaded at start-up'), out
