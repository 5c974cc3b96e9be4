"""Test set-up before jax starts: 8 simulated CPU devices, vit_jax's XLA:CPU flags, quiet TF."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The commands the tests start run as from a user's shell, which sets neither: this
# machine's environment had hidden status 120 for output piped into `head` (stdout is
# buffered without PYTHONUNBUFFERED) and the __pycache__ a config file left beside it.
for _unlike_a_users_shell in ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"):
  os.environ.pop(_unlike_a_users_shell, None)

# The suite runs with the XLA:CPU flags the training CLI adds (vit_jax/xla_cpu_flags.py).
from vit_jax import xla_cpu_flags  # noqa: E402

xla_cpu_flags.apply()

import ctypes.util  # noqa: E402
import fcntl  # noqa: E402
import glob  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a copy of the checkout leaves out: local state that a wheel build must not see.
NOT_SOURCE = shutil.ignore_patterns('.venv', '.git', 'workdirs', 'build', '*.egg-info',
                                    '__pycache__', '.pytest_cache')


def _build_wheel_venv(tmp):
  """Builds the wheel of this checkout into tmp/dist and a venv holding it into tmp/venv."""
  src = tmp / 'src'
  shutil.copytree(ROOT, src, ignore=NOT_SOURCE)  # build from a copy: no build/ in the checkout
  subprocess.run(
      [sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', '-w',
       str(tmp / 'dist'),
       str(src)], check=True, capture_output=True)
  wheel, = (tmp / 'dist').glob('vit_jax-*.whl')
  venv = tmp / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', str(venv)], check=True)
  # --no-compile: pip's byte-compiling of every installed module (TensorFlow's thousands
  # included) is half the install's time; the modules the tests import compile on first use.
  out = subprocess.run([
      str(venv / 'bin' / 'python'), '-m', 'pip', 'install', '-q', '--no-compile', '-c',
      os.path.join(ROOT, 'constraints.txt'), f'{wheel}[test]'
  ], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]


# One JAX compilation cache for the whole run, given by environment variables so that the
# CLI runs the tests start (new processes, each compiling the same train steps again) use it
# too: a repeated vit-train run of a small config took 30 -> 17 s of CPU. The pytest
# controller (or the one process) makes it before its workers start, which inherit the
# variables, and removes it at the end. A size limit turns on JAX's file lock around each
# read and write, which makes the cache safe for many processes. A process that dies or
# cannot write while it writes an entry (SIGKILL, a full disk) leaves it cut off and without
# its access time, and then every later write to the cache fails with a warning: the tests
# that do that to runs give them a cache of their own, or none (own_compilation_cache).
_CACHE_DIR = 'JAX_COMPILATION_CACHE_DIR'
_RUN_CACHE = 'VIT_JAX_TESTS_JAX_CACHE'  # set: a process above made the run's cache
_OWN_CACHE = None
# (Without filelock, JAX would refuse the size limit: no shared cache then.)
if _RUN_CACHE not in os.environ and importlib.util.find_spec('filelock'):
  _OWN_CACHE = tempfile.mkdtemp(prefix='vit_jax_tests_jax_cache_')
  os.environ[_RUN_CACHE] = os.environ[_CACHE_DIR] = _OWN_CACHE
  os.environ['JAX_COMPILATION_CACHE_MAX_SIZE'] = str(32 << 30)
  # A cache hit costs ~0.2 s to read: only programs slower than that to compile.
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0.5'


def pytest_sessionfinish(session):
  """Fails the run if its compilation cache holds a cut-off entry (one without its access
  time): a test let a run die or run out of disk while writing to it."""
  if not _OWN_CACHE:
    return
  cut_off = sorted(entry.name for entry in pathlib.Path(_OWN_CACHE).glob('*-cache')
                   if not entry.with_name(entry.name[:-len('cache')] + 'atime').exists())
  if cut_off:
    reporter = session.config.pluginmanager.get_plugin('terminalreporter')
    reporter.ensure_newline()
    reporter.write_line(
        f'the compilation cache holds cut-off entries {cut_off}: give the runs that are '
        'killed or starved of disk own_compilation_cache(...)')
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


# TFDS's DatasetInfo.initialize_from_bucket makes a tempfile.mkdtemp('tfds') for every builder
# of a dataset that is not prepared and never removes it: offline it stays empty. vit_jax's
# builders make it in a folder they remove (data_sources.tfds_builder); the tests' own
# tfds.builder calls on mocked datasets do not. The process that started the run removes
# the empty ones made since it started.
_STARTED = time.time()


def _remove_tfds_scratch_dirs():
  for path in glob.glob(os.path.join(tempfile.gettempdir(), 'tmp*tfds')):
    try:
      if os.stat(path).st_mtime >= _STARTED and not os.listdir(path):
        os.rmdir(path)
    except OSError:
      pass  # gone, or not ours to remove


def pytest_unconfigure(config):  # pylint: disable=unused-argument
  if _OWN_CACHE:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
  if 'PYTEST_XDIST_WORKER' not in os.environ:
    _remove_tfds_scratch_dirs()


def own_compilation_cache(env, directory=None):
  """env for a CLI run that a test kills or starves of disk: a JAX compilation cache in
  `directory`, or none, instead of the run's."""
  env = {k: v for k, v in env.items() if k != _CACHE_DIR}
  return {**env, _CACHE_DIR: str(directory)} if directory else env


def built_once(tmp_path_factory, name, build):
  """The folder `name` after build(folder), made once per test run: pytest-xdist's workers
  share it (the first to ask builds it in the run's temporary root, under a lock the others
  wait on; a build that failed is started again from an empty folder). Tests only read it."""
  if not os.environ.get('PYTEST_XDIST_WORKER'):
    folder = tmp_path_factory.mktemp(name)
    build(folder)
    return folder
  root = tmp_path_factory.getbasetemp().parent  # the run's, not one worker's
  folder = root / name
  with open(root / f'{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (root / f'{name}.built').exists():
      shutil.rmtree(folder, ignore_errors=True)
      folder.mkdir()
      build(folder)
      (root / f'{name}.built').touch()
  return folder


@pytest.fixture(scope='session')
def wheel_venv(tmp_path_factory):
  """A fresh venv holding only the wheel built from this checkout (with its `test` extra),
  installed with the tested constraints: what a user gets from `pip install`. Built once
  for all of pytest-xdist's workers (~50 s of a 2-core machine)."""
  return built_once(tmp_path_factory, 'wheel', _build_wheel_venv) / 'venv'


@pytest.fixture(scope='module')
def idx_dir(request, tmp_path_factory):
  """Fashion-MNIST-like IDX files, as many train and test examples as the test module's
  IDX_SIZES says (example i is data_fixtures.id_image(i), label i % 10)."""
  from tests import data_fixtures  # pylint: disable=g-import-not-at-top
  num_train, num_test = request.module.IDX_SIZES
  return data_fixtures.write_idx(str(tmp_path_factory.mktemp('idx')), num_train, num_test)


def harmless_preload():
  """A real shared library that is safe to LD_PRELOAD: the C math library, loaded anyway."""
  name = ctypes.util.find_library('m')
  found = sorted(p for d in ('/lib', '/usr/lib', '/lib64', '/usr/lib64')
                 for p in glob.glob(f'{d}/{name}') + glob.glob(f'{d}/*/{name}'))
  if not found:
    pytest.skip(f'no path found for {name}')
  return found[0]


def installed_jemalloc():
  """The libjemalloc.so.2 that VIT_JAX_HOST_ALLOCATOR=jemalloc would preload, or None."""
  from vit_jax import host_allocator  # pylint: disable=g-import-not-at-top
  try:
    env = host_allocator.reexec_environment({host_allocator.CHOICE: 'jemalloc'})
  except ValueError:  # not installed
    return None
  return env and env[host_allocator.PRELOADED]


def user_env(venv, devices=1):
  """The environment of a user whose shell has `venv` activated (and nothing of ours:
  ipykernel, for one, leaves what is written to fd 2 out of a cell's output under pytest)."""
  env = {
      k: v for k, v in os.environ.items()
      if k not in ('PYTHONPATH', 'VIRTUAL_ENV', 'TF_CPP_MIN_LOG_LEVEL', 'PYTEST_CURRENT_TEST')
  }
  env['PATH'] = f'{venv}/bin:' + env.get('PATH', '')
  env['VIRTUAL_ENV'] = str(venv)
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  return env


# The first line of a `python -c` child that is to take Ctrl-C (and a closed terminal's
# SIGHUP) as a terminal's foreground job does. A job a non-interactive shell starts in the
# background (as CI may start the suite) ignores SIGINT, one under nohup SIGHUP, their
# children inherit that, and Python then leaves it ignored.
CTRL_C_AS_IN_A_TERMINAL = ('import signal; '
                           'signal.signal(signal.SIGINT, signal.default_int_handler); '
                           'signal.signal(signal.SIGHUP, signal.SIG_DFL)\n')


def with_flags(argv, extra):
  """argv with `extra` in place of the flags it gives again: the commands refuse a flag given
  twice (absl took the last one), so a test's flag must replace its base command's."""
  given = set()
  for i, arg in enumerate(extra):
    name, eq, _ = arg.lstrip('-').partition('=')
    takes_value = eq or (i + 1 < len(extra) and not extra[i + 1].startswith('-'))
    if arg.startswith('--') and takes_value and name not in ('set', 'sweep'):
      given.add(name)
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg.startswith('--') and arg[2:].partition('=')[0] in given:
      skip = '=' not in arg  # '--name value': the value goes too
    else:
      out.append(arg)
  return out + list(extra)


def console_script(name, cwd, *argv, timeout=300, **env_vars):
  """This venv's console script `name` (vit-sweep, vit-vtab, ...), run as a user runs it
  from `cwd`, with `env_vars` set in its environment."""
  script = os.path.join(os.path.dirname(sys.executable), name)
  return subprocess.run([script, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                        env=dict(os.environ, **env_vars))


# Every request of TensorFlow's GCS filesystem (libcurl) fails at once, network or none: a
# bucket that cannot be read, as without a network, credentials or a correct bucket name.
UNREACHABLE_GCS = dict(HTTPS_PROXY='http://127.0.0.1:1', HTTP_PROXY='http://127.0.0.1:1',
                       https_proxy='http://127.0.0.1:1', http_proxy='http://127.0.0.1:1',
                       NO_PROXY='', no_proxy='', GCS_RETRY_CONFIG_MAX_RETRIES='0')


def without_root_override():
  """A command prefix under which file permissions hold for this user: for root (CI), setpriv
  drops the capabilities that let root read and search any folder."""
  if os.geteuid() != 0:
    return []
  drop = '-dac_override,-dac_read_search'
  return ['setpriv', f'--inh-caps={drop}', f'--bounding-set={drop}']
