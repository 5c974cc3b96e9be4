"""Tests for vit_jax.train (and main): mesh equivalences, accumulation, resume, CLI.

8 simulated CPU devices (tests/conftest.py), a tiny ViT, Fashion-MNIST-like IDX files
written by the test.
"""
import glob
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from vit_jax.configs import quickstart
from vit_jax import checkpoint
from vit_jax import chrono as chrono_lib
from vit_jax import device_peaks
from vit_jax import evaluate
from vit_jax import evaluate_cli
from vit_jax import flops
from vit_jax import host_memory
from vit_jax import models
from vit_jax import rundir
from vit_jax import sharding
from vit_jax import train
from vit_jax import step as step_lib
from vit_jax import xla_cpu_flags
from tests import data_fixtures as fx
from tests.conftest import UNREACHABLE_GCS, console_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IDX_SIZES = (96, 40)  # (train, test) sizes of the idx_dir fixture


def _config(idx_dir, **overrides):
  c = quickstart.get_config()
  c.data_dir = idx_dir
  # Big enough that FSDP really splits the MLP kernels (64 x 256 >= 2**14 elements).
  c.model.update(patch_size=7, hidden_size=64, mlp_dim=256, num_heads=2, num_layers=1)
  c.batch_size = 16
  c.eval_batch_size = 16
  c.total_steps = 3
  c.warmup_steps = 1
  c.log_every_steps = 1
  c.checkpoint_every_steps = 1000
  c.shuffle_buffer = 96
  c.prefetch = 1
  for k, v in overrides.items():
    if k.startswith('model.'):
      c.model[k[6:]] = v
    else:
      c[k] = v
  return c


def _run(idx_dir, tmp_path, name, **overrides):
  return train.train_and_evaluate(_config(idx_dir, **overrides), str(tmp_path / name))


def _assert_trees_close(a, b, atol):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0,
                               err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope='module')
def data_parallel(idx_dir, tmp_path_factory):
  """The reference run: 3 steps, data parallel over the 8 devices."""
  return _run(idx_dir, tmp_path_factory.mktemp('dp'), 'dp')


def test_data_mesh_of_8_equals_one_device(idx_dir, tmp_path, data_parallel, caplog):
  assert jax.device_count() == 8
  scalars = _Scalars()
  with caplog.at_level(logging.INFO):
    one = train.train_and_evaluate(_config(idx_dir, mesh_data=1), str(tmp_path / 'one'),
                                   writer=scalars)
  assert 'mesh_data 1: the run uses 1 of the 8 devices (7 idle)' in caplog.text  # said nowhere
  # The speed is of the device the step runs on: the idle 7 had divided img/s/core and MFU.
  third = scalars.at[3]
  assert third['img_per_sec_per_core'] == pytest.approx(third['steps_per_sec'] * 16)
  assert data_parallel['params']['embedding']['kernel'].sharding.mesh.size == 8
  assert one['params']['embedding']['kernel'].sharding.mesh.size == 1
  assert abs(one['loss'] - data_parallel['loss']) < 1e-5
  _assert_trees_close(one['params'], data_parallel['params'], 1e-5)
  # Training moved the parameters: the comparison is not between two initialisations.
  init = train.train_and_evaluate(_config(idx_dir, mesh_data=1), str(tmp_path / 'init'),
                                  stop_after_steps=0)
  moved = jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()),
                       init['params'], one['params'])
  assert max(jax.tree.leaves(moved)) > 1e-4


def test_fsdp_equals_data_parallel(idx_dir, tmp_path, data_parallel):
  fsdp = _run(idx_dir, tmp_path, 'fsdp', fsdp=True)
  kernel = fsdp['params']['Transformer']['encoderblock_0']['MlpBlock_3']['Dense_0']['kernel']
  assert 'data' in tuple(kernel.sharding.spec)  # really split over the devices
  assert abs(data_parallel['loss'] - fsdp['loss']) < 1e-5
  _assert_trees_close(data_parallel['params'], fsdp['params'], 1e-5)


def test_gradient_accumulation_equals_full_batch(idx_dir, tmp_path, caplog):
  full = _run(idx_dir, tmp_path, 'full', batch_size=32)
  with caplog.at_level(logging.INFO):
    accum = _run(idx_dir, tmp_path, 'accum', batch_size=32, accum_steps=4)
  assert abs(full['loss'] - accum['loss']) < 1e-5
  _assert_trees_close(full['params'], accum['params'], 1e-5)
  # Logged (only accum_steps 0 had been), and with dropout, that the masks are other draws.
  assert 'accum_steps 4: 4 micro-batch(es) of 8 per step' in caplog.text
  assert 'dropout' not in caplog.text
  caplog.clear()
  with caplog.at_level(logging.INFO):
    train.train_and_evaluate(
        _config(idx_dir, batch_size=32, accum_steps=4, **{'model.dropout_rate': 0.1}),
        str(tmp_path / 'accum_dropout'), stop_after_steps=1)
  assert re.search(
      r'accum_steps 4: 4 micro-batch\(es\) of 8 per step( fit \(.*\))?; each draws its own '
      r'dropout masks: another count trains with other draws \(the same rate\)', caplog.text)


def test_resume_continues_at_step_7_and_equals_uninterrupted(idx_dir, tmp_path, caplog):
  # Dropout on: the resumed run must also reproduce the dropout masks of steps 7..12. A trace
  # of steps 2-3 changes nothing; the resumed run, past it, says it takes none.
  config = _config(idx_dir, total_steps=12, profile_first_step=2, profile_steps=2,
                   **{'model.dropout_rate': 0.1})
  straight = train.train_and_evaluate(config, str(tmp_path / 'straight'))
  workdir = str(tmp_path / 'resumed')
  stopped = train.train_and_evaluate(config, workdir, stop_after_steps=6, writer=_Scalars())
  assert stopped['step'] == 6
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['6']
  # The core-hours spent up to the checkpoint go on counting (they had started again at 0).
  before = checkpoint.saved_core_hours(
      checkpoint.train_state_manager(os.path.join(workdir, 'checkpoints'), 1), 6)
  assert before > 0
  scalars = _Scalars()
  with caplog.at_level(logging.INFO):
    resumed = train.train_and_evaluate(config, workdir, writer=scalars)
  assert all(at['core_hours'] > before for at in scalars.at.values() if 'core_hours' in at)
  assert any('Resuming from the checkpoint of step 6' in r.getMessage() for r in caplog.records)
  assert any('step 7/12' in r.getMessage() for r in caplog.records)
  assert [r.getMessage() for r in caplog.records if 'profiler trace' in r.getMessage()] == [
      'No profiler trace in this run: its window, steps 2-3, lies before step 7, where the run '
      'resumes; set --config.profile_first_step to 7 or later to trace again'
  ]
  assert resumed['step'] == 12
  assert resumed['loss'] == straight['loss']
  _assert_trees_close(straight['params'], resumed['params'], 0.0)


def test_vit_evaluate_takes_the_runs_batch_and_repeats_its_top1(idx_dir, tmp_path, monkeypatch):
  # bf16 sums round by batch shape: at another batch a run's 0.5011 had read 0.5006.
  config = _config(idx_dir, dtype='bfloat16', total_steps=2, eval_batch_size=24,
                   fewshot_batch_size=16)
  accuracy = train.train_and_evaluate(config, str(tmp_path / 'run'))['accuracy']
  out = console_script('vit-evaluate', tmp_path, '--workdir', 'run', '--mode', 'top1')
  assert out.returncode == 0, out.stderr[-2000:]
  assert re.search(rf'^top1 +test +{accuracy:.4f}  \(40 images\)$', out.stdout,
                   re.M), (accuracy, out.stdout)
  batches = []
  for name in ('top1_accuracy', 'extract_features'):
    real = getattr(evaluate, name)
    monkeypatch.setattr(evaluate, name, lambda *a, real=real, name=name: batches.append(
        (name, a[4])) or real(*a))
  flags_ = types.SimpleNamespace(workdir=str(tmp_path / 'run'), step=None, checkpoint=None,
                                 dataset=None, data_dir=None, eval_crop=None, mode='all',
                                 train_split=None, eval_split=None, fewshot_datasets=None,
                                 shots=['1'], seeds=['0'], standardise=True, l2_reg=1.0,
                                 batch_size=None)
  evaluate_cli.run(flags_)
  assert batches == [('top1_accuracy', 24), ('extract_features', 16), ('extract_features', 16)]
  batches.clear()
  evaluate_cli.run(types.SimpleNamespace(**{**vars(flags_), 'batch_size': 8}))  # given: it wins
  assert {b for _, b in batches} == {8}


def test_polyak_average_is_exported_and_resumes_bit_identically(idx_dir, tmp_path, monkeypatch):
  # The iterates of a run without averaging (the average never changes the training).
  config = _config(idx_dir, total_steps=4, checkpoint_every_steps=1)
  plain = str(tmp_path / 'plain')
  iterates = [
      train.train_and_evaluate(config, plain, stop_after_steps=k)['params'] for k in range(1, 5)
  ]
  decay = 0.5
  weights = np.array([(1 - decay) * decay**(3 - i) for i in range(4)])
  weights /= weights.sum()  # the average is divided by its total weight
  expected = jax.tree.map(lambda *xs: sum(w * np.asarray(x) for w, x in zip(weights, xs)),
                          *iterates)

  averaged = _config(idx_dir, total_steps=4, checkpoint_every_steps=1, polyak_decay=decay)
  straight = train.train_and_evaluate(averaged, str(tmp_path / 'straight'))
  _assert_trees_close(expected, straight['params'], 1e-6)
  exported = checkpoint.load_npz(str(tmp_path / 'straight' / 'final.npz'))
  _assert_trees_close(straight['params'], exported, 0.0)
  assert not np.allclose(np.asarray(iterates[-1]['head']['kernel']),
                         np.asarray(exported['head']['kernel']))  # not the last iterate
  # A checkpoint read as vit-evaluate/predict/inspect --step read it: the average there.
  _, _, at_last = checkpoint.load_run(str(tmp_path / 'straight'), step=4)
  _assert_trees_close(exported, at_last, 0.0)
  _, _, at_2 = checkpoint.load_run(str(tmp_path / 'straight'), step=2)
  _assert_trees_close(
      jax.tree.map(lambda a, b: (a + decay * b) /
                   (1 + decay), jax.tree.map(np.asarray, iterates[1]),
                   jax.tree.map(np.asarray, iterates[0])), at_2, 1e-6)
  with pytest.raises(ValueError, match=r'has no checkpoint of step 1: pass one of its steps '
                     r'\(2, 3, 4\)'):  # keep_checkpoints 3
    checkpoint.load_run(str(tmp_path / 'straight'), step=1)
  out = console_script('vit-evaluate', tmp_path, '--workdir', 'straight', '--step', '2', '--mode',
                       'top1')
  assert out.returncode == 0, out.stderr[-2000:]
  assert re.search(r'^top1 +test +0\.\d{4}', out.stdout, re.M), out.stdout
  data = tmp_path / 'straight' / 'checkpoints' / '3' / 'default' / 'ocdbt.process_0' / 'd'
  for name in os.listdir(data):
    os.truncate(data / name, 100)
  with pytest.raises(
      ValueError, match=r'checkpoints/3 cannot be read \(.+\): it is damaged; '
      r'pass another of its steps \(2, 4\)$'):
    checkpoint.load_run(str(tmp_path / 'straight'), step=3)
  # Removed while read, as a live run's keep_checkpoints does: not called damaged.
  real_restore = checkpoint._restore_on_host  # pylint: disable=protected-access

  def removed_midway(manager, step):
    shutil.rmtree(tmp_path / 'straight' / 'checkpoints' / str(step))
    return real_restore(manager, step)

  monkeypatch.setattr(checkpoint, '_restore_on_host', removed_midway)
  with pytest.raises(
      ValueError, match=r'checkpoints/2 was removed while it was read \(the run '
      r'keeps its newest keep_checkpoints\): pass one of its steps \(3, 4\)$'):
    checkpoint.load_run(str(tmp_path / 'straight'), step=2)

  workdir = str(tmp_path / 'resumed')
  train.train_and_evaluate(averaged, workdir, stop_after_steps=2)
  resumed = train.train_and_evaluate(averaged, workdir)
  assert resumed['accuracy'] == straight['accuracy']
  _assert_trees_close(straight['params'], resumed['params'], 0.0)


class _Scalars:
  """A metric writer that keeps the scalars the loop writes: {step: {name: value}}."""

  def __init__(self):
    self.at = {}

  def write_scalars(self, step, scalars):
    self.at.setdefault(step, {}).update(scalars)

  def write_hparams(self, hparams):
    pass

  def flush(self):
    pass


def test_an_evaluation_failing_at_the_last_step_leaves_that_step_saved(
    idx_dir, tmp_path, monkeypatch, caplog):
  """An evaluation that fails (out of memory, its data) at a step due to be saved had left
  only the checkpoint before it; the step is saved on the way out, and the same command then
  evaluates the saved state, training nothing."""
  config = _config(idx_dir, total_steps=4, checkpoint_every_steps=2)
  real_evaluate = train.evaluate

  def failing(*args, **kwargs):
    raise RuntimeError('RESOURCE_EXHAUSTED: out of memory while evaluating')

  monkeypatch.setattr(train, 'evaluate', failing)
  with pytest.raises(RuntimeError,
                     match='out of memory while evaluating'), caplog.at_level(logging.WARNING):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['2', '4']
  assert 'Saved step 4 before stopping on the error below' in caplog.text
  caplog.clear()
  assert not os.path.exists(tmp_path / 'run' / 'final.npz')
  monkeypatch.setattr(train, 'evaluate', real_evaluate)
  with caplog.at_level(logging.INFO):
    out = train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert out['step'] == 4 and 0 <= out['accuracy'] <= 1
  assert os.path.exists(tmp_path / 'run' / 'final.npz')
  assert 'Compiled the train step' not in caplog.text  # nothing trained again


def test_a_finished_run_taken_further_sets_its_final_npz_aside(idx_dir, tmp_path, caplog):
  """Extended to more steps and stopped part-way, the run had left the earlier final.npz,
  which vit-evaluate and vit-predict then took for this run's parameters, with exit 0."""
  run = str(tmp_path / 'run')
  train.train_and_evaluate(_config(idx_dir, total_steps=2), run)
  earlier = np.load(os.path.join(run, 'final.npz'))['head/bias']
  longer = _config(idx_dir, total_steps=4, checkpoint_every_steps=1, resume_changes='total_steps')
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(longer, run, stop_after_steps=3)
  assert not os.path.exists(os.path.join(run, 'final.npz'))  # not finished: no final.npz
  kept = os.path.join(run, 'final.step2.npz')
  np.testing.assert_array_equal(np.load(kept)['head/bias'], earlier)  # kept, not lost
  assert f'Renamed the final.npz of step 2 to {kept}: this run goes on past it' in caplog.text
  # The jump back up a new schedule is said: from base_lr (step 2 of 2, warm-up 1) to 3/4 of
  # it, a third of the way down the cosine from step 1 to step 4.
  assert longer.lr_decay == 'cosine'
  said = ("The learning-rate schedule is this config's, not the run's: step 3 trains at lr "
          f'{longer.base_lr * 0.75:.3g}, where step 2 trained at {longer.base_lr:.3g}')
  assert said in caplog.text, caplog.text
  train.train_and_evaluate(longer, run)
  assert os.path.exists(os.path.join(run, 'final.npz')) and os.path.exists(kept)


def test_final_npz_set_aside_under_its_own_step_and_never_over_another(idx_dir, tmp_path, caplog):
  """A finished run whose newest checkpoints are gone resumes from an older one: its
  final.npz had been renamed after the restored step (final.step2.npz holding step 4), an
  earlier final.step<N>.npz had been overwritten, and where the steps trained again gave the
  same parameters (resume is bit-identical) two copies of them were left."""
  run = str(tmp_path / 'run')
  config = _config(idx_dir, total_steps=4, checkpoint_every_steps=2)
  train.train_and_evaluate(config, run)
  final = os.path.join(run, 'final.npz')
  first = checkpoint.load_npz(final)
  shutil.rmtree(os.path.join(run, 'checkpoints', '4'))
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(config, run)
  kept = os.path.join(run, 'final.step4.npz')
  assert (f'Renamed the final.npz of step 4 to {kept}: this run resumed from step 2 and trains '
          f'its own') in caplog.text
  assert (f'Removed {kept}: the new {final} holds the same parameters, bit for bit'
          in caplog.text), caplog.text
  assert sorted(f for f in os.listdir(run) if f.startswith('final')) == ['final.npz']
  _assert_trees_close(checkpoint.load_npz(final), first, 0.0)
  # Other parameters in final.npz (a result this config does not give again) and a
  # final.step4.npz already there: both kept, neither replaced.
  other = jax.tree.map(lambda x: np.asarray(x) + 1, first)
  checkpoint.save_npz(final, other)
  shutil.copy(final, kept)
  shutil.rmtree(os.path.join(run, 'checkpoints', '4'))
  train.train_and_evaluate(config, run)
  assert sorted(f for f in os.listdir(run) if f.startswith('final')) == [
      'final.npz', 'final.step4.2.npz', 'final.step4.npz'
  ]
  for name in ('final.step4.2.npz', 'final.step4.npz'):
    _assert_trees_close(checkpoint.load_npz(os.path.join(run, name)), other, 0.0)
  _assert_trees_close(checkpoint.load_npz(final), first, 0.0)


def test_a_finished_run_started_again_evaluates_without_compiling_a_step(
    idx_dir, tmp_path, monkeypatch):
  """The README's command run again on a finished run prints its final line; it had
  compiled the train step and timed the CPU's peak a second time first (4 of 11 s)."""
  run = str(tmp_path / 'run')
  config = _config(idx_dir, total_steps=2)
  first = train.train_and_evaluate(config, run)
  exported = checkpoint.load_npz(os.path.join(run, 'final.npz'))

  def not_wanted(*args, **kwargs):
    raise AssertionError('a finished run compiled its train step')

  monkeypatch.setattr(train, '_fitting_train_step', not_wanted)
  monkeypatch.setattr(device_peaks, 'better_cpu_peak', not_wanted)
  again = train.train_and_evaluate(config, run)
  assert (again['step'], again['accuracy']) == (2, first['accuracy'])
  _assert_trees_close(checkpoint.load_npz(os.path.join(run, 'final.npz')), exported, 0.0)


def test_a_final_npz_without_checkpoints_is_not_trained_over(idx_dir, tmp_path):
  """Checkpoints deleted to free space: the same command had trained again from step 0 in
  silence and replaced final.npz (and config.json) with the new run's."""
  run = str(tmp_path / 'run')
  train.train_and_evaluate(_config(idx_dir, total_steps=2), run)
  files = {f: os.path.getmtime(os.path.join(run, f)) for f in ('final.npz', 'config.json')}
  shutil.rmtree(os.path.join(run, 'checkpoints'))
  final = os.path.join(run, 'final.npz')
  with pytest.raises(
      train.ConfigError,
      match=(f'^workdir {run} holds the final.npz of a finished run but no checkpoint of it in '
             f'{run}/checkpoints: training again from step 0 would replace it: use another '
             f'--workdir \\(or fine-tune from it with --config.pretrained_path={final}\\), '
             'or move final.npz out')):
    train.train_and_evaluate(_config(idx_dir, total_steps=2), run)
  assert {f: os.path.getmtime(os.path.join(run, f)) for f in files} == files
  assert not os.path.exists(os.path.join(run, 'lock'))


def test_a_run_whose_lock_is_taken_stops_before_it_saves(idx_dir, tmp_path, monkeypatch):
  """Its workdir deleted, or its lock removed by hand and a second run started there: the
  run had gone on saving (and removing old steps) beside the other, which then died on a
  checkpoint gone from under it."""
  run = str(tmp_path / 'run')
  real_save = checkpoint.save_train_state
  saved = []

  def save_then_lose_the_lock(manager, step, *args, **kwargs):
    real_save(manager, step, *args, **kwargs)
    saved.append(step)
    os.remove(os.path.join(run, 'lock'))

  monkeypatch.setattr(checkpoint, 'save_train_state', save_then_lose_the_lock)
  with pytest.raises(
      train.TrainingError,
      match=(f'^workdir {run}: its lock {run}/lock is gone \\(the workdir or the '
             'lock deleted\\?\\): this run stops without saving step 2; ')):
    train.train_and_evaluate(_config(idx_dir, total_steps=3, checkpoint_every_steps=1), run)
  assert saved == [1]
  with open(os.path.join(run, 'lock'), 'w') as f:  # another run's, alive: this host's pid 1
    json.dump({'host': socket.gethostname(), 'pid': 1, 'started': 'now'}, f)
  lock = rundir.WorkdirLock(run)
  lock.held = True
  assert lock.lost().startswith('its lock is now held by pid 1 on ')


def test_a_damaged_record_of_the_cpu_flags_is_said_and_written_again(idx_dir, tmp_path, caplog):
  """It had been chosen afresh in silence: a resume that may not be bit-identical."""
  run = str(tmp_path / 'run')
  train.train_and_evaluate(_config(idx_dir, total_steps=2), run)
  record = os.path.join(run, rundir.CPU_FLAGS_FILE)
  with open(record, 'w') as f:
    f.write('garbage\x00{')
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(_config(idx_dir, total_steps=3, resume_changes='total_steps'), run)
  assert f'The XLA:CPU flags this run started with are not readable in {record}' in caplog.text
  assert rundir.recorded_cpu_flags(run) == tuple(xla_cpu_flags.last_flags)


def test_fewshot_during_a_run_with_a_pre_logits_layer(idx_dir, tmp_path):
  """The paper's pre-training configs have one (representation_size): the first few-shot
  evaluation had died on its scope name, after the last step, leaving no final.npz."""
  config = _config(idx_dir, fewshot_every_steps=3, fewshot_shots=(1,), fewshot_seeds=(0,),
                   fewshot_datasets=(('fashion_mnist_local', 'train[:40]', 'test[:20]'),))
  config.model.representation_size = 8
  out = train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert 0 <= out['fewshot/fashion_mnist_local/1shot'] <= 1
  assert os.path.exists(tmp_path / 'run' / 'final.npz')


def test_a_run_over_an_undecodable_file_counts_its_skips_at_the_end(tmp_path, caplog):
  """The file is named once, but skipped on every pass: the run's end says how often, as
  TensorBoard's data/skipped_images does (the log had said '1 so far' alone)."""
  root = str(tmp_path / 'imgs')
  for split in ('train', 'test'):
    fx.write_folder(root, split, {'a': [1, 2, 3], 'b': [4, 5, 6]})
  fx.write_corrupt(os.path.join(root, 'train', 'a', 'bad.png'))
  fx.write_corrupt(os.path.join(root, 'test', 'b', 'bad.png'))
  config = _config(None, dataset='folder:' + root, batch_size=8, eval_batch_size=8, total_steps=4,
                   shuffle_buffer=7)
  scalars = _Scalars()
  with caplog.at_level(logging.INFO):
    train.train_and_evaluate(config, str(tmp_path / 'run'), writer=scalars)
  skips = scalars.at[4]['data/skipped_images']
  assert skips >= 4  # 32 images drawn from 7 records, one of them undecodable
  said = [
      r.getMessage() for r in caplog.records
      if r.levelno >= logging.WARNING and 'undecodable' in r.getMessage()
  ]
  assert len(said) == 3 and os.path.join(root, 'train', 'a', 'bad.png') in said[0]
  assert 'each skip counted in data/skipped_images' in said[0]
  # The evaluation's skip: named by its split, not counted in a training metric.
  assert said[1].startswith("Skipped 1 undecodable image(s) while reading split 'test' (1 so far")
  assert 'data/skipped_images' not in said[1]
  assert said[2] == (f'Skipped {skips} undecodable image(s) in all while training of 1 file(s), '
                     'named in the warnings above')
  # The accuracy's denominator says what it left out (it had said '6 examples' alone).
  assert re.search(
      r'step 4  test top-1 accuracy [\d.]+ \(6 examples; 1 undecodable image not counted\)$',
      caplog.text, re.M), caplog.text[-2000:]


def test_the_loop_reports_its_speed_and_traces_on_request(idx_dir, tmp_path, caplog):
  peak = 1e12  # given, so MFU is exact arithmetic on the reported step rate
  config = _config(idx_dir, peak_flops_per_device=peak, total_steps=4, profile_first_step=3,
                   profile_steps=1)
  scalars = _Scalars()
  with caplog.at_level(logging.INFO):
    out = train.train_and_evaluate(config, str(tmp_path / 'speed'), writer=scalars)
  first, second = scalars.at[1], scalars.at[2]
  assert first['compile_seconds'] > 0 and 'compile_seconds' not in second
  assert second['progress'] == pytest.approx(2 / 4)
  # The traced step is left out of the speed: its interval has none, the next one has.
  assert 'steps_per_sec' not in scalars.at[3] and 'steps_per_sec' in scalars.at[4]
  assert second['examples_seen'] == 2 * 16
  assert second['epoch'] == pytest.approx(2 * 16 / IDX_SIZES[0])
  assert second['core_hours'] > first['core_hours'] > 0
  assert second['img_per_sec_per_core'] == pytest.approx(second['steps_per_sec'] * 16
                                                         / jax.device_count())
  step_flops = 3 * 16 * flops.forward_flops('ViT-Ti_16', 28, 10, **config.model)
  assert second['mfu'] == pytest.approx(step_flops * second['steps_per_sec'] /
                                        (peak * jax.device_count()))
  assert all(s['data/skipped_images'] == 0 for s in scalars.at.values())
  n = sum(x.size for x in jax.tree.leaves(out['params']))
  assert (f'ViT-Ti_16 with hidden_size=64, mlp_dim=256, num_heads=2, num_layers=1, patch_size=7: '
          f'{n:,} parameters; ') in caplog.text
  assert 'Compiled the train step and ran step 1 in' in caplog.text
  assert 'MFU ' in caplog.text and 'epoch 0.33' in caplog.text
  assert glob.glob(str(tmp_path / 'speed' / 'profile' / '**' / '*.xplane.pb'), recursive=True)


def test_under_jemalloc_the_loop_waits_after_every_step_and_purges_after_evaluating(
    idx_dir, tmp_path, monkeypatch, caplog):
  # jemalloc stood in for (tests/test_host_memory.py has the real one): every step's
  # temporaries are back by the first reading after it.
  events = []

  def allocated(mallctl):
    del mallctl
    events.append('read')
    return 1000

  def mallctl(name, *args):
    del args
    events.append(name)
    return 0

  memory_analysis = jax.stages.Compiled.memory_analysis

  def analysed(self):
    events.append('memory_analysis')
    return memory_analysis(self)

  drop_traces = host_memory.drop_traces

  def dropping_traces():
    events.append('drop_traces')
    drop_traces()

  monkeypatch.setattr(host_memory, 'drop_traces', dropping_traces)
  monkeypatch.setattr(host_memory, '_jemalloc_mallctl', lambda: mallctl)
  monkeypatch.setattr(host_memory, '_allocated_bytes', allocated)
  monkeypatch.setattr(host_memory, 'MIN_TEMP_BYTES', 0)
  monkeypatch.setattr(jax.stages.Compiled, 'memory_analysis', analysed)
  with caplog.at_level(logging.INFO):
    _run(idx_dir, tmp_path, 'heap', total_steps=3, eval_every_steps=2)
  assert events.count('read') == 1 + 2 * 3  # stats readable; then before and after each step
  assert '(0 of 3 waits gave up)' in caplog.text
  # memory_analysis() leaves freed pages: the last purge before step 1 comes after it.
  start = events[:events.index('read', events.index('read') + 1)]
  assert start[-1] == b'arena.4096.purge', start
  assert 'memory_analysis' in start
  # The traces that built the step are dropped once it is compiled, before that purge.
  assert start.count('drop_traces') == 1
  assert start.index('drop_traces') > len(start) - 1 - start[::-1].index('memory_analysis')
  # Then before and after the evaluations of steps 2 and 3.
  assert [e for e in events[len(start):] if e != 'read'] == [b'arena.4096.purge'] * 4


def test_remat_gelu_follows_float32_and_says_when_dropout_keeps_the_gelu(
    idx_dir, tmp_path, data_parallel, caplog):
  with caplog.at_level(logging.INFO):
    gelu = _run(idx_dir, tmp_path, 'gelu', remat='gelu')
  assert "default scheduler" not in caplog.text and "remat 'gelu'" not in caplog.text
  _assert_trees_close(data_parallel['params'], gelu['params'], 1e-6)
  caplog.clear()
  _run(idx_dir, tmp_path, 'gelu_dropout', remat='gelu', stop_after_steps=0,
       **{'model.dropout_rate': 0.1})
  assert "remat 'gelu' recomputes nothing in training here" in caplog.text


def test_bfloat16_and_remat_follow_float32(idx_dir, tmp_path, data_parallel, caplog):
  with caplog.at_level(logging.INFO):
    remat = _run(idx_dir, tmp_path, 'remat', remat=True)
  assert "remat nothing_saveable: the step compiles with XLA:CPU's default scheduler" in caplog.text
  bf16 = _run(idx_dir, tmp_path, 'bf16', dtype='bfloat16')
  _assert_trees_close(data_parallel['params'], remat['params'], 1e-5)
  assert abs(data_parallel['loss'] - remat['loss']) < 1e-5
  assert abs(data_parallel['loss'] - bf16['loss']) < 0.05 * abs(data_parallel['loss'])
  assert data_parallel['loss'] != bf16['loss']  # the bf16 path really ran
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(bf16['params']))


def test_sigmoid_loss_with_negative_head_bias(idx_dir, tmp_path):
  out = _run(idx_dir, tmp_path, 'sigmoid', loss='sigmoid_xent', head_bias_init=-10.0, total_steps=2)
  # At init every sigmoid is ~e-10 off: the loss is ~ one positive class's -log(sigmoid(-10)).
  assert 5.0 < out['loss'] < 12.0
  np.testing.assert_allclose(
      step_lib.per_example_loss(np.array([[0.0, 0.0]], np.float32), np.array([1]), 'sigmoid_xent'),
      [2 * np.log(2.0)], rtol=1e-6)
  np.testing.assert_allclose(
      step_lib.per_example_loss(np.array([[0.0, np.log(3.0)]], np.float32), np.array([1]),
                                'softmax_xent'), [-np.log(0.75)], rtol=1e-6)


def test_multi_label_training_and_set_top1(tmp_path, caplog):
  """Training on mocked imagenet2012_real 'real_label' sets: multi-hot sigmoid targets, and
  top-1 counted correct when in the set (empty sets left out), as numpy recomputes it."""
  config = _config('', dataset='imagenet2012_real', label_key='real_label',
                   train_split='validation', eval_split='validation', loss='sigmoid_xent',
                   total_steps=2, accum_steps=2)
  with fx.mock_real(40), caplog.at_level(logging.INFO):
    out = train.train_and_evaluate(config, str(tmp_path / 'multi'))
  assert np.isfinite(out['loss'])
  images = np.stack([fx.id_image(i) for i in range(40)])
  images = np.repeat(images[..., None], 3, -1).astype(np.float32) / 127.5 - 1
  model = train.build_model(config, 1000)
  top1 = np.argmax(np.asarray(model.apply({'params': out['params']}, images, train=False)), -1)
  sets = [fx.label_set(i) for i in range(40)]
  used = [i for i in range(40) if sets[i]]
  assert len(used) == 38  # examples 0 and 32 have empty sets
  want = np.mean([top1[i] in sets[i] for i in used])
  assert out['accuracy'] == pytest.approx(want, abs=1e-6)
  assert f'validation top-1 accuracy {want:.4f} (38 examples)' in caplog.text
  # vit-evaluate on the finished run (its dataset is imagenet2012_real: the ReaL row): the
  # same rule, the same figure.
  from vit_jax import evaluate_cli  # pylint: disable=g-import-not-at-top
  cli = types.SimpleNamespace(workdir=str(tmp_path / 'multi'), checkpoint=None, dataset=None,
                              data_dir=None, eval_crop=None, mode='top1', train_split=None,
                              eval_split=None, batch_size=16, shots=['1'], seeds=['0'],
                              l2_reg=1024.0)
  with fx.mock_real(40):
    table = evaluate_cli.run(cli)
  assert table.splitlines()[1].split() == [
      'top1', 'validation', 'ReaL', f'{want:.4f}', '(38', 'images', 'with', 'a', 'ReaL', 'label)'
  ]


def test_imagenet_training_with_real_evaluation(idx_dir, tmp_path, caplog):
  """eval_real: a 1000-class run (mocked imagenet2012_real's single 'original_label') is also
  scored on the ReaL sets at each evaluation, as numpy recomputes it."""
  config = _config('', dataset='imagenet2012_real', label_key='original_label',
                   train_split='validation', eval_split='validation', total_steps=2, eval_real=True)
  with fx.mock_real(40), caplog.at_level(logging.INFO):
    out = train.train_and_evaluate(config, str(tmp_path / 'real'))
  images = np.stack([fx.id_image(i) for i in range(40)])
  images = np.repeat(images[..., None], 3, -1).astype(np.float32) / 127.5 - 1
  logits = train.build_model(config, 1000).apply({'params': out['params']}, images, train=False)
  top1 = np.argmax(np.asarray(logits), -1)
  assert out['accuracy'] == pytest.approx(np.mean(top1 == np.arange(40) % 7), abs=1e-6)
  used = [i for i in range(40) if fx.label_set(i)]
  want = np.mean([top1[i] in fx.label_set(i) for i in used])
  assert (out['real_accuracy'], out['real_examples']) == (pytest.approx(want, abs=1e-6), 38)
  assert f'ImageNet ReaL top-1 accuracy {want:.4f} (38 images with a ReaL label)' in caplog.text
  with fx.mock_real(40):  # the finished run, started again, reports ReaL again
    again = train.train_and_evaluate(config, str(tmp_path / 'real'))
  assert (again['real_accuracy'], again['real_examples']) == (out['real_accuracy'], 38)
  with pytest.raises(
      train.ConfigError, match='eval_real scores a head of the 1000 ImageNet '
      'classes, but this one has 10'):  # a 10-class run
    with fx.mock_real(40):
      train.train_and_evaluate(_config(idx_dir, eval_real=True), str(tmp_path / 'bad'))


def test_fine_tuning_starts_from_the_checkpoint(idx_dir, tmp_path):
  upstream = _run(idx_dir, tmp_path, 'upstream', image_size=28)
  path = str(tmp_path / 'upstream' / 'final.npz')
  assert os.path.exists(path)
  config = _config(idx_dir, pretrained_path=path, image_size=56, num_classes=10)
  start = train.train_and_evaluate(config, str(tmp_path / 'ft'), stop_after_steps=0)
  params = start['params']
  np.testing.assert_array_equal(params['embedding']['kernel'],
                                upstream['params']['embedding']['kernel'])
  assert params['Transformer']['posembed_input']['pos_embedding'].shape == (1, 65, 64)
  assert not np.any(np.asarray(params['head']['kernel']))


def test_fewshot_evaluation_runs_inside_training(idx_dir, tmp_path, caplog):
  started = []  # the log lines before on_start: vit-train opens train.INFO there
  with caplog.at_level(logging.INFO):
    out = train.train_and_evaluate(
        _config(idx_dir, total_steps=2,
                fewshot_every_steps=1, fewshot_shots=(1, 3), fewshot_seeds=(0, 1)),
        str(tmp_path / 'fewshot'), on_start=lambda: started.append(caplog.text))
  # The evaluator is made before the workdir, and described once the log is open.
  described = ('few-shot: fashion_mnist_local train -> test, 10-way, shots (1, 3), '
               'seeds (0, 1), l2_reg 1024, standardised')
  assert described not in started[0] and caplog.text.count(described) == 1, caplog.text[-3000:]
  keys = ('fewshot/fashion_mnist_local/1shot', 'fewshot/fashion_mnist_local/3shot',
          'fewshot/mean/1shot', 'fewshot/mean/3shot')
  assert set(k for k in out if k.startswith('fewshot/')) == set(keys)
  assert all(0.0 <= out[k] <= 1.0 for k in keys)
  assert (f'step 2  few-shot linear: fashion_mnist_local/1shot {out[keys[0]]:.4f}  '
          f'fashion_mnist_local/3shot {out[keys[1]]:.4f}  mean/1shot') in caplog.text


@pytest.mark.parametrize(
    'overrides,message',
    [
        (dict(image_size=30), 'image_size 30 is not divisible by patch size 7'),
        # It had said 'patch size 56', a number the user never set.
        ({
            'model.resnet_layers': (3, 4)
        },
         re.escape(
             'image_size 28 is not divisible by 56 pixels per token (patch size 7 on the ResNet stem of '
             'the hybrid, resnet_layers (3, 4), which divides by 8)')),
        (dict(batch_size=12), '^batch_size 12 must be a multiple of the 8 devices'),
        (dict(batch_size=24, accum_steps=2), '^batch_size 24 / accum_steps 2 must be a multiple of '
         'the 8 devices: set --config.batch_size, a smaller --config.accum_steps or another device '
         r'count \(XLA_FLAGS --xla_force_host_platform_device_count decides, not cpu_devices\)$'),
        (dict(accum_steps=3), '^accum_steps 3 must be >= 1 and divide batch_size 16'),
        (dict(prefetch=-1), '^prefetch -1 is negative: set --config.prefetch'),
        (dict(dtype='float16'), "dtype 'float16' is unknown"),
        (dict(warmup_steps=5), 'warmup_steps 5 >= total_steps 3'),
        (dict(vtab_task='clevr_cnt'), "vtab_task 'clevr_cnt' is not a VTAB-1k task"),
        (dict(polyak_decay=1.0), 'polyak_decay 1.0 is not in'),
        (dict(profile_steps=2), 'profile_first_step 0 / profile_steps 2: set'),
        (dict(profile_first_step=4,
              profile_steps=1), "profile_first_step 4 is after the run's last "
         'step 3, so nothing would be traced'),
        (dict(peak_flops_per_device=-1.0), 'peak_flops_per_device -1 is not a peak in FLOP/s'),
    ])
def test_bad_config_fails_at_start_up(idx_dir, tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    _run(idx_dir, tmp_path, 'bad', **overrides)
  assert not glob.glob(str(tmp_path / 'bad' / 'checkpoints' / '*'))


def test_a_bad_config_is_named_before_missing_data(tmp_path):
  """`--config=finetune:ViT-Z_16,cifar10` on a machine without CIFAR-10 named the data
  first; once the user had prepared it, the model. The model comes first now."""
  c = _config(str(tmp_path / 'no_data'), dataset='cifar10', model_name='ViT-Z_16')
  with pytest.raises(ValueError, match="^Unknown model 'ViT-Z_16'"):
    train.train_and_evaluate(c, str(tmp_path / 'bad'))
  c = _config(str(tmp_path / 'no_data'), dataset='cifar10')
  with pytest.raises(ValueError, match='^dataset cifar10 is not prepared'):
    train.train_and_evaluate(c, str(tmp_path / 'missing'))


def _main(args, env_extra=None, cwd=ROOT):
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2', **(env_extra or {}))
  return subprocess.run([sys.executable, '-m', 'vit_jax.main', *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)


def test_the_log_of_a_remote_workdir_goes_to_the_users_home(tmp_path):
  """--local_log_dir had defaulted to /tmp/vit_jax_logs: made by one user, the next user of
  the VM could not write there and their gs:// run stopped at start-up."""
  code = ('import sys; from vit_jax import main; '
          "main.parse_flags(['vit-train', '--config=quickstart', '--workdir=gs://b/w']); "
          "main._open_log('gs://b/w', main._log_dir('gs://b/w'), 'why'); "
          'print(main.logging.get_absl_handler().python_handler.stream.name)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       env=dict(os.environ, HOME=str(tmp_path)), cwd=ROOT, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().startswith(f'{tmp_path}/vit_jax_logs/train.'), out.stdout
  assert (tmp_path / 'vit_jax_logs' / 'train.INFO').exists()


def test_cpu_devices_come_from_the_config_unless_the_environment_sets_them():
  qs = quickstart.get_config()
  assert sharding.cpu_devices(qs, {}) == (2, '--config.cpu_devices=2')
  assert sharding.cpu_devices({}, {}) == (1, '--config.cpu_devices=1')  # a config from before it
  flag = '--xla_force_host_platform_device_count'
  n, why = sharding.cpu_devices(qs, {'XLA_FLAGS': f'--xla_cpu_enable_fast_math=false {flag}=8'})
  assert (n, why) == (None, f'XLA_FLAGS {flag} decides, not cpu_devices')
  n, why = sharding.cpu_devices(qs, {'JAX_NUM_CPU_DEVICES': '4'})
  assert (n, why) == (None, 'JAX_NUM_CPU_DEVICES=4 decides, not cpu_devices')
  for bad in (0, -2, True, 1.5):
    message = (rf'^cpu_devices {bad!r} must be a whole number >= 1: set --config.cpu_devices '
               r'\(1: the CPU is one device\)$')
    with pytest.raises(ValueError, match=message):
      sharding.cpu_devices({'cpu_devices': bad}, {})


def test_an_mfu_over_100_percent_times_the_cpu_peak_again(monkeypatch):
  rates = []  # the matmul's whole-process FLOP/s, one per timing
  monkeypatch.setattr(device_peaks.measure_cpu_peak, '__wrapped__', lambda dtype: rates.pop(0))
  n = jax.local_device_count()
  ticks = iter(range(1000))
  chrono = chrono_lib.Chrono(total_steps=10, global_batch=1, num_train_examples=0, num_devices=1,
                             flops_per_step=1.0, peak_flops_per_device=1e11,
                             clock=lambda: next(ticks))
  check = train._CpuPeakCheck(chrono, 'float32')
  assert check.checked({'mfu': 0.5}) == {'mfu': 0.5}  # not timed: nothing to pop
  rates.append(2e11 * n)
  speed = check.checked({'mfu': 1.5, 'img_per_sec_per_core': 7.0})
  assert speed == {'mfu': pytest.approx(0.75), 'img_per_sec_per_core': 7.0}
  assert chrono.peak_flops_per_device == pytest.approx(2e11) and not check.warned
  assert chrono._paused_since_last > 0  # the timing is not training time
  rates.append(1e11 * n)  # slower again: the better stays, and MFU still reads over
  assert check.checked({'mfu': 1.2}) == {'mfu': pytest.approx(1.2)} and check.warned
  rates.extend([9e11 * n] * 10)
  for _ in range(10):
    check.checked({'mfu': 1.2})
  assert len(rates) == 10 - (device_peaks.CPU_PEAK_RETIMES - 2)  # at most that many a run


def test_quickstart_command_end_to_end_shortened(idx_dir, tmp_path):
  workdir = str(tmp_path / 'quick')
  proc = _main([
      '--config=configs/quickstart.py', f'--workdir={workdir}', f'--config.data_dir={idx_dir}',
      '--config.total_steps=20', '--config.warmup_steps=5', '--config.batch_size=32',
      '--config.eval_every_steps=10', '--config.checkpoint_every_steps=10',
      '--config.profile_first_step=12', '--config.profile_steps=2'
  ])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'Final test top-1 accuracy' in proc.stderr
  profile = os.path.join(workdir, 'profile')
  assert f'Profiler trace of steps 12-13 in {profile}: view it with `xprof' in proc.stderr
  assert glob.glob(os.path.join(profile, 'plugins', 'profile', '*', '*.xplane.pb'))
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['10', '20']
  assert glob.glob(os.path.join(workdir, 'events.out.tfevents.*'))
  log = open(os.path.join(workdir, 'train.INFO')).read()
  assert 'step 20/20' in log and 'img/s/core' in log and 'ETA' in log and 'MFU' in log
  assert ('ViT-Ti_16 with hidden_size=64, mlp_dim=128, num_heads=4, num_layers=4, patch_size=7: '
          '145,290 parameters; ') in log and 'Compiled the train step' in log
  assert 'orbax' not in log  # library chatter is filtered out of the readable log
  assert proc.stderr.count('XLA:CPU flags for float32') == 1 and 'XLA:CPU flags for' in log
  # The CPU peak is timed before and after compiling; MFU takes the better (device_peaks).
  first = re.search(r'parameters; .* per step; peak ([\d.]+) GFLOP/s per device \(measured\)', log)
  again = re.search(
      r'peak ([\d.]+) GFLOP/s per device, timed again after compiling '
      r'\(([\d.]+) GFLOP/s before\): MFU takes the better', log)
  assert first and again and again.group(2) == first.group(1), log[:3000]
  assert float(again.group(1)) >= float(first.group(1))
  # The CPU flags the run started with are kept for its resumption (rundir.recorded_cpu_flags).
  assert rundir.recorded_cpu_flags(workdir) == xla_cpu_flags.FLAGS_BY_DTYPE['float32']
  assert rundir.recorded_cpu_flags(str(tmp_path / 'new')) is None
  params = checkpoint.load_npz(os.path.join(workdir, 'final.npz'))
  model = models.get_model('ViT-Ti_16', num_classes=10, patch_size=7, hidden_size=64, mlp_dim=128,
                           num_heads=4, num_layers=4)
  assert model.apply({'params': params}, np.zeros((1, 28, 28, 3), np.float32)).shape == (1, 10)


def test_a_config_field_given_as_a_flag_names_the_config_form(tmp_path):
  proc = _main(['--config=quickstart', f'--workdir={tmp_path / "w"}', '--batch_size=8'])
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].endswith(
      ": Unknown command line flag 'batch_size'; config fields are set as "
      '--config.batch_size=... (see --help)'), proc.stderr[-2000:]


@pytest.mark.parametrize('second', ['--config=quikstart', '--config quickstart'])
def test_a_second_config_flag_is_one_line(tmp_path, second):
  # absl would load the last one and leave the first's overrides on it: refused instead.
  proc = _main(['--config=quickstart', f'--workdir={tmp_path / "w"}', *second.split()])
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      f"vit-train: --config is given more than once ('quickstart', '{second[9:]}'): give one "
      'config and set its fields with --config.FIELD=VALUE (see --help)'), proc.stderr[-2000:]


def test_a_second_workdir_or_a_missing_flag_is_one_line(tmp_path):
  # absl had run in the last --workdir given, and named a flag left out in its own words.
  proc = _main(['--config=quickstart', '--workdir=w2', '--workdir', 'w3'], cwd=tmp_path)
  assert proc.stderr.strip().splitlines()[-1] == (
      "vit-train: --workdir is given more than once ('w2', 'w3'): give one (see --help)")
  proc = _main(['--config=quickstart'], cwd=tmp_path)
  assert proc.stderr.strip().splitlines()[-1] == (
      'vit-train: --workdir is required: pass --workdir=... (see --help)')
  assert proc.returncode == 1 and os.listdir(tmp_path) == []
  proc = _main([], cwd=tmp_path)  # both: absl's two sentences had been passed through
  assert proc.stderr.strip().splitlines()[-1] == (
      'vit-train: --config and --workdir are required: pass --config=... --workdir=... '
      '(see --help)')
  assert proc.returncode == 1 and os.listdir(tmp_path) == []


@pytest.mark.parametrize('override,expected', [
    ('batch_size=abc', 'an integer'),
    ('batch_size=1.5', 'an integer'),
    ('base_lr=x1', 'a number'),
    ('model.dropout_rate=', 'a number'),
    ('fsdp=maybe', 'true or false'),
])
def test_a_value_of_the_wrong_type_says_what_the_field_expects(tmp_path, override, expected):
  proc = _main(['--config=quickstart', f'--workdir={tmp_path / "w"}', f'--config.{override}'])
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      f'vit-train: flag --config.{override}: expected {expected} (see --help)'), proc.stderr[-2000:]


@pytest.mark.parametrize(
    'override,message',
    [
        ('image_size=30', 'image_size 30 is not divisible by patch size 7'),
        # Found at start-up, not at the first evaluation.
        ('eval_split=test[:0]', "eval_split 'test[:0]' of fashion_mnist_local holds no examples: "
         'choose another --config.eval_split'),
        # TFLOP/s typed where FLOP/s are asked for.
        ('peak_flops_per_device=275',
         'peak_flops_per_device 275 is not a peak in FLOP/s per device: '
         'set --config.peak_flops_per_device to FLOP/s (e.g. 2.75e14 for 275 TFLOP/s)'),
        # The quickstart's total_steps had won without a word: 2,000 steps, not 5 epochs.
        ('num_epochs=5', 'total_steps 2000 and num_epochs 5.0 both give the run its length: '
         'set --config.total_steps=-1 to train for num_epochs, or --config.num_epochs=-1 to '
         'train for total_steps'),
    ])
def test_cli_bad_override_is_one_line(idx_dir, tmp_path, override, message):
  proc = _main([
      '--config=configs/quickstart.py', f'--workdir={tmp_path / "w"}',
      f'--config.data_dir={idx_dir}', f'--config.{override}'
  ])
  assert proc.returncode != 0
  last_line = proc.stderr.strip().splitlines()[-1]
  assert last_line.startswith(f'vit-train: {message}'), last_line
  assert 'Traceback' not in proc.stderr


@pytest.mark.parametrize('dataset,line', [
    ('{tmp}/pets', "vit-train: dataset '{tmp}/pets' is a path: a folder of images "
     '(<dir>/<split>/<class>/<image>) is set as --config.dataset=folder:{tmp}/pets'),
    ('pets', "vit-train: dataset 'pets' is a path: a folder of images "
     '(<dir>/<split>/<class>/<image>) is set as --config.dataset=folder:pets'),
    ('folder:', 'vit-train: dataset folder: names no folder (an unset shell variable?): set '
     '--config.dataset=folder:<dir>, <dir> holding <split>/<class>/<image>'),
    ('folder:moved', 'vit-train: Folder dataset {tmp}/moved not found: set '
     '--config.dataset=folder:<dir> to where it is, <dir>/<split>/<class>/<image>'),
    ('folder:notes.txt', 'vit-train: Folder dataset {tmp}/notes.txt is a file: expected a folder '
     '<dir>/<split>/<class>/<image> (dataset=folder:<dir>).'),
])
def test_a_folder_dataset_given_otherwise_names_the_folder_form(tmp_path, dataset, line):
  """A path without 'folder:' had printed TFDS's 18-line help on builder names; 'folder:'
  alone read the current directory's subfolders as the splits."""
  (tmp_path / 'pets' / 'train' / 'cat').mkdir(parents=True)
  (tmp_path / 'notes.txt').write_text('not a folder\n')
  proc = _main(
      ['--config=quickstart', '--workdir=w', f'--config.dataset={dataset}'.format(tmp=tmp_path)],
      cwd=tmp_path)
  assert (proc.returncode,
          proc.stderr.strip().splitlines()[-1]) == (1,
                                                    line.format(tmp=tmp_path)), proc.stderr[-2000:]
  assert not (tmp_path / 'w').exists()


_TFDS_KINDS = "a TFDS name, 'folder:<dir>' or 'fashion_mnist_local'"


@pytest.mark.parametrize('dataset,line', [
    ('', f"dataset '' names no dataset (an unset shell variable?): set --config.dataset to "
     f'{_TFDS_KINDS}'),
    ('cifar-10', "dataset 'cifar-10' is not a TFDS name (TFDS reads name[/config][:version], "
     f'e.g. cifar10 or oxford_iiit_pet:3.*.*): set --config.dataset to {_TFDS_KINDS}'),
    ('cifar10 ', "dataset 'cifar10 ' is not a TFDS name (TFDS reads name[/config][:version], "
     f'e.g. cifar10 or oxford_iiit_pet:3.*.*): set --config.dataset to {_TFDS_KINDS}'),
    ('cifar10:9.9.9', "dataset 'cifar10:9.9.9' cannot be built by TFDS (Dataset cifar10 cannot "
     'be loaded at version 9.9.9, only: {cifar10}): set --config.dataset to a config and version the '
     'dataset has (tensorflow.org/datasets/catalog), or to its name alone'),
    ('mnist/foo', "dataset 'mnist/foo' cannot be built by TFDS (BuilderConfig foo not found with "
     'version {mnist}): set --config.dataset to a config and version the dataset has '
     '(tensorflow.org/datasets/catalog), or to its name alone'),
])
def test_a_dataset_name_tfds_refuses_is_one_line(tmp_path, dataset, line):
  """TFDS had printed its 18-line help on builder names for an empty or unparsable name,
  and a traceback (AssertionError) for a version the dataset does not have."""
  proc = _main(['--config=quickstart', '--workdir=w', f'--config.dataset={dataset}'], cwd=tmp_path)
  versions = {name: str(tfds.builder_cls(name).VERSION) for name in ('cifar10', 'mnist')}
  assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (
      1, f'vit-train: {line.format(**versions)}'), proc.stderr[-2000:]
  assert not (tmp_path / 'w').exists()


def test_a_config_size_that_is_not_the_split_is_named(idx_dir, tmp_path, caplog):
  """Table 3's configs give their dataset's num_train_examples: with a folder swapped in, the
  run had counted epochs (and derived 24 million steps) from ImageNet's 1,281,167 unsaid."""
  train_examples = IDX_SIZES[0]
  config = _config(idx_dir, num_train_examples=10 * train_examples, total_steps=-1, num_epochs=0.1,
                   eval_every_steps=0)
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  steps = -(-train_examples // 16)  # 0.1 of ten times the split, at batch 16
  assert (f"num_train_examples {10 * train_examples} is the config's, but train_split 'train' "
          f"of fashion_mnist_local holds {train_examples}: epochs count the config's, and "
          f'total_steps {steps} from num_epochs; set --config.num_train_examples=-1 to count '
          'the split') in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):  # the split's own number: no word
    train.train_and_evaluate(_config(idx_dir, num_train_examples=train_examples),
                             str(tmp_path / 'same'))
  assert "is the config's" not in caplog.text


def test_a_tfds_dataset_prepared_on_disk_trains_and_evaluates(tmp_path):
  """No other test reads a TFDS dataset from the files `tfds build` writes (mocks stand in).
  Here a cifar10 of 64 + 32 examples in a data_dir given relative, as a user types it, whose
  path holds a space and '[' (TFDS globs its shards: a workdir's '[' is refused for orbax's
  sake, a data_dir's need not be)."""
  fx.write_tfds_cifar10(str(tmp_path / 'my data[1]'), num_train=64, num_test=32)
  out = console_script('vit-train', tmp_path, '--config=quickstart', '--workdir=w',
                       '--config.dataset=cifar10', '--config.data_dir=my data[1]',
                       '--config.image_size=32', '--config.model.patch_size=8',
                       '--config.model.num_layers=1', '--config.total_steps=4',
                       '--config.warmup_steps=1', '--config.batch_size=16',
                       '--config.eval_batch_size=16', '--config.shuffle_buffer=64')
  assert out.returncode == 0, out.stderr[-2000:]
  last = (tmp_path / 'w' / 'train.INFO').read_text().splitlines()[-1]
  accuracy = re.search(r'Final test top-1 accuracy: (\d\.\d{4}) after 4 steps', last)
  assert accuracy, last
  out = console_script('vit-evaluate', tmp_path, '--workdir=w', '--mode=top1')
  assert out.returncode == 0, out.stderr[-2000:]
  assert re.search(rf'^top1 +test +{accuracy[1]}  \(32 images\)$', out.stdout, re.M), out.stdout


# Runs the module argv[1] as its command, as on a machine with a network: there TFDS fills an
# unprepared dataset's info (splits, sizes) from its own bucket's metadata, which these test
# hosts cannot reach. Here that metadata is the dataset_info.json in folder argv[2].
_AS_WITH_A_NETWORK = '''
import runpy, sys
from etils import epath
from tensorflow_datasets.core.utils import gcs_utils
module, bucket = sys.argv.pop(1), epath.Path(sys.argv.pop(1))
gcs_utils.gcs_dataset_info_files = lambda name: [bucket / 'dataset_info.json', bucket / 'features.json']
runpy.run_module(module, run_name='__main__')
'''


def test_a_data_dir_that_cannot_be_read_is_one_line_before_the_workdir(tmp_path):
  """A bucket this machine cannot read (TPU VM users keep their TFDS data in one) had ended
  vit-train in TFDS's traceback, 'RuntimeError: FailedPreconditionError: Failed to construct
  dataset ...'."""
  out = console_script('vit-train', tmp_path, '--config=quickstart', '--workdir=w',
                       '--config.dataset=cifar10', '--config.data_dir=gs://vit-jax-test/tfds',
                       **UNREACHABLE_GCS)
  assert out.returncode == 1, out.stderr[-2000:]
  last = out.stderr.splitlines()[-1]
  assert last.startswith('vit-train: cannot read data_dir gs://vit-jax-test/tfds: '), last
  assert 'Could not connect' in last and last.endswith(
      ": check the bucket name, this machine's network and its credentials (gcloud auth "
      'application-default login)'), last
  assert 'Traceback' not in out.stderr and not (tmp_path / 'w').exists()


def test_a_tfds_dataset_not_prepared_is_one_line_where_tfds_reaches_its_metadata(tmp_path):
  """Where TFDS reached its bucket (every user's machine), a dataset not prepared passed the
  start-up checks: the run made its workdir, then ended in a traceback ('could not find data
  in ...') instead of naming the command that prepares it."""
  fx.write_tfds_cifar10(str(tmp_path / 'elsewhere'), num_train=20, num_test=10)
  bucket = str(tmp_path / 'elsewhere' / 'cifar10' / '3.0.2')
  out = subprocess.run([
      sys.executable, '-c', _AS_WITH_A_NETWORK, 'vit_jax.main', bucket, '--config=quickstart',
      '--workdir=w', '--config.dataset=cifar10', '--config.data_dir=empty',
      '--config.image_size=32', '--config.model.patch_size=8'
  ], cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  assert out.stderr.splitlines()[-1] == (
      f'vit-train: dataset cifar10 is not prepared in data_dir {tmp_path}/empty: run '
      f'`vit-tfds-build cifar10 --data_dir={tmp_path}/empty` or set --config.data_dir to where '
      'it is prepared.'), out.stderr[-2000:]
  assert not (tmp_path / 'w').exists()
