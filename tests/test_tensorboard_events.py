"""A run's event file, read back as TensorBoard and vit-sweep read it."""
import os

import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata

from vit_jax import tensorboard_events
from vit_jax.configs import quickstart
from vit_jax.launch import sweep


def test_scalars_and_hyperparameters_read_back(tmp_path):
  writer = tensorboard_events.EventWriter(str(tmp_path))
  writer.write_hparams({
      'base_lr': 0.003,
      'model_name': 'ViT-B_16',
      'total_steps': 500,
      'fsdp': False
  })
  writer.write_scalars(100, {'loss': 1.5, 'accuracy': 0.25})
  writer.write_scalars(200, {'loss': 0.5, 'accuracy': 0.75})
  writer.close()

  assert sweep.read_accuracy(str(tmp_path)) == [(100, 0.25), (200, 0.75)]
  events = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={'tensors': 0})
  events.Reload()
  assert [(t.step, float(tf.make_ndarray(t.tensor_proto))) for t in events.Tensors('loss')
         ] == [(100, 1.5), (200, 0.5)]
  (content,) = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME).values()
  hparams = hparams_metadata.parse_session_start_info_plugin_data(content).hparams
  assert {
      k: v.WhichOneof('kind') for k, v in hparams.items()
  } == {
      'base_lr': 'number_value',
      'model_name': 'string_value',
      'total_steps': 'number_value',
      'fsdp': 'bool_value'
  }
  assert hparams['base_lr'].number_value == 0.003
  assert hparams['model_name'].string_value == 'ViT-B_16'


def test_a_process_that_does_not_write_leaves_no_file(tmp_path):
  writer = tensorboard_events.EventWriter(str(tmp_path), active=False)
  writer.write_hparams({'base_lr': 0.003})
  writer.write_scalars(1, {'loss': 1.0})
  writer.flush()
  writer.close()
  assert not os.listdir(tmp_path)


def test_a_directory_it_cannot_write_raises_what_the_loop_reports(tmp_path):
  """train.py turns OSError and tf.errors.OpError into its one-line 'cannot write' error."""
  (tmp_path / 'a_file').write_text('')
  with pytest.raises((OSError, tf.errors.OpError), match='not a directory'):
    tensorboard_events.EventWriter(str(tmp_path / 'a_file' / 'workdir'))


def test_nested_fields_are_hyperparameters_by_their_dotted_name(tmp_path):
  """Only top-level numbers and strings had been written: runs of a sweep over
  config.model.dropout_rate (the README's example) looked the same in the HPARAMS tab."""
  config = quickstart.get_config()
  config.model.dropout_rate = 0.1
  writer = tensorboard_events.EventWriter(str(tmp_path))
  writer.write_hparams(tensorboard_events.hparams_of(config))
  writer.close()
  events = event_accumulator.EventAccumulator(str(tmp_path))
  events.Reload()
  (content,) = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME).values()
  hparams = hparams_metadata.parse_session_start_info_plugin_data(content).hparams
  assert hparams['model.dropout_rate'].number_value == 0.1
  assert hparams['model.patch_size'].number_value == 7
  assert hparams['pp.flip'].bool_value is False
  assert hparams['fewshot_shots'].string_value == '(1, 5, 10, 25)'
  assert hparams['base_lr'].number_value == config.base_lr
  assert 'model' not in hparams and len(hparams) == len(tensorboard_events.hparams_of(config))
