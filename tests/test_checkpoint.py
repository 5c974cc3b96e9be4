"""Tests for vit_jax.checkpoint against fake checkpoints in the published layouts.

The fake files are built from the model's own jax.eval_shape tree (ViT, hybrid) or from
BiT's TF naming written out here, filled with random numbers: nothing is downloaded.
"""
import json
import logging
import os
import socket
import subprocess
import sys
import zipfile

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.ndimage

from tests import numpy_reference as ref
from vit_jax import checkpoint
from vit_jax import models
from vit_jax import rundir
from vit_jax.configs import common


def _random_like(shape, rng, name):
  if name.endswith(('scale', 'gamma')):
    return (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
  return (0.2 * rng.standard_normal(shape)).astype(np.float32)


def _write_vit_file(path, model, image_size, seed=0, hybrid=False):
  """A ViT/hybrid .npz in the published layout; returns its flat dict (float64)."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(
      0), jnp.zeros((1, image_size, image_size, 3)), train=False))['params']
  rng = np.random.default_rng(seed)
  flat = {
      k: _random_like(v.shape, rng, k)
      for k, v in flax.traverse_util.flatten_dict(shapes, sep='/').items()
  }
  if hybrid:  # the published hybrid files store GroupNorm parameters as (1, 1, 1, C)
    flat = {k: (v.reshape(1, 1, 1, -1) if '/gn' in f'/{k}' else v) for k, v in flat.items()}
  np.savez(path, **flat)
  return flat


def _write_bit_file(path, layers, width, num_classes, seed=0):
  """A BiT-M style .npz (TF names, 1-D GroupNorm params, 1x1 conv head)."""
  rng = np.random.default_rng(seed)
  w = 64 * width
  flat = {'resnet/root_block/standardized_conv2d/kernel': (7, 7, 3, w)}
  cin = w
  for i, units in enumerate(layers):
    mid = w * 2**i
    for j in range(units):
      u = f'resnet/block{i + 1}/unit{j + 1:02d}/'
      flat.update({
          u + 'a/group_norm/gamma': (cin,),
          u + 'a/group_norm/beta': (cin,),
          u + 'a/standardized_conv2d/kernel': (1, 1, cin, mid),
          u + 'b/group_norm/gamma': (mid,),
          u + 'b/group_norm/beta': (mid,),
          u + 'b/standardized_conv2d/kernel': (3, 3, mid, mid),
          u + 'c/group_norm/gamma': (mid,),
          u + 'c/group_norm/beta': (mid,),
          u + 'c/standardized_conv2d/kernel': (1, 1, mid, 4 * mid),
      })
      if j == 0:
        flat[u + 'a/proj/standardized_conv2d/kernel'] = (1, 1, cin, 4 * mid)
      cin = 4 * mid
  flat.update({
      'resnet/group_norm/gamma': (cin,),
      'resnet/group_norm/beta': (cin,),
      'resnet/head/conv2d/kernel': (1, 1, cin, num_classes),
      'resnet/head/conv2d/bias': (num_classes,)
  })
  flat = {k: _random_like(s, rng, k) for k, s in flat.items()}
  np.savez(path, **flat)
  return flat


def _images(size, n=2, seed=1):
  return np.random.default_rng(seed).uniform(-1, 1, (n, size, size, 3)).astype(np.float32)


VIT_CASES = {
    'token': (dict(num_layers=2, patch_size=8, hidden_size=32, mlp_dim=64, num_heads=4), 'token'),
    'gap_prelogits': (dict(num_layers=1, patch_size=8, hidden_size=32, mlp_dim=48, num_heads=2,
                           classifier='gap', representation_size=16), 'gap'),
}


@pytest.mark.parametrize('case', sorted(VIT_CASES))
def test_vit_file_gives_reference_logits(tmp_path, case):
  overrides, classifier = VIT_CASES[case]
  model = models.get_model('ViT-Ti_16', num_classes=5, **overrides)
  flat = _write_vit_file(tmp_path / 'vit.npz', model, 32)
  params = checkpoint.load_npz(str(tmp_path / 'vit.npz'))
  x = _images(32)
  got = model.apply({'params': params}, x, train=False)
  want = ref.vit_forward(flat, x, patch=8, heads=overrides['num_heads'], classifier=classifier)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_hybrid_file_gives_reference_logits(tmp_path):
  # 36 px: odd maps (18 -> 9 -> 5) exercise TF SAME's asymmetric padding.
  overrides = dict(num_layers=1, resnet_layers=(1, 1), hidden_size=32, mlp_dim=32, num_heads=2)
  model = models.get_model('R26+ViT-S_32', num_classes=4, **overrides)
  flat = _write_vit_file(tmp_path / 'hybrid.npz', model, 36, hybrid=True)
  assert flat['gn_root/scale'].shape == (1, 1, 1, 64)
  params = checkpoint.load_npz(str(tmp_path / 'hybrid.npz'))
  assert params['gn_root']['scale'].shape == (64,)
  x = _images(36)
  got = model.apply({'params': params}, x, train=False)
  want = ref.vit_forward(flat, x, patch=1, heads=2, resnet_layers=(1, 1))
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_bit_file_gives_reference_logits(tmp_path):
  layers = (1, 2)
  flat = _write_bit_file(tmp_path / 'bit.npz', layers, 1, 6)
  model = models.get_model('BiT-M-R50x1', num_classes=6, resnet_layers=layers)
  params = checkpoint.load_npz(str(tmp_path / 'bit.npz'))
  x = _images(36)
  got = model.apply({'params': params}, x, train=False)
  want = ref.bit_forward(flat, x, layers)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_the_variables_model_init_returns_are_saved_as_their_params(tmp_path):
  """save_npz(path, model.init(...)), a notebook's first try, had raised KeyError
  'encoder_norm' (the 'params/' prefix made the tree look like a BiT ResNet's)."""
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=1, patch_size=8)
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)
  checkpoint.save_npz(str(tmp_path / 'v.npz'), variables)
  loaded = checkpoint.load_npz(str(tmp_path / 'v.npz'))
  want = flax.traverse_util.flatten_dict(jax.device_get(variables['params']), sep='/')
  got = flax.traverse_util.flatten_dict(loaded, sep='/')
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float16, jnp.float64])
def test_parameters_in_another_float_dtype_are_written_in_float32(tmp_path, dtype):
  """bfloat16 parameters had been written as 2-byte void records ('|V2') that neither
  load_npz nor any other loader reads; the published files are float32."""
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=1, patch_size=8)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)['params']
  cast = jax.tree.map(lambda x: np.asarray(x).astype(dtype), params)  # numpy: float64 stays
  checkpoint.save_npz(str(tmp_path / 'p.npz'), cast)
  with np.load(tmp_path / 'p.npz', allow_pickle=False) as out:
    assert {out[k].dtype for k in out.files} == {np.dtype(np.float32)}
  loaded = flax.traverse_util.flatten_dict(checkpoint.load_npz(str(tmp_path / 'p.npz')), sep='/')
  for key, value in flax.traverse_util.flatten_dict(cast, sep='/').items():
    np.testing.assert_array_equal(loaded[key], np.asarray(value).astype(np.float32))


def test_what_save_npz_cannot_write_is_one_line_naming_the_fix(tmp_path):
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=1, patch_size=8)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)['params']
  path = str(tmp_path / 'p.npz')
  with pytest.raises(
      ValueError, match=r"^save_npz writes a model's parameters; these "
      r"variables also hold 'batch_stats': pass variables\['params'\]$"):
    checkpoint.save_npz(path, {'params': params, 'batch_stats': {}})
  with pytest.raises(
      ValueError, match=r"^save_npz: 'dense/kernel' is a parameter of neither "
      r"a ViT \(no 'embedding/kernel'\) nor a BiT ResNet: pass the parameters "
      r'of a vit_jax.models model$'):
    checkpoint.save_npz(path, {'dense': {'kernel': np.zeros((2, 2), np.float32)}})
  with pytest.raises(ValueError, match=r'^save_npz: head/bias is int32, not a float array'):
    checkpoint.save_npz(path, {'head': {'bias': np.zeros(3, np.int32)}})
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize('kind', ['vit', 'hybrid', 'bit'])
def test_round_trip_writes_the_published_layout(tmp_path, kind):
  src = tmp_path / 'src.npz'
  if kind == 'bit':
    flat = _write_bit_file(src, (1, 1), 1, 3)
  else:
    name, overrides = (('ViT-Ti_16', dict(num_layers=1, patch_size=8)) if kind == 'vit' else
                       ('R26+ViT-S_32', dict(num_layers=1, resnet_layers=(1,))))
    flat = _write_vit_file(src, models.get_model(name, num_classes=3, **overrides), 32,
                           hybrid=kind == 'hybrid')
  checkpoint.save_npz(str(tmp_path / 'out.npz'), checkpoint.load_npz(str(src)))
  with np.load(tmp_path / 'out.npz', allow_pickle=False) as out:
    assert sorted(out.files) == sorted(flat)
    for k in flat:
      assert out[k].shape == flat[k].shape, k
      np.testing.assert_array_equal(out[k], flat[k])


def test_pickled_file_is_refused(tmp_path):
  path = tmp_path / 'evil.npz'
  np.savez(path, head=np.array([{'a': 1}], dtype=object))
  with pytest.raises(checkpoint.UnreadableFileError, match='holds pickled'):
    checkpoint.load_npz(str(path))


@pytest.mark.parametrize('value,says', [
    (np.array(['x', 'y']), r'holds head/bias as <U1, not floating-point: re-export it'),
    (np.array([1 + 2j], np.complex64), r'holds head/bias as complex64, not floating-point'),
    (np.array([1, 2], np.int32), r'holds head/bias as int32, not floating-point'),
    (np.array([0.5, np.nan], np.float32), r'holds NaN or infinite values in head/bias: it is'),
    (np.array([np.inf], np.float16), r'holds NaN or infinite values in head/bias'),
])
def test_parameters_that_are_not_finite_floats_are_refused(tmp_path, value, says):
  path = tmp_path / 'odd.npz'
  np.savez(path, **{'head/kernel': np.ones((2, 2), np.float32), 'head/bias': value})
  with pytest.raises(checkpoint.UnreadableFileError, match=says):
    checkpoint.load_npz(str(path))


def test_a_published_file_out_of_reach_names_its_download(monkeypatch):
  """Offline, the finetune configs' gs:// checkpoint: the fix names the https address curl
  takes (it had said 'gsutil cp or curl' and no address)."""

  def unreachable(path, mode):
    raise OSError(f'{path}: could not reach storage.googleapis.com')

  monkeypatch.setattr(checkpoint.paths, 'open_file', unreachable)
  with pytest.raises(checkpoint.UnreadableFileError) as e:
    checkpoint.load_npz('gs://vit_models/imagenet21k/ViT-B_16.npz')
  assert str(e.value).endswith(
      ': download it (curl -O https://storage.googleapis.com/vit_models/imagenet21k/ViT-B_16.npz'
      ', or gsutil cp) and pass the local file'), e.value


def test_an_npz_without_arrays_is_called_empty_not_pickled(tmp_path):
  path = tmp_path / 'empty.npz'
  np.savez(path)
  with pytest.raises(checkpoint.UnreadableFileError, match=r'empty.npz holds no arrays: check'):
    checkpoint.load_npz(str(path))


def test_a_zip_member_that_is_no_array_is_refused(tmp_path):
  """np.load hands such a member back as bytes: readers had failed on its missing .shape."""
  path = tmp_path / 'odd.npz'
  with zipfile.ZipFile(path, 'w') as z:
    z.writestr('head/kernel.npy', b'garbage')
  with pytest.raises(checkpoint.UnreadableFileError, match=r'holds head/kernel, which is '
                     'not an array: check the path'):
    checkpoint.load_npz(str(path))


def test_not_an_npz_is_a_clear_error(tmp_path):
  path = tmp_path / 'broken.npz'
  path.write_bytes(b'not a zip file')
  with pytest.raises(ValueError, match='not a readable .npz'):
    checkpoint.load_npz(str(path))


def _damage(path, at):
  with open(path, 'r+b') as f:
    f.seek(at)
    f.write(b'\xde\xad\xbe\xef')


def test_a_damaged_npz_is_one_line_and_a_workdir_is_told_to_rerun(tmp_path):
  # Bytes overwritten inside a stored array: the zip's CRC catches it (BadZipFile).
  run = tmp_path / 'run'
  run.mkdir()
  model = models.get_model('ViT-Ti_16', 10, **TINY)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)['params']
  checkpoint.save_npz(str(run / 'final.npz'), params)
  c = common.get_config()
  c.model_name = 'ViT-Ti_16'
  c.model.update(TINY)
  c.image_size = 32  # as the parameters were made
  config = c.to_json_best_effort()
  (run / 'config.json').write_text(config)
  checkpoint.load_run(str(run))  # intact
  newer = json.loads(config)  # a model field of a newer vit_jax: the file had not been named
  newer['model']['legacy_nested'] = 1
  (run / 'config.json').write_text(json.dumps(newer))
  with pytest.raises(
      ValueError, match=r'config.json names a model this version of vit_jax cannot build \('
      r'Unknown field\(s\) legacy_nested .*\): read it with the version of vit_jax that wrote it'):
    checkpoint.load_run(str(run))
  (run / 'config.json').write_text(config)
  _damage(run / 'final.npz', os.path.getsize(run / 'final.npz') // 3)
  with pytest.raises(ValueError, match=r'final.npz is damaged \(.*CRC.*\): download or export'):
    checkpoint.load_npz(str(run / 'final.npz'))
  with pytest.raises(
      ValueError, match=r'final.npz is damaged .*: run vit-train again with the '
      r'same --workdir to write it again'):
    checkpoint.load_run(str(run))
  (run / 'config.json').write_text(config[:40])
  with pytest.raises(
      ValueError, match=r'config.json is damaged \(.*\): restore it, or run '
      r"the run's vit-train command again with --config.resume_changes='\*' to write it again"):
    checkpoint.load_run(str(run))


def test_a_workdir_being_trained_says_so(tmp_path, caplog):
  """vit-evaluate, vit-predict and vit-inspect on the workdir of a live run had said to run
  vit-train there (which the lock refuses), or took the run before's final.npz in silence."""
  run = tmp_path / 'run'
  run.mkdir()
  live = {
      'host': socket.gethostname(),
      'pid': os.getpid(),
      'started': 'today',
      'proc_start': rundir._proc_start(os.getpid())
  }  # pylint: disable=protected-access
  (run / 'lock').write_text(json.dumps(live))  # this process: alive
  with pytest.raises(
      ValueError, match=(f'^{run} has no final.npz yet: a run is training there now \\(pid '
                         f'{os.getpid()} on .*\\): wait for it to end \\(its train.INFO shows how '
                         'far it is\\), or read one of its checkpoints with --step N$')):
    checkpoint.load_run(str(run))  # in its first seconds: no config.json either
  model = models.get_model('ViT-Ti_16', 10, **TINY)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)['params']
  c = common.get_config()
  c.model_name, c.image_size = 'ViT-Ti_16', 32
  c.model.update(TINY)
  (run / 'config.json').write_text(c.to_json_best_effort())
  checkpoint.save_npz(str(run / 'final.npz'), params)  # of the run before this one
  with caplog.at_level(logging.WARNING):
    checkpoint.load_run(str(run))
  assert f'{run} is being trained now (pid {os.getpid()} on ' in caplog.text
  # The run gone (kill -9): its lock is stale, and the run is told to be finished.
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  (run / 'lock').write_text(json.dumps({**live, 'pid': dead.pid, 'proc_start': None}))
  os.remove(run / 'final.npz')
  with pytest.raises(
      ValueError, match=(f'^{run} has no final.npz: its run stopped before the end \\(the end '
                         'of its train.INFO says where\\); run vit-train again with the same '
                         '--workdir to finish it, or read one of its checkpoints with --step N$')):
    checkpoint.load_run(str(run))


def test_a_write_killed_midway_leaves_no_temporary_behind_the_next(tmp_path):
  (tmp_path / 'final.npz.abc123.tmp').write_bytes(b'half a file')  # kill -9 during a write
  checkpoint.save_npz(str(tmp_path / 'final.npz'), {'head': {'bias': np.zeros(3, np.float32)}})
  assert sorted(os.listdir(tmp_path)) == ['final.npz']


def test_checksums_are_those_of_the_bits_on_any_mesh():
  x = jnp.arange(24, dtype=jnp.float32).reshape(4, 6)
  state = {'a': x, 'step': jnp.int32(3), 'b': jnp.ones(3, jnp.bfloat16)}
  sums = checkpoint.state_checksums(state)
  words = np.asarray(x).view(np.uint32).ravel().astype(np.uint64)
  weights = 2 * np.arange(words.size, dtype=np.uint64) + 1
  assert sums['a'] == [int(words.sum() % 2**32), int((words * weights).sum() % 2**32)]
  assert sums['step'] == [3, 3]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ('data',))
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data')))
  assert checkpoint.state_checksums({'a': sharded, 'step': state['step'], 'b': state['b']}) == sums
  moved = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])  # two values swapped
  assert checkpoint.state_checksums({**state, 'a': moved})['a'][0] == sums['a'][0]
  assert checkpoint.state_checksums({**state, 'a': moved})['a'][1] != sums['a'][1]


def _compiles_during(fn):
  """How many XLA programs `fn()` compiled."""
  compiles = []

  def count(event, duration, **_):
    if event == '/jax/core/compile/backend_compile_duration':
      compiles.append(duration)

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    fn()
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  return len(compiles)


def test_checksums_compile_once_per_array_shape_not_per_state():
  # A state's arrays repeat a few shapes (a ViT's blocks): one program per shape compiles in
  # a fraction of the time of one program over the whole state, which grows with its arrays.
  shapes = [(6, 40), (40,), (40, 6)]

  def state(blocks):
    return {
        f'block{b}': {
            f'w{i}': jnp.full(s, b + i, jnp.float32) for i, s in enumerate(shapes)
        } for b in range(blocks)
    }

  small, large = state(1), state(5)
  # On the devices, as for arrays on accelerators or spread over hosts.
  assert _compiles_during(lambda: checkpoint.state_checksums(small, host=False)) <= len(shapes)
  sums = []
  assert _compiles_during(lambda: sums.append(checkpoint.state_checksums(large, host=False))) == 0
  assert len(sums[0]) == 15 and sums[0]['block3/w1'] != sums[0]['block4/w1']
  assert sums[0]['block0/w2'] == checkpoint.state_checksums(small, host=False)['block0/w2']
  # In this host's memory (CPU devices): NumPy's sums, nothing compiled, the same numbers.
  host = []
  assert _compiles_during(lambda: host.append(checkpoint.state_checksums(state(6)))) == 0
  assert {k: v for k, v in host[0].items() if not k.startswith('block5/')} == sums[0]


def test_checksums_in_host_memory_equal_those_on_the_devices(monkeypatch):
  monkeypatch.setattr(checkpoint, '_HOST_CHUNK', 7)  # many chunks, one cut short
  rng = np.random.default_rng(0)
  bits = rng.integers(0, 2**32, 45, dtype=np.uint32)
  state = {
      'f32': jnp.asarray(bits.view(np.float32).reshape(5, 9)),  # NaNs' bits too
      'bf16': jnp.asarray(rng.standard_normal(23), jnp.bfloat16),
      'f16': jnp.asarray(rng.standard_normal(11), jnp.float16),
      'i32': jnp.asarray(bits.view(np.int32)),
      'u8': jnp.asarray(bits.view(np.uint8)),
      'i8': jnp.asarray(bits.view(np.int8)[:31]),
      'bool': jnp.asarray(bits % 3 == 0),
      'step': jnp.int32(7),
  }
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ('data',))
  state['sharded'] = jax.device_put(
      state['f32'][:4], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data')))
  host = checkpoint.state_checksums(state)
  assert host == checkpoint.state_checksums(state, host=False)
  assert host['sharded'] == checkpoint.state_checksums({'sharded': state['f32'][:4]})['sharded']


def test_a_state_replicated_on_cpu_devices_saves_without_compiling(tmp_path):
  # orbax's replica-parallel saving would compile a slice per array shape here: on CPU
  # devices, which share the host's memory, train_state_manager turns it off.
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  # A side of 8k: orbax would split it 8 ways. Arrays this large are saved as themselves
  # (vit_jax/packed_state.py), the small one packed.
  shapes = [(1024, 1024), (8, 2**17), (2**20 + 24,), (40, 3)]
  state = {
      f'w{i}': jax.device_put(jnp.full(s, i, jnp.float32), replicated) for i, s in enumerate(shapes)
  }
  checkpoint.state_checksums(state)  # its own programs, compiled before counting
  manager = checkpoint.train_state_manager(str(tmp_path / 'ckpt'), keep=1)

  def save():
    checkpoint.save_train_state(manager, 1, state)
    manager.wait_until_finished()

  assert len(jax.devices()) == 8 and _compiles_during(save) == 0
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                          state)
  restored = checkpoint.restore_train_state(manager, abstract)
  for k, v in state.items():
    np.testing.assert_array_equal(restored[k], v)
  assert os.path.isdir(tmp_path / 'ckpt/1/default/array_metadatas')  # orbax's layout is kept


TINY = dict(num_layers=1, hidden_size=32, mlp_dim=32, num_heads=2)


def test_load_pretrained_replaces_head_and_drops_prelogits(tmp_path, caplog):
  upstream = models.get_model('ViT-Ti_16', num_classes=21, representation_size=32, **TINY)
  flat = _write_vit_file(tmp_path / 'up.npz', upstream, 32)
  model = models.get_model('ViT-Ti_16', num_classes=7, **TINY)
  with caplog.at_level(logging.INFO):
    params = checkpoint.load_pretrained(str(tmp_path / 'up.npz'), model, 7, 32, head_bias_init=-3.0)
  assert 'pre_logits' not in params
  assert params['head']['kernel'].shape == (32, 7) and not np.any(params['head']['kernel'])
  np.testing.assert_array_equal(params['head']['bias'], -3.0)
  np.testing.assert_array_equal(params['embedding']['kernel'], flat['embedding/kernel'])
  line = [r.getMessage() for r in caplog.records if 'load_pretrained' in r.getMessage()]
  assert line and 'head 21 -> 7 classes' in line[0] and 'pre_logits dropped' in line[0]
  assert model.apply({'params': params}, _images(32), train=False).shape == (2, 7)


def test_load_pretrained_keeps_prelogits_when_the_model_has_them(tmp_path):
  upstream = models.get_model('ViT-Ti_16', num_classes=21, representation_size=32, **TINY)
  flat = _write_vit_file(tmp_path / 'up.npz', upstream, 32)
  model = upstream.clone(num_classes=3)
  params = checkpoint.load_pretrained(str(tmp_path / 'up.npz'), model, 3, 32)
  np.testing.assert_array_equal(params['pre_logits']['kernel'], flat['pre_logits/kernel'])


@pytest.mark.parametrize('classifier', ['token', 'gap'])
def test_position_embeddings_interpolated_224_to_384(tmp_path, classifier):
  upstream = models.get_model('ViT-Ti_16', num_classes=10, classifier=classifier, **TINY)
  flat = _write_vit_file(tmp_path / 'up.npz', upstream, 224)
  old = flat['Transformer/posembed_input/pos_embedding']
  params = checkpoint.load_pretrained(str(tmp_path / 'up.npz'), upstream, 10, 384)
  new = np.asarray(params['Transformer']['posembed_input']['pos_embedding'])
  n_cls = 1 if classifier == 'token' else 0
  assert old.shape == (1, 196 + n_cls, 32) and new.shape == (1, 576 + n_cls, 32)
  if n_cls:
    np.testing.assert_array_equal(new[0, 0], old[0, 0])
  want = scipy.ndimage.zoom(old[0, n_cls:].reshape(14, 14, 32), (24 / 14, 24 / 14, 1), order=1)
  np.testing.assert_allclose(new[0, n_cls:].reshape(24, 24, 32), want, rtol=1e-6, atol=1e-6)
  # Corners of the grid keep their values (zoom with order 1 aligns corners).
  np.testing.assert_allclose(new[0, n_cls], old[0, n_cls], rtol=1e-6)
  assert upstream.apply({'params': params}, _images(384, n=1), train=False).shape == (1, 10)


def test_shape_mismatch_names_key_shapes_and_cause(tmp_path):
  upstream = models.get_model('ViT-Ti_16', num_classes=10, **TINY)
  _write_vit_file(tmp_path / 'up.npz', upstream, 32)
  other = models.get_model('ViT-Ti_32', num_classes=10, **TINY)
  with pytest.raises(
      ValueError, match=r'embedding/kernel: checkpoint \(16, 16, 3, 32\) vs '
      r"model \(32, 32, 3, 32\): the file's patches are 16x16, the model's 32x32: set the "
      r"model's patch_size to 16"):
    checkpoint.load_pretrained(str(tmp_path / 'up.npz'), other, 10, 64)


def test_architecture_mismatch_names_the_key(tmp_path):
  upstream = models.get_model('ViT-Ti_16', num_classes=10, **TINY)
  _write_vit_file(tmp_path / 'up.npz', upstream, 32)
  gap = models.get_model('ViT-Ti_16', num_classes=10, classifier='gap', **TINY)
  with pytest.raises(ValueError, match='Checkpoint key cls'):
    checkpoint.load_pretrained(str(tmp_path / 'up.npz'), gap, 10, 32)


def test_a_depth_mismatch_names_the_depths(tmp_path):
  """Either way round, the hint had been of another architecture (classifier token vs gap,
  representation_size), which did not fit; a single key read '(and 0 more)'."""
  one = models.get_model('ViT-Ti_16', num_classes=10, **TINY)
  two = models.get_model('ViT-Ti_16', num_classes=10, **{**TINY, 'num_layers': 2})
  _write_vit_file(tmp_path / 'one.npz', one, 32)
  _write_vit_file(tmp_path / 'two.npz', two, 32)
  with pytest.raises(ValueError) as e:
    checkpoint.load_pretrained(str(tmp_path / 'one.npz'), two, 10, 32)
  assert str(e.value).startswith('Model parameter Transformer/encoderblock_1/')
  assert str(e.value).endswith(' more) is not in the checkpoint: the checkpoint has 1 encoder '
                               'block where the model has 2 encoder blocks: pick the model '
                               'matching the file, with num_layers=1')
  with pytest.raises(ValueError) as e:
    checkpoint.load_pretrained(str(tmp_path / 'two.npz'), one, 10, 32)
  assert str(e.value).endswith(' more) has no place in the model: the checkpoint has 2 encoder '
                               'blocks where the model has 1 encoder block: pick the model '
                               'matching the file, with num_layers=2')
  flat = dict(np.load(tmp_path / 'one.npz'))
  del flat['cls']
  np.savez(tmp_path / 'no_cls.npz', **flat)
  with pytest.raises(ValueError, match=r'^Model parameter cls is not in the checkpoint: the '):
    checkpoint.load_pretrained(str(tmp_path / 'no_cls.npz'), one, 10, 32)


def test_bit_load_pretrained_replaces_conv_head(tmp_path):
  _write_bit_file(tmp_path / 'bit.npz', (1, 1), 1, 21)
  model = models.get_model('BiT-M-R50x1', num_classes=5, resnet_layers=(1, 1))
  params = checkpoint.load_pretrained(str(tmp_path / 'bit.npz'), model, 5, 32)
  assert params['head']['kernel'].shape == (512, 5) and not np.any(params['head']['kernel'])


def test_another_patch_size_names_the_field(tmp_path):
  """masked_patches:quickstart's checkpoint (4x4 patches) into the quickstart's model (7x7):
  both are 'ViT-Ti_16', so 'pick the model matching the file' had pointed nowhere."""
  tiny = dict(num_layers=1, hidden_size=16, mlp_dim=16, num_heads=1)
  small = models.get_model('ViT-Ti_16', 3, patch_size=4, **tiny)
  params = small.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 3)), train=False)['params']
  path = str(tmp_path / 'p4.npz')
  checkpoint.save_npz(path, params)
  with pytest.raises(checkpoint.IncompatibleCheckpointError) as e:
    checkpoint.load_pretrained(path, models.get_model('ViT-Ti_16', 3, patch_size=7, **tiny), 3, 28)
  assert str(e.value) == ("embedding/kernel: checkpoint (4, 4, 3, 16) vs model (7, 7, 3, 16): "
                          "the file's patches are 4x4, the model's 7x7: set the model's "
                          'patch_size to 4 (vit-train: --config.model.patch_size=4)')


def test_load_model_builds_what_a_published_file_holds(tmp_path):
  """The README's first snippet: an imagenet21k file has a 21,843-class head and pre-logits,
  a fine-tuned one a 384-px grid; get_model at 1000 classes and 224 px fits neither (flax's
  ScopeParamShapeError)."""
  tiny = dict(num_layers=1, hidden_size=32, mlp_dim=64, num_heads=2)
  path = str(tmp_path / 'in21k.npz')
  model = models.get_model('ViT-Ti_16', num_classes=21843, representation_size=32, **tiny)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 384, 384, 3)))['params']
  checkpoint.save_npz(path, params)
  loaded_model, loaded = checkpoint.load_model(path, 'ViT-Ti_16', **tiny)
  assert (loaded_model.num_classes, loaded_model.representation_size) == (21843, 32)
  images = jnp.zeros((1, 384, 384, 3))  # the file's own resolution, read from its grid
  np.testing.assert_array_equal(loaded_model.apply({'params': loaded}, images, train=False),
                                model.apply({'params': params}, images, train=False))
  small, resized = checkpoint.load_model(path, 'ViT-Ti_16', image_size=224, **tiny)
  assert small.apply({'params': resized}, jnp.zeros((1, 224, 224, 3))).shape == (1, 21843)
