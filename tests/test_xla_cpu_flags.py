"""vit_jax's XLA:CPU flags: added only when safe, accepted by this jaxlib, numerics unchanged."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from vit_jax import xla_cpu_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG = xla_cpu_flags.FLAGS[0]
NAME = FLAG.split('=')[0]


def test_flags_added_to_empty_or_unrelated_xla_flags():
  assert xla_cpu_flags.flags_to_add('', '0.10.2') == list(xla_cpu_flags.FLAGS)
  env = {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  assert xla_cpu_flags.apply(env) == list(xla_cpu_flags.FLAGS)
  assert env['XLA_FLAGS'].split() == [
      '--xla_force_host_platform_device_count=8', *xla_cpu_flags.FLAGS
  ]
  assert xla_cpu_flags.apply(env) == []  # idempotent
  assert env['XLA_FLAGS'].count(NAME) == 1


def test_user_value_opt_out_and_unknown_jaxlib_win():
  user = f'{NAME}=LIBRARY_FUSION_TYPE_DOT'
  memory = xla_cpu_flags.MEMORY_SCHEDULER  # a flag the user did not set is still added
  assert xla_cpu_flags.flags_to_add(user, '0.10.2') == [memory]
  env = {'XLA_FLAGS': user}
  assert xla_cpu_flags.apply(env) == [memory] and env['XLA_FLAGS'] == f'{user} {memory}'
  env = {xla_cpu_flags.OPT_OUT: '0'}
  assert xla_cpu_flags.apply(env) == [] and 'XLA_FLAGS' not in env
  # A jaxlib the flags were not checked against gets nothing: XLA aborts on unknown flags.
  assert xla_cpu_flags.flags_to_add('', '0.11.0') == []
  assert xla_cpu_flags.flags_to_add('', '') == []


def test_flags_are_chosen_per_dtype():
  # bf16 dots are fast only in YNNPACK fusions: a bf16 run must keep them on.
  memory = xla_cpu_flags.MEMORY_SCHEDULER  # every dtype
  assert xla_cpu_flags.flags_to_add('', '0.10.2',
                                    dtype='float32') == [xla_cpu_flags.YNNPACK_OFF, memory]
  assert xla_cpu_flags.flags_to_add('', '0.10.2', dtype='bfloat16') == [memory]
  env = {}
  assert xla_cpu_flags.apply(env, dtype='bfloat16') == [memory] and env['XLA_FLAGS'] == memory


def test_ynnpack_fusions_on_reads_the_last_flag():
  # The models' float32 backward order follows it (models/remat.py).
  off = xla_cpu_flags.YNNPACK_OFF
  on = lambda flags: xla_cpu_flags.ynnpack_fusions_on({'XLA_FLAGS': flags})
  assert on('') and on('--xla_force_host_platform_device_count=8')
  assert not on(off) and not on(f'--a=1 {off}')
  assert on(f'{off} {off}dot') and not on(f'{off}dot {off}')
  env = {}
  xla_cpu_flags.apply(env, dtype='float32')  # the suite pins the fixed table: off
  assert not xla_cpu_flags.ynnpack_fusions_on(env)
  env = {}
  xla_cpu_flags.apply(env, dtype='bfloat16')
  assert xla_cpu_flags.ynnpack_fusions_on(env)


def test_installed_jaxlib_is_one_the_flags_are_known_for():
  from jaxlib import version  # pylint: disable=import-outside-toplevel
  assert '.'.join(version.__version__.split('.')[:2]) in xla_cpu_flags.KNOWN_JAXLIB


def test_apply_is_a_no_op_once_the_backend_started(monkeypatch):
  import jax  # pylint: disable=import-outside-toplevel
  jax.devices()  # the suite's backend is running
  # Without the flag in XLA_FLAGS, apply() would add it (first test) but XLA would ignore it.
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  monkeypatch.delenv(xla_cpu_flags.OPT_OUT, raising=False)
  assert xla_cpu_flags.apply() == []
  assert os.environ['XLA_FLAGS'] == '--xla_force_host_platform_device_count=8'


def test_modes_and_a_bad_value():
  fixed = xla_cpu_flags.FLAGS_BY_DTYPE['float32']
  assert xla_cpu_flags.choose({xla_cpu_flags.OPT_OUT: '0'})[0] == ()
  assert xla_cpu_flags.choose({xla_cpu_flags.OPT_OUT: '1'})[0] == fixed
  assert xla_cpu_flags.choose({xla_cpu_flags.OPT_OUT: '1'},
                              'bfloat16')[0] == (xla_cpu_flags.MEMORY_SCHEDULER,)
  with pytest.raises(ValueError, match='VIT_JAX_XLA_CPU_FLAGS=yes: use auto'):
    xla_cpu_flags.choose({xla_cpu_flags.OPT_OUT: 'yes'})
  # The log line says what was chosen and why (vit-train logs it once, into train.INFO).
  memory = xla_cpu_flags.MEMORY_SCHEDULER
  xla_cpu_flags.apply({xla_cpu_flags.OPT_OUT: '1', 'XLA_FLAGS': f'{NAME}=X'})
  assert xla_cpu_flags.last_choice == (f'XLA:CPU flags for float32: {memory}; the fixed table '
                                       f'for float32 (VIT_JAX_XLA_CPU_FLAGS=1); XLA_FLAGS '
                                       f'already sets {NAME}')


def test_a_resumed_run_keeps_the_flags_it_started_with(monkeypatch):
  """auto mode takes the workdir's record (vit_jax/rundir.py) instead of choosing again, so
  a run started with one verdict and resumed after another runs the same kernels."""
  monkeypatch.setattr(xla_cpu_flags, 'probe', _no_probe)
  fixed = xla_cpu_flags.FLAGS_BY_DTYPE['float32']
  assert fixed  # else this test shows nothing
  env = {xla_cpu_flags.OPT_OUT: 'auto'}
  assert xla_cpu_flags.apply(env, recorded=()) == []
  assert 'started with' in xla_cpu_flags.last_choice and xla_cpu_flags.last_flags == ()
  env = {xla_cpu_flags.OPT_OUT: 'auto'}
  assert xla_cpu_flags.apply(env, recorded=fixed) == list(fixed)
  assert xla_cpu_flags.last_flags == fixed
  env = {xla_cpu_flags.OPT_OUT: '1'}  # an explicit choice wins over the record
  assert xla_cpu_flags.apply(env, recorded=()) == list(fixed)


def test_a_scheduler_of_the_users_own_is_recorded_and_resumed():
  """A run started with the user's scheduler in XLA_FLAGS records that value, not the one
  vit_jax would have added, so that resuming it without XLA_FLAGS runs the same schedule."""
  mine = '--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED'
  assert mine != xla_cpu_flags.MEMORY_SCHEDULER  # else this test shows nothing
  env = {xla_cpu_flags.OPT_OUT: '1', 'XLA_FLAGS': mine}
  xla_cpu_flags.apply(env)
  assert mine in xla_cpu_flags.last_flags
  assert xla_cpu_flags.MEMORY_SCHEDULER not in xla_cpu_flags.last_flags
  resumed = {xla_cpu_flags.OPT_OUT: 'auto'}
  assert mine in xla_cpu_flags.apply(resumed, recorded=xla_cpu_flags.last_flags)
  assert resumed['XLA_FLAGS'].split().count(mine) == 1
  assert xla_cpu_flags.MEMORY_SCHEDULER not in resumed['XLA_FLAGS']


def test_no_probe_under_pytest_and_its_children_are_pinned(monkeypatch):
  monkeypatch.setattr(xla_cpu_flags, 'probe', _no_probe)
  flags, why = xla_cpu_flags.choose({})  # auto, float32
  assert flags == xla_cpu_flags.FLAGS_BY_DTYPE['float32'] and 'pytest' in why
  code = ('import os, pytest; from vit_jax import xla_cpu_flags as x; x.apply(); '
          f'print(os.environ[{xla_cpu_flags.OPT_OUT!r}], os.environ["XLA_FLAGS"])')
  env = {k: v for k, v in os.environ.items() if k not in (xla_cpu_flags.OPT_OUT, 'XLA_FLAGS')}
  out = subprocess.run([sys.executable, '-c', code], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=120, check=True).stdout.split()
  assert out == ['1', *xla_cpu_flags.FLAGS]


def _no_probe(**_):
  raise AssertionError('the probe ran')


@pytest.fixture
def outside_pytest(monkeypatch, tmp_path):
  """choose() as a CLI run sees it (auto mode, a quiet host), with its cache in tmp_path."""
  monkeypatch.delitem(sys.modules, 'pytest')
  monkeypatch.setattr(os, 'getloadavg', lambda: (0.0, 0.0, 0.0))
  return str(tmp_path / 'cache' / 'xla_cpu_flags.json')


def test_auto_probes_once_per_host_and_caches_the_verdict(monkeypatch, outside_pytest):
  calls = []

  def probe(**_):
    calls.append(1)
    ratios = [0.9, 0.8, 0.85]
    return {'date': 'd', 'off_over_on': ratios, **xla_cpu_flags.verdict(ratios)}

  monkeypatch.setattr(xla_cpu_flags, 'probe', probe)
  every = xla_cpu_flags.EVERY_DTYPE  # not probed
  flags, why = xla_cpu_flags.choose({}, cache_path=outside_pytest)
  assert flags == every and 'probed now' in why and '0.90, 0.80, 0.85' in why
  flags, why = xla_cpu_flags.choose({}, cache_path=outside_pytest)  # from the cache
  assert flags == every and 'delete it to re-probe' in why and calls == [1]
  with open(outside_pytest) as f:
    assert list(json.load(f)) == [xla_cpu_flags.host_key()]
  # A user's own value for the flag in XLA_FLAGS wins: nothing to probe for.
  flags, why = xla_cpu_flags.choose({'XLA_FLAGS': f'{NAME}=X'}, cache_path=outside_pytest + '2')
  assert 'no probe' in why and not os.path.exists(outside_pytest + '2')
  # Another host (or jaxlib) sharing the cache file probes for itself.
  monkeypatch.setattr(xla_cpu_flags, 'host_key', lambda: 'another cpu | 2 cores | jaxlib 0.10.2')
  xla_cpu_flags.choose({}, cache_path=outside_pytest)
  assert calls == [1, 1]
  assert xla_cpu_flags.choose({}, 'bfloat16', cache_path=outside_pytest)[0] == every


@pytest.mark.parametrize('where', ['a file in the way', 'no home'])
def test_a_verdict_that_cannot_be_cached_is_said_once(monkeypatch, outside_pytest, tmp_path, where):
  """A cache folder the user cannot write had been warned about, and then the choice's line
  said `probed now, cached in` it; with no home ('~' unexpanded: HOME unset, no passwd
  entry), the cache went to a folder named '~' in the current one."""
  ratios = [0.9, 0.8, 0.85]
  monkeypatch.setattr(
      xla_cpu_flags, 'probe', lambda **_: {
          'date': 'd',
          'off_over_on': ratios,
          **xla_cpu_flags.verdict(ratios)
      })
  if where == 'no home':
    monkeypatch.delenv('XDG_CACHE_HOME', raising=False)
    monkeypatch.setattr(os.path, 'expanduser', lambda path: path)
    monkeypatch.chdir(tmp_path)
    cache_path, why = None, "'~' names no home"
  else:
    (tmp_path / 'file').write_text('')
    cache_path, why = str(tmp_path / 'file' / 'vit_jax' / 'xla_cpu_flags.json'), 'Not a directory'
  flags, said = xla_cpu_flags.choose({}, cache_path=cache_path)
  assert flags == xla_cpu_flags.EVERY_DTYPE
  assert re.search(r'\(probed now, not cached \(.*' + why + r'.*\): the next run probes again\)$',
                   said), said
  assert not os.path.exists(tmp_path / '~')


def test_the_verdict_is_kept_per_host_allocator(monkeypatch):
  # The probe's child inherits LD_PRELOAD, and its verdict moved with the allocator: a
  # verdict cached under glibc's malloc is not reused under jemalloc, nor the reverse.
  monkeypatch.delenv('LD_PRELOAD', raising=False)
  glibc = xla_cpu_flags.host_key()
  monkeypatch.setenv('LD_PRELOAD', '/usr/lib/x86_64-linux-gnu/libjemalloc.so.2')
  jemalloc = xla_cpu_flags.host_key()
  monkeypatch.setenv('LD_PRELOAD', '/opt/a.so /usr/lib/libtcmalloc.so.4')  # Colab's form
  tcmalloc = xla_cpu_flags.host_key()
  monkeypatch.setenv('LD_PRELOAD', '/opt/a.so')  # not a malloc
  other = xla_cpu_flags.host_key()
  assert glibc.endswith('| libc malloc') and other == glibc
  assert jemalloc.endswith('| libjemalloc.so.2') and tcmalloc.endswith('| libtcmalloc.so.4')
  assert jemalloc.rsplit('|', 1)[0] == glibc.rsplit('|', 1)[0]  # the same host otherwise


def test_a_failed_or_tied_probe_keeps_the_fixed_table(monkeypatch, outside_pytest):
  # A probe whose kernel cannot start (here: a flag XLA does not know) fails cleanly.
  monkeypatch.setenv('XLA_FLAGS', '--xla_no_such_flag=1')
  failed = xla_cpu_flags.probe(rounds=1, steps=1)
  assert failed['flags'] is None and 'did not start' in failed['error']
  tie = {'date': 'd', 'off_over_on': [1.01], **xla_cpu_flags.verdict([1.01])}
  for entry, reason in ((failed, 'probe failed'), (tie, 'a tie')):
    monkeypatch.setattr(xla_cpu_flags, 'probe', lambda entry=entry, **_: entry)
    monkeypatch.setattr(xla_cpu_flags, 'host_key', lambda reason=reason: reason)
    flags, why = xla_cpu_flags.choose({}, cache_path=outside_pytest)
    assert flags == xla_cpu_flags.FLAGS_BY_DTYPE['float32'] and reason in why


def test_busy_host_gets_the_fixed_table_and_no_probe(monkeypatch, outside_pytest):
  monkeypatch.setattr(xla_cpu_flags, 'probe', _no_probe)
  monkeypatch.setattr(os, 'getloadavg', lambda: (64.0, 64.0, 64.0))
  flags, why = xla_cpu_flags.choose({}, cache_path=outside_pytest)
  assert flags == xla_cpu_flags.FLAGS_BY_DTYPE['float32'] and 'busy' in why
  assert not os.path.exists(outside_pytest)  # the next quiet start probes


def test_verdict_needs_a_margin():
  assert xla_cpu_flags.verdict([1.10, 1.20, 0.95])['flags'] == [xla_cpu_flags.YNNPACK_OFF]
  assert xla_cpu_flags.verdict([0.88, 0.92, 1.05])['flags'] == []
  assert xla_cpu_flags.verdict([1.02, 0.99, 1.01])['flags'] is None


def test_the_probe_runs_both_sides_interleaved():
  # The real kernel under both settings, one round: the timings a verdict is made of.
  entry = xla_cpu_flags.probe(rounds=1, steps=1, timeout=300)
  assert 'error' not in entry or 'a tie' in entry['error'], entry
  assert len(entry['off_over_on']) == 1 and entry['off_over_on'][0] > 0
  assert len(entry['step_s']['on']) == len(entry['step_s']['off']) == 1


_GRADS = r'''
import json, os, sys
sys.path.insert(0, {repo!r})
from vit_jax import xla_cpu_flags
dtype = sys.argv[2]
xla_cpu_flags.apply(dtype=dtype)
import jax, jax.numpy as jnp, numpy as np
from vit_jax import models
model = models.get_model('R+ViT-Ti_16', 10, num_layers=2, resnet_layers=(1, 1), dtype=dtype)
x = jax.random.uniform(jax.random.PRNGKey(1), (4, 64, 64, 3), minval=-1, maxval=1)
params = jax.jit(model.init)(jax.random.PRNGKey(0), x)['params']  # op by op: ~3x the time
params['head']['kernel'] = 0.1 * jax.random.normal(jax.random.PRNGKey(2), params['head']['kernel'].shape)
loss = lambda p: jnp.mean(jax.nn.logsumexp(model.apply({{'params': p}}, x), -1))
compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
value, grads = compiled(params)
np.savez(sys.argv[1], loss=np.asarray(value), *[np.asarray(g) for g in jax.tree.leaves(grads)])
temp = compiled.memory_analysis().temp_size_in_bytes
print(json.dumps({{'flags': os.environ.get('XLA_FLAGS', ''), 'temp_bytes': temp}}))
'''


def _grads(xla_flags, path, dtype='float32'):
  env = {
      **os.environ, xla_cpu_flags.OPT_OUT: '0',
      'TF_CPP_MIN_LOG_LEVEL': '2',
      'XLA_FLAGS': xla_flags
  }
  proc = subprocess.run(
      [sys.executable, '-c', _GRADS.format(repo=REPO),
       str(path), dtype], env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  with np.load(path) as f:
    return report, {k: f[k] for k in f.files}


@pytest.fixture(scope='module')
def xla_defaults_f32(tmp_path_factory):
  """The float32 run under XLA's default flags, which two tests compare against."""
  return _grads('', tmp_path_factory.mktemp('xla_defaults') / 'off.npz')


def test_flags_are_accepted_and_leave_f32_numerics_unchanged(tmp_path, xla_defaults_f32):
  # XLA aborts at start-up on a flag it does not know: the run with flags proves they exist.
  report_on, on = _grads(FLAG, tmp_path / 'on.npz')
  report_off, off = xla_defaults_f32
  assert NAME in report_on['flags'] and NAME not in report_off['flags']
  _assert_close(on, off, 1e-4)  # float32 round-off only


def test_memory_scheduler_plans_fewer_temporaries_with_the_same_gradients(
    tmp_path, xla_defaults_f32):
  # What the flag is there for: XLA's plan of the fwd+bwd keeps fewer bytes alive (ViT-B/16
  # b8: 1.45 vs 1.95 GiB). A jaxlib in which it does nothing fails here.
  report_on, on = _grads(xla_cpu_flags.MEMORY_SCHEDULER, tmp_path / 'on.npz')
  report_off, off = xla_defaults_f32
  assert report_on['temp_bytes'] < 0.95 * report_off['temp_bytes'], (report_on, report_off)
  _assert_close(on, off, 1e-5)


def test_bf16_step_runs_with_and_without_ynnpack_fusions(tmp_path):
  # With YNNPACK on (a bf16 run's setting), every bf16 x bf16 -> f32 dot of the step must
  # be one YNNPACK takes: XLA's fallback kernel has no such type and fails at run time
  # (UNIMPLEMENTED: ... DotThunk::Execute: BF16 x BF16 = F32), e.g. for a weight gradient
  # whose result XLA transposes (models/precision.py). With YNNPACK off, XLA runs them
  # as f32 dots of the same bf16 operands: equal gradients but for round-off.
  _, on = _grads('', tmp_path / 'on.npz', 'bfloat16')
  _, off = _grads(FLAG, tmp_path / 'off.npz', 'bfloat16')
  _assert_close(on, off, 0.1)  # bf16 round-off (~0.4%) compounded through the layers


def _assert_close(a, b, rtol):
  """Relative to each gradient's scale (leaves that are zero but for round-off, such as
  those behind the zero-initialised GroupNorm scales, against the largest gradient's)."""
  assert a.keys() == b.keys() and len(a) > 20
  largest = max(float(np.max(np.abs(v))) for v in b.values())
  for k in a:
    scale = max(float(np.max(np.abs(b[k]))), 1e-3 * largest)
    assert float(np.max(np.abs(a[k] - b[k]))) <= rtol * scale, k
