"""The C heap allocator of `vit-train` on a CPU host: jemalloc where it is installed, else
the C library's malloc.

XLA:CPU gives each run of a compiled step one buffer for all its temporaries (ViT-Ti/16 b32
f32: 1.5 GiB) and frees it when the step ends. glibc's malloc serves a request that large
with a fresh mmap and unmaps it on free, so every step faults its temporaries in again and
the kernel zeroes them: on a 2-core host ~430k page faults and 0.8 CPU s of kernel time per
ViT-Ti step, a sixth of the step's CPU (PyTorch's step there: under 60k faults, 0.1 s).
jemalloc with MALLOC_CONF below keeps freed pages, so the next step reuses them: steps ran
1.06-1.23x faster on two hosts, the quickstart 1.6x (benchmarks/allocator.py,
benchmarks/README.md, tenth and eleventh sessions). That holds peak RSS to glibc's only
because the loop waits for each step's temporaries to be freed before the next
(vit_jax/host_memory.py): without the wait 7 of 9 processes kept a second buffer
(R50+ViT-B/16 b8: 3.6 -> 5.7 GiB).

An allocator is chosen before a process starts (LD_PRELOAD), so the `vit-train` console
script re-executes itself once, before it starts JAX, with jemalloc preloaded. The choice,
VIT_JAX_HOST_ALLOCATOR: auto (the default: jemalloc where a libjemalloc.so.2 is installed
where distributions put it, else the C library's malloc), jemalloc (the same, an error where
none is found), system (the C library's malloc), or the path of a libjemalloc.so.2 (e.g.
conda's $CONDA_PREFIX/lib/libjemalloc.so.2). Never where a TPU/GPU plugin is installed
(their steps' memory is not the host's); `auto` also leaves an LD_PRELOAD that already names
a malloc (tcmalloc in Colab, jemalloc, mimalloc) alone. A MALLOC_CONF of the user's own is
kept. Debian/Ubuntu: apt-get install libjemalloc2. The run's log names the allocator
(`describe`).
"""
import glob
import os
import signal
import sys

from vit_jax import errors
from vit_jax import xla_cpu_flags

CHOICE = 'VIT_JAX_HOST_ALLOCATOR'  # auto (the default), jemalloc, system, or a library's path
# Freed pages are never returned to the OS on jemalloc's own. With a positive decay, jemalloc
# returns requests over 8 MiB (the step's temporaries) at once, as glibc does; with every
# size kept in the ordinary arenas (oversize_threshold:0), a decay of 1-3 s still faulted
# 60k-390k pages per ViT-Ti step.
MALLOC_CONF = 'dirty_decay_ms:-1,muzzy_decay_ms:-1'
LIBRARY_GLOBS = ('/usr/lib/*-linux-gnu/libjemalloc.so.2', '/usr/lib64/libjemalloc.so.2',
                 '/usr/lib/libjemalloc.so.2', '/usr/local/lib/libjemalloc.so.2')
# Set in the re-executed process, so that a library the loader refused cannot cause a loop.
PRELOADED = 'VIT_JAX_HOST_ALLOCATOR_PRELOADED'


def _installed():
  """The first libjemalloc.so.2 where distributions install it, or None."""
  for pattern in LIBRARY_GLOBS:
    found = sorted(glob.glob(pattern))
    if found:
      return found[0]
  return None


def preloaded_malloc(environ):
  """The file name of the malloc LD_PRELOAD (':' or ' ' separated) names, e.g.
  libjemalloc.so.2, libtcmalloc.so.4, libmimalloc.so; '' where it names none."""
  for entry in environ.get('LD_PRELOAD', '').replace(' ', ':').split(':'):
    if 'malloc' in os.path.basename(entry):
      return os.path.basename(entry)
  return ''


def _library(environ):
  """The library to preload under `environ`'s choice, or None for the C library's malloc."""
  mode = environ.get(CHOICE, 'auto') or 'auto'
  if mode == 'system':
    return None
  if mode == 'auto':
    if preloaded_malloc(environ):
      return None  # an allocator of the user's own (Colab preloads tcmalloc)
    return _installed()
  if mode == 'jemalloc':
    found = _installed()
    if found:
      return found
    raise ValueError(f'{CHOICE}=jemalloc: no libjemalloc.so.2 found; install it (Debian/Ubuntu: '
                     f'apt-get install libjemalloc2) or set {CHOICE} to its path')
  if not os.path.isfile(mode):
    raise ValueError(f'{CHOICE}={mode}: no such file; set it to auto, jemalloc, system, or the '
                     f'path of a libjemalloc.so.2')
  return os.path.abspath(mode)


def reexec_environment(environ):
  """The environment to re-execute `vit-train` with, or None to go on as it is.

  ValueError for a VIT_JAX_HOST_ALLOCATOR that is not a mode or a file, or jemalloc not found.
  """
  library = _library(environ)
  if (library is None or environ.get(PRELOADED) or 'jemalloc' in environ.get('LD_PRELOAD', '')
      or xla_cpu_flags.accelerator_plugin_installed()):
    return None
  env = dict(environ)
  env['LD_PRELOAD'] = ':'.join(p for p in (library, environ.get('LD_PRELOAD', '')) if p)
  env.setdefault('MALLOC_CONF', MALLOC_CONF)
  env[PRELOADED] = library
  return env


def reexec_with_jemalloc():
  """Replaces this process by the same command with jemalloc preloaded where it was chosen
  (see the module doc); returns only where it was not, or where the exec failed."""
  env = reexec_environment(os.environ)
  if env is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  # A signal Python takes while execve runs is lost (its handler never runs): blocked, one
  # stays pending across the exec, for the new process to unblock (vit_jax.main.run).
  stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
  blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
  try:
    os.execve(sys.executable, sys.orig_argv, env)
  except OSError as e:
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    print(
        f'{errors.PROGRAM}: cannot re-execute with {env[PRELOADED]} preloaded ({e.strerror}); '
        "going on with the C library's malloc", file=sys.stderr)


def without_preload(environ):
  """`environ` less what `reexec_environment` added to it: for a child process that should
  run on the C library's malloc (a benchmark's PyTorch worker)."""
  library = environ.get(PRELOADED)
  if not library:
    return dict(environ)
  env = {k: v for k, v in environ.items() if k != PRELOADED}
  kept = ':'.join(p for p in environ.get('LD_PRELOAD', '').split(':') if p and p != library)
  env.pop('LD_PRELOAD', None)
  if kept:
    env['LD_PRELOAD'] = kept
  if env.get('MALLOC_CONF') == MALLOC_CONF:
    del env['MALLOC_CONF']
  return env


def _mapped(path):
  try:
    with open('/proc/self/maps') as f:
      real = os.path.realpath(path)
      return any(line.rstrip().endswith((path, real)) for line in f)
  except OSError:
    return False


def describe(environ=None):
  """One line for the run's log: this process's allocator, and how to choose another."""
  environ = os.environ if environ is None else environ
  library = environ.get(PRELOADED)
  if library and _mapped(library):
    return (f'host allocator: {library}, preloaded at start-up (MALLOC_CONF='
            f'{environ.get("MALLOC_CONF", "")}); {CHOICE}=system for the C library\'s malloc')
  if preloaded_malloc(environ):
    return f'host allocator: as LD_PRELOAD says ({environ["LD_PRELOAD"]})'
  if library:
    return f"host allocator: the C library's malloc (the loader refused {library})"
  if xla_cpu_flags.accelerator_plugin_installed():
    return "host allocator: the C library's malloc (a TPU/GPU plugin is installed)"
  if (environ.get(CHOICE) or 'auto') == 'auto':
    installed = _installed()
    if installed:  # a process that is not vit-train (python -c, a benchmark without --allocator)
      return (f"host allocator: the C library's malloc ({installed} is installed, but this "
              'process was not started under it, as vit-train starts)')
    return ("host allocator: the C library's malloc (no libjemalloc.so.2 installed; with it "
            'each CPU step reuses its memory instead of faulting it in again, which is faster: '
            'apt-get install libjemalloc2)')
  return "host allocator: the C library's malloc"
