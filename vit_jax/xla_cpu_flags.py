"""XLA:CPU flags that make vit_jax train faster on CPU hosts, per compute dtype; set before
JAX starts.

jaxlib 0.10 sends matmuls to YNNPACK fusions by default. What we measured (side by side,
benchmarks/README.md; `benchmarks/ynnpack.py` measures the train step on a host):
- bfloat16: the models' bf16 x bf16 -> f32 dots (models/precision.py) are fast only in
  YNNPACK (~2x the f32 matmul rate); with the fusions off the step ran at 0.2-0.7x. So a
  bf16 run keeps them, on every host.
- float32: the YNNPACK-off flag ran the train step 1.09-1.14x faster on one 2-core AVX-512
  host (A) and 0.88-0.92x on another of the same kind (B). No fixed choice is right on
  both, so by default it is measured once per host: `probe()` times the fwd+bwd of a
  ViT-B-shaped encoder block with YNNPACK on and off (two child processes, interleaved
  rounds; 9-10 s on a quiet 2-core host, once) and the verdict is cached per (CPU, cores,
  jaxlib, preloaded malloc) in ~/.cache/vit_jax/xla_cpu_flags.json. A probe that fails or
  cannot tell the two apart (within MARGIN) keeps the fixed table below; on a busy host
  (load above BUSY_LOAD per core) no probe runs and nothing is cached: the fixed table,
  this time.
Every dtype also gets XLA:CPU's memory-optimised scheduler (MEMORY_SCHEDULER, not probed).
The flags only choose CPU kernels and their order: numerics stay those of the dtype (tests
compare both ways), and TPU/GPU programs are not affected (with an accelerator plugin
installed no probe runs).

VIT_JAX_XLA_CPU_FLAGS chooses: `auto` (default: the table, float32 measured per host),
`1` (the fixed table, no probe; the test suite runs so, and a pytest process exports it to
its children), `0` (add nothing: XLA's defaults). A value of the user's own in XLA_FLAGS
always wins. `apply(dtype=...)` adds the flags to XLA_FLAGS and logs what it chose and
why; XLA reads XLA_FLAGS once, when the first backend starts, so call it before the first
computation. The flag names exist in the jaxlib versions in KNOWN_JAXLIB; with another
jaxlib nothing is added, because XLA aborts on a flag it does not know.
"""
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

from absl import logging

from vit_jax import cpu_features
from vit_jax import paths

YNNPACK_OFF = '--xla_cpu_experimental_ynn_fusion_type='
# Not probed, every dtype: the train step's planned temporaries are smaller under it than
# under XLA:CPU's default (concurrency-optimised) schedule, at the same speed on the host it
# was chosen on (benchmarks/README.md, sixth session); on others the default ran up to ~1.1x
# faster for ~30% more peak memory (sixtieth and sixty-second sessions), a trade the user
# makes with XLA_FLAGS (README). A remat'd step overrides it (models/remat.py).
MEMORY_SCHEDULER = '--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED'
EVERY_DTYPE = (MEMORY_SCHEDULER,)
# The fixed table: what a run gets with VIT_JAX_XLA_CPU_FLAGS=1, or when the probe fails.
FLAGS_BY_DTYPE = {'float32': (YNNPACK_OFF, *EVERY_DTYPE), 'bfloat16': EVERY_DTYPE}
FLAGS = FLAGS_BY_DTYPE['float32']  # every flag that may be added
PROBED_DTYPES = ('float32',)  # dtypes whose choice depends on the host
# jaxlib major.minor versions in which the flags above exist (checked by the tests).
KNOWN_JAXLIB = ('0.10',)
OPT_OUT = 'VIT_JAX_XLA_CPU_FLAGS'
MODES = {
    'auto': 'measure float32 once per host',
    '1': 'the fixed table, no probe',
    '0': "add nothing: XLA's defaults"
}
MARGIN = 0.03  # a probe ratio within 1 +- MARGIN is a tie: the fixed table stays
# Timings taken beside other work are not evidence: above this load per core, no probe.
BUSY_LOAD = 0.5
last_choice = ''  # apply()'s log line: what it chose for this process, and why
# The flags apply() chose for this process, each with XLA_FLAGS's value where it names it.
last_flags = ()
_ACCELERATOR_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_rocm60_plugin',
                        'jax_rocm7_plugin', 'libtpu')


def accelerator_plugin_installed():
  """Whether a TPU or GPU plugin for jaxlib is installed (then JAX will not run on the CPU)."""
  return any(importlib.util.find_spec(p) for p in _ACCELERATOR_PLUGINS)


def _jaxlib_version():
  try:
    from jaxlib import version  # pylint: disable=import-outside-toplevel
  except ImportError:
    return ''
  return version.__version__


def _backend_started():
  xla_bridge = sys.modules.get('jax._src.xla_bridge')
  return bool(xla_bridge is not None and getattr(xla_bridge, '_backends', None))


def _flag_name(flag):
  """'--name' of an XLA flag '--name=value'."""
  return flag.partition('=')[0]


def _known(jaxlib_version):
  return '.'.join(jaxlib_version.split('.')[:2]) in KNOWN_JAXLIB


def ynnpack_fusions_on(environ=None):
  """Whether XLA:CPU runs YNNPACK fusions under `environ`'s (os.environ's) XLA_FLAGS: the
  last YNNPACK_OFF flag there decides, else the jaxlib default (on in KNOWN_JAXLIB)."""
  environ = os.environ if environ is None else environ
  name = _flag_name(YNNPACK_OFF)
  values = [
      f.partition('=')[2] for f in environ.get('XLA_FLAGS', '').split() if _flag_name(f) == name
  ]
  return bool(values[-1]) if values else _known(_jaxlib_version())


def _mode(environ):
  mode = environ.get(OPT_OUT, 'auto') or 'auto'
  if mode not in MODES:
    raise ValueError(f'{OPT_OUT}={mode}: use ' + ', '.join(f'{k} ({v})' for k, v in MODES.items()))
  return mode


def flags_to_add(xla_flags, jaxlib_version, opt_out=None, dtype='float32', wanted=None):
  """The flags for `dtype` (`wanted`, else the fixed table) that `apply` would add to an
  XLA_FLAGS value of `xla_flags`: none that XLA_FLAGS already names."""
  if opt_out == '0' or not _known(jaxlib_version):
    return []
  present = {_flag_name(f) for f in xla_flags.split()}
  wanted = FLAGS_BY_DTYPE.get(dtype, ()) if wanted is None else wanted
  return [f for f in wanted if _flag_name(f) not in present]


def choose(environ=None, dtype='float32', cache_path=None):
  """(flags, why) for `dtype` on this host under `environ`'s VIT_JAX_XLA_CPU_FLAGS; may
  run the probe (auto mode, float32, CPU only, not under pytest, no cached verdict)."""
  environ = os.environ if environ is None else environ
  mode = _mode(environ)
  fixed = tuple(FLAGS_BY_DTYPE.get(dtype, ()))
  if mode == '0':
    return (), f'{OPT_OUT}=0'
  if mode == '1' or dtype not in PROBED_DTYPES:
    return fixed, f'the fixed table for {dtype}' + (f' ({OPT_OUT}=1)' if mode == '1' else '')
  if _flag_name(YNNPACK_OFF) in environ.get('XLA_FLAGS', ''):
    return fixed, "XLA_FLAGS decides (no probe)"
  if 'pytest' in sys.modules:
    return fixed, f'the fixed table for {dtype} (under pytest, which pins {OPT_OUT}=1)'
  if accelerator_plugin_installed():
    return fixed, f'the fixed table for {dtype} (an accelerator plugin is installed)'
  key = host_key()
  cache_path = cache_path or default_cache_path()
  cached = _read_cache(cache_path).get(key) if cache_path else None
  if cached is None:
    load, n_cores = os.getloadavg()[0], cores()
    if load > BUSY_LOAD * n_cores:
      return fixed, (f'the fixed table for {dtype}: the host is busy (load {load:.1f} on '
                     f'{n_cores} cores), so the probe waits for a quieter start')
    logging.info('XLA:CPU: timing YNNPACK fusions on and off for float32 (once per host, '
                 '~10 s)')
    cached = probe()
    unwritten = _write_cache(cache_path, key, cached) if cache_path else "'~' names no home"
    where = (f'probed now, not cached ({unwritten}): the next run probes again'
             if unwritten else f'probed now, cached in {cache_path}')
  else:
    where = f'probe of {cached.get("date", "?")} cached in {cache_path}; delete it to re-probe'
  ratios = ', '.join(f'{r:.2f}' for r in cached.get('off_over_on', ()))
  if cached.get('flags') is None:
    return fixed, f'the fixed table for {dtype}: {cached.get("error", "no verdict")} ({where})'
  return tuple(cached['flags']) + EVERY_DTYPE, (f'{cached["verdict"]} for {dtype}: YNNPACK '
                                                f'off/on speed per round {ratios} ({where})')


def pending(environ=None, dtype='float32'):
  """The flags `apply` would add now (none once a JAX backend has started)."""
  environ = os.environ if environ is None else environ
  if environ is os.environ and _backend_started():
    return []
  wanted, _ = choose(environ, dtype) if _known(_jaxlib_version()) else ((), '')
  return flags_to_add(environ.get('XLA_FLAGS', ''), _jaxlib_version(), environ.get(OPT_OUT), dtype,
                      wanted)


def apply(environ=None, dtype='float32', recorded=None, log=True):
  """Adds `dtype`'s CPU flags to XLA_FLAGS in `environ` (os.environ), returns what it
  added, and keeps the choice and its reason in `last_choice` (logged too, unless `log`
  is False: vit-train logs it once its log file is open).

  `recorded`: the flags a run being resumed started with (vit_jax/rundir.py); in auto mode
  they are kept, so that the resumed steps run the same kernels (bit-identical resume).
  Does nothing once a JAX backend has started (XLA would ignore the change).
  """
  global last_choice, last_flags  # pylint: disable=global-statement
  environ = os.environ if environ is None else environ
  if environ is os.environ and _backend_started():
    return []
  if environ is os.environ and 'pytest' in sys.modules:
    environ.setdefault(OPT_OUT, '1')  # the suite's child processes pin the table too
  version = _jaxlib_version()
  if not _known(version):
    last_choice = f'XLA:CPU flags: none added (jaxlib {version} is not one they were checked for)'
    if log:
      logging.info('%s', last_choice)
    return []
  if recorded is not None and _mode(environ) == 'auto':
    wanted, why = tuple(recorded), 'those the run in this workdir started with'
  else:
    wanted, why = choose(environ, dtype)
  # What the process runs under: where XLA_FLAGS names one of the flags, its value there
  # (the user's) wins, and that is what a resumed run must run again.
  named = {_flag_name(f): f for f in environ.get('XLA_FLAGS', '').split()}
  last_flags = tuple(named.get(_flag_name(f), f) for f in wanted)
  added = flags_to_add(environ.get('XLA_FLAGS', ''), version, environ.get(OPT_OUT), dtype, wanted)
  if added:
    environ['XLA_FLAGS'] = ' '.join([environ.get('XLA_FLAGS', ''), *added]).strip()
  kept = [_flag_name(f) for f in wanted if f not in added]  # XLA_FLAGS names them already
  last_choice = (f'XLA:CPU flags for {dtype}: {" ".join(added) or "none added"}; {why}' +
                 (f'; XLA_FLAGS already sets {" ".join(kept)}' if kept else ''))
  if log:
    logging.info('%s', last_choice)
  return added


# ------------------------------------------------------------------------------ the probe
def host_key():
  """What the verdict depends on: the CPU (name, family/model/stepping), the cores this
  process may use, the jaxlib version, and the C heap allocator the probe inherits (its
  verdict moved with it: under jemalloc YNNPACK off/on was 0.87-0.95 in 2 of 2 probes,
  under glibc's malloc 0.93-0.96 and then a tie; benchmarks/README.md, tenth session)."""
  # Imported here: host_allocator imports this module.
  from vit_jax import host_allocator  # pylint: disable=import-outside-toplevel
  malloc = host_allocator.preloaded_malloc(os.environ) or 'libc malloc'
  return f'{cpu_features.model()} | {cores()} cores | jaxlib {_jaxlib_version()} | {malloc}'


def cores():
  """The CPU cores this process may use."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count()


def default_cache_path():
  """xla_cpu_flags.json in paths.vit_jax_cache(), None where there is no such folder."""
  cache = paths.vit_jax_cache()
  return os.path.join(cache, 'xla_cpu_flags.json') if cache else None


def _read_cache(path):
  try:
    with open(path) as f:
      cache = json.load(f)
  except (OSError, ValueError):
    return {}
  return cache if isinstance(cache, dict) else {}


def _write_cache(path, key, entry):
  """Adds `entry` under `key` to the cache file `path`; None, or why it could not."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    cache = {**_read_cache(path), key: entry}
    tmp = f'{path}.{os.getpid()}.tmp'
    with open(tmp, 'w') as f:
      json.dump(cache, f, indent=1)
    os.replace(tmp, path)  # atomic: two runs probing at once leave one whole file
  except OSError as e:
    return str(e)
  return None


# One pre-norm encoder block at ViT-B/16 width (tokens of 2 images at 224), fwd + bwd, as
# plain jax: its dots are the shapes (and transposes) a ViT train step runs. It prints
# 'ready' once compiled, then for each line on stdin (a number n) the seconds of n steps.
_KERNEL = r'''
import sys, time
import jax, jax.numpy as jnp
B, T, D, H, M = 2, 197, 768, 12, 3072
def norm(x):
  mean = x.mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
def block(p, x):
  q, k, v = jnp.split((norm(x) @ p['qkv']).reshape(B, T, 3 * H, D // H), 3, axis=2)
  w = jax.nn.softmax(jnp.einsum('bqhd,bkhd->bhqk', q, k) / (D // H) ** 0.5, axis=-1)
  x = x + jnp.einsum('bhqk,bkhd->bqhd', w, v).reshape(B, T, D) @ p['out']
  return x + jax.nn.gelu(norm(x) @ p['mlp_in']) @ p['mlp_out']
shapes = {'qkv': (D, 3 * D), 'out': (D, D), 'mlp_in': (D, M), 'mlp_out': (M, D)}
keys = jax.random.split(jax.random.PRNGKey(0), len(shapes) + 1)
params = {n: 0.02 * jax.random.normal(k, s) for (n, s), k in zip(shapes.items(), keys)}
x = jax.random.normal(keys[-1], (B, T, D))
step = jax.jit(jax.grad(lambda p, x: jnp.mean(block(p, x) ** 2), argnums=(0, 1)))
jax.block_until_ready(step(params, x))
print('ready', flush=True)
for line in sys.stdin:
  times = []
  for _ in range(int(line)):
    t = time.perf_counter()
    jax.block_until_ready(step(params, x))
    times.append(time.perf_counter() - t)
  print(' '.join(map(str, times)), flush=True)
'''


def probe(rounds=4, steps=2, timeout=60.0):
  """Times _KERNEL with YNNPACK on (XLA's default) and off in two child processes,
  interleaved (the order alternates per round); returns the cache entry: the verdict,
  its flags (None when the probe failed or tied), and per round the speed ratio off/on of
  the fastest step of each side (the fastest step is the one least disturbed by other
  processes on a shared host)."""
  base = [
      f for f in os.environ.get('XLA_FLAGS', '').split()
      if _flag_name(f) not in ('--xla_force_host_platform_device_count', _flag_name(YNNPACK_OFF))
  ]
  sides = {'on': base, 'off': base + [YNNPACK_OFF]}
  entry = {'date': datetime.date.today().isoformat(), 'flags': None}
  procs = {}
  start = time.perf_counter()
  try:
    for side, flags in sides.items():
      env = {**os.environ, 'XLA_FLAGS': ' '.join(flags), 'JAX_PLATFORMS': 'cpu'}
      procs[side] = subprocess.Popen([sys.executable, '-c', _KERNEL], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
    for side, proc in procs.items():  # both compile at once
      if proc.stdout.readline().strip() != 'ready':
        raise RuntimeError(f'the YNNPACK-{side} kernel did not start')
    entry['startup_s'] = time.perf_counter() - start
    fastest = {'on': [], 'off': []}
    for r in range(rounds):
      for side in (('on', 'off') if r % 2 == 0 else ('off', 'on')):
        if time.perf_counter() - start > timeout:
          raise TimeoutError(f'over {timeout:.0f} s')
        procs[side].stdin.write(f'{steps}\n')
        procs[side].stdin.flush()
        fastest[side].append(min(float(t) for t in procs[side].stdout.readline().split()))
  except (OSError, ValueError, RuntimeError, TimeoutError) as e:
    entry['error'] = f'probe failed ({type(e).__name__}: {e})'
    return entry
  finally:
    for proc in procs.values():
      proc.kill()
      proc.wait()
  ratios = [on / off for on, off in zip(fastest['on'], fastest['off'])]
  entry.update(off_over_on=ratios, step_s=fastest, probe_s=time.perf_counter() - start)
  return {**entry, **verdict(ratios)}


def verdict(off_over_on):
  """The probe's verdict on per-round speed ratios YNNPACK off / on: their median decides,
  unless it is within MARGIN of 1 (no flags then: the fixed table stays)."""
  median = statistics.median(off_over_on)
  if median >= 1 + MARGIN:
    return {'verdict': 'YNNPACK off', 'flags': [YNNPACK_OFF]}
  if median <= 1 - MARGIN:
    return {'verdict': "YNNPACK on (XLA's default)", 'flags': []}
  return {
      'flags': None,
      'error': f'a tie (YNNPACK off/on median {median:.2f}, within {MARGIN:.0%})'
  }
