"""Train-state checkpoints with small replicated arrays packed (vit_jax/packed_state.py)."""
import json
import logging
import os

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from vit_jax import checkpoint
from vit_jax import models
from vit_jax import optim
from vit_jax import packed_state
from vit_jax import sharding
from vit_jax import step as step_lib
from vit_jax.configs import common as common_config


def _mesh():
  return Mesh(np.array(jax.devices()), ('data',))


def _state(mesh):
  """Arrays of every kind a train state holds: small and large, replicated and split (FSDP),
  float32, bfloat16 and int32, a scalar, in dicts and a tuple."""
  rng = np.random.default_rng(0)
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  return {
      'step': jax.device_put(jnp.int32(7), replicated),
      'params': {
          'dense': {
              'kernel': jax.device_put(normal(64, 32), replicated),
              'bias': jax.device_put(normal(32), replicated)
          },
          'large': jax.device_put(normal(packed_state.PACK_BELOW // 512, 512), replicated),
          'split': jax.device_put(normal(256, 64), split),
      },
      'opt_state': (jax.device_put(normal(40).astype(jnp.bfloat16), replicated),),
  }


def _save(tmp_path, state):
  manager = checkpoint.train_state_manager(str(tmp_path / 'checkpoints'), 2)
  checkpoint.save_train_state(manager, 7, state, force=True)
  manager.wait_until_finished()
  return manager


def _save_as_before_packing(directory, state):
  """As vit_jax saved the state until the sixty-first session: orbax's tree of the state."""
  manager = checkpoint.train_state_manager(directory, 2)
  manager.save(7, args=ocp.args.StandardSave(state), force=True,
               custom_metadata={'vit_jax_checksums': checkpoint.state_checksums(state)})
  manager.wait_until_finished()
  return manager


def _target(state, mesh, spec):
  """The state's ShapeDtypeStructs, every array laid out by `spec` where it divides."""

  def target(x):
    fits = x.ndim and x.shape[0] % mesh.devices.size == 0
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=NamedSharding(mesh, spec if fits else P()))

  return jax.tree.map(target, state)


def test_small_replicated_arrays_are_saved_in_one_buffer_per_dtype(tmp_path):
  state = _state(_mesh())
  manager = _save(tmp_path, state)
  saved = manager.item_metadata(7)
  assert sorted(saved['packed']) == ['bfloat16', 'float32', 'int32']
  assert saved['packed']['float32'].shape == (64 * 32 + 32,)
  # Large or split: saved as themselves, under their own names.
  assert sorted(saved['arrays']['params']) == ['large', 'split']
  assert len(jax.tree.leaves(saved)) == 5


def test_a_state_comes_back_bit_exact_onto_another_layout(tmp_path):
  mesh = _mesh()
  state = _state(mesh)
  manager = _save(tmp_path, state)
  for spec in (P('data'), P()):  # FSDP-like, then all replicated
    back = checkpoint.restore_train_state(manager, _target(state, mesh, spec))
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for (path, a), b, want in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(back),
                                  jax.tree.leaves(_target(state, mesh, spec))):
      name = packed_state.leaf_path(path)
      assert b.dtype == a.dtype and b.sharding == want.sharding, name
      bits = lambda x: np.asarray(x).reshape(-1).view(np.uint8)
      np.testing.assert_array_equal(bits(b), bits(a), err_msg=name)


def test_a_checkpoint_written_before_packing_still_restores(tmp_path):
  mesh = _mesh()
  state = _state(mesh)
  manager = _save_as_before_packing(str(tmp_path / 'checkpoints'), state)
  back = checkpoint.restore_train_state(manager, _target(state, mesh, P()))
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_a_vit_train_state_saves_few_arrays(tmp_path):
  """ViT-Ti/16's parameters and SGD momentum, 402 arrays, each saved as itself took most of
  a save's CPU in orbax's work per array; now one buffer per dtype (benchmarks/README.md,
  sixty-first session)."""
  config = common_config.get_config()
  config.update(model_name='ViT-Ti_16', optimizer='sgd', momentum=0.9, grad_clip_norm=1.0)
  tx = optim.make_optimizer(config, 10)
  mesh = sharding.make_mesh(config)
  state, _ = step_lib.create_train_state(config, models.from_config(config, 10), tx, mesh, 10)
  del state['guard']
  manager = _save(tmp_path, state)
  saved = manager.item_metadata(7)
  assert len(jax.tree.leaves(state)) > 400
  assert sorted(saved) == ['packed'] and sorted(saved['packed']) == ['float32', 'int32']


def test_saved_arrays_reads_any_step_by_name_in_either_layout(tmp_path, caplog):
  state = _state(_mesh())
  want = {
      packed_state.leaf_path(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)
  }
  _save(tmp_path, state)
  with caplog.at_level(logging.INFO):
    got = checkpoint.saved_arrays(str(tmp_path / 'checkpoints'), 7)
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert sorted(got) == sorted(want)
  for name, x in want.items():
    assert isinstance(got[name], np.ndarray) and got[name].dtype == x.dtype, name
    np.testing.assert_array_equal(got[name], x, err_msg=name)
  # Written before packing: orbax's own tree, the same names for the parameters.
  _save_as_before_packing(str(tmp_path / 'old'), state)
  got = checkpoint.saved_arrays(str(tmp_path / 'old'), 7)
  for name in ('params/dense/kernel', 'params/split', 'step'):
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_layout_of_another_version_stops_without_moving_the_checkpoint(tmp_path):
  mesh = _mesh()
  state = _state(mesh)
  manager = _save(tmp_path, state)
  metadata = tmp_path / 'checkpoints' / '7' / '_CHECKPOINT_METADATA'
  saved = json.loads(metadata.read_text())
  saved['custom_metadata']['vit_jax_layout']['version'] = packed_state.VERSION + 1
  metadata.write_text(json.dumps(saved))
  manager.reload()
  with pytest.raises(checkpoint.DifferentModelError, match='another version of vit_jax'):
    checkpoint.restore_train_state(manager, _target(state, mesh, P()))
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['7']


def test_saved_arrays_of_a_step_whose_metadata_is_garbled_says_so(tmp_path, caplog):
  # Its layout lost, the packed buffers had been read as the arrays of an old checkpoint and
  # reported as not fitting the model.
  _save(tmp_path, _state(_mesh()))
  (tmp_path / 'checkpoints' / '7' / '_CHECKPOINT_METADATA').write_text('garbled')
  with pytest.raises(ValueError) as e:
    checkpoint.saved_arrays(str(tmp_path / 'checkpoints'), 7)
  assert str(e.value).endswith('/7 cannot be read (its metadata is unreadable): it is damaged; '
                               'no other step is there')
  assert 'garbled' not in caplog.text  # orbax's error, with the file's content: dropped


def test_saved_arrays_names_the_steps_there_are(tmp_path):
  _save(tmp_path, _state(_mesh()))
  with pytest.raises(ValueError) as e:
    checkpoint.saved_arrays(str(tmp_path / 'checkpoints'), 5)
  assert str(e.value).endswith('has no checkpoint of step 5: pass one of its steps (7)')
  with pytest.raises(ValueError, match='holds no checkpoints: pass the checkpoints folder'):
    checkpoint.saved_arrays(str(tmp_path / 'elsewhere'))
  assert not (tmp_path / 'elsewhere').exists()  # looked into, not made
