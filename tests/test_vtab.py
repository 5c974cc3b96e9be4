"""vit_jax/vtab.py: the 7 derived VTAB-1k labels against task_adaptation's definitions, on
hand-made features and on TFDS mock examples read by the input pipeline; launch/vtab.py."""
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow_datasets.testing import mocking

from tests import data_fixtures
from tests.conftest import console_script
from vit_jax import configs
from vit_jax import data_sources
from vit_jax import input_pipeline
from vit_jax import rundir
from vit_jax import vtab
from vit_jax.configs import finetune
from vit_jax.launch import vtab as vtab_launch

NUM_EXAMPLES = 24


def reference_label(task, ex):
  """The label of a numpy example as google-research/task_adaptation defines it, restated
  here from its data/*.py independently of vit_jax/vtab.py."""

  def last_below(thresholds, value):  # reduce_max(where(thresholds - value < 0))
    return max(i for i, t in enumerate(thresholds) if t < value)

  objects = ex.get('objects')
  if task == 'clevr_count':  # clevr.py _count_preprocess_fn
    return len(objects['size']) - 3
  if task == 'clevr_distance':  # clevr.py _closest_object_preprocess_fn
    return last_below([0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0], objects['pixel_coords'][:, 2].min())
  if task == 'kitti_distance':  # kitti.py _closest_vehicle_distance_pp
    z = [loc[2] for loc, kind in zip(objects['location'], objects['type']) if kind in (0, 1, 2)
        ]  # Car, Van, Truck.
    return last_below([-100.0, 8.0, 20.0, 999.0], min(z + [1000.0]))
  if task == 'dsprites_location':  # dsprites.py, label_x_position, num_classes=16
    return int(np.float32(ex['label_x_position']) // np.float32(32 / 16))
  if task == 'dsprites_orientation':  # dsprites.py, label_orientation, num_classes=16
    return int(np.float32(ex['label_orientation']) // np.float32(40 / 16))
  if task == 'smallnorb_azimuth':  # smallnorb.py, predicted_attribute
    return int(ex['label_azimuth'])
  if task == 'smallnorb_elevation':
    return int(ex['label_elevation'])
  raise AssertionError(task)


def _objects(**columns):
  return {
      k: np.asarray(v, np.float32 if k in ('pixel_coords', 'location') else np.int64)
      for k, v in columns.items()
  }


def hand_made(task):
  """Examples that reach every class and sit on each side of every threshold."""
  if task == 'clevr_count':  # CLEVR scenes hold 3 to 10 objects.
    return [{
        'objects': _objects(size=[0] * n, pixel_coords=[[0, 0, 9.0]] * n)
    } for n in range(3, 11)]
  if task == 'clevr_distance':
    depths = [0.5, 40.0] + [t + d for t in (8.0, 8.5, 9.0, 9.5, 10.0) for d in (-0.01, 0, 0.01)]
    return [{
        'objects': _objects(size=[0, 1], pixel_coords=[[1, 2, d], [3, 4, d + 0.25]])
    } for d in depths]
  if task == 'kitti_distance':
    rows = []
    for z in (-99.0, 998.0) + tuple(t + d for t in (8.0, 20.0) for d in (-0.01, 0, 0.01)):
      # A pedestrian (3) nearer than the vehicle must not count; types 0-2 are vehicles.
      for kind in (0, 1, 2):
        rows.append({
            'objects': _objects(type=[3, kind, 6], location=[[0, 0, z / 2], [1, 1, z],
                                                             [0, 0, z + 1]])
        })
    rows.append({'objects': _objects(type=[3, 4, 5, 6, 7], location=[[0, 0, 5.0]] * 5)})
    rows.append({'objects': _objects(type=np.zeros([0]), location=np.zeros([0, 3]))})
    return rows
  if task == 'dsprites_location':
    return [{
        'label_x_position': np.int64(x),
        'image': np.zeros([2, 2, 1], np.uint8)
    } for x in range(32)]
  if task == 'dsprites_orientation':
    return [{
        'label_orientation': np.int64(x),
        'image': np.zeros([2, 2, 1], np.uint8)
    } for x in range(40)]
  feature, classes = {
      'smallnorb_azimuth': ('label_azimuth', 18),
      'smallnorb_elevation': ('label_elevation', 9)
  }[task]
  return [{feature: np.int64(x)} for x in range(classes)]


@pytest.mark.parametrize('task', vtab.DERIVED_LABEL_TASKS)
def test_derived_label_of_hand_made_features(task):
  examples = hand_made(task)
  want = [reference_label(task, ex) for ex in examples]
  got = []
  for ex in examples:
    features = tf.nest.map_structure(tf.constant, dict(ex, image=ex.get('image', b'')))
    out = vtab.example(task, features)
    assert out['label'].dtype == tf.int32
    got.append(int(out['label']))
  assert got == want
  classes = vtab.VTAB[task].num_classes
  assert sorted(set(got)) == list(range(classes))  # Every class, none outside.
  assert len(vtab.class_names(task)) == classes


def test_table():
  assert len(vtab.VTAB) == 19 and sorted(vtab.DERIVED_LABEL_TASKS) == sorted(
      t for t, row in vtab.VTAB.items()
      if row.tfds_name in ('clevr', 'dsprites', 'kitti', 'smallnorb'))
  assert [len(vtab.task_names(g)) for g in vtab.GROUPS] == [7, 4, 8]  # Figure 2 of the paper.
  assert sum(len(vtab.task_names(g)) for g in vtab.GROUPS) == len(vtab.task_names())
  for row in vtab.VTAB.values():  # train800 + val200 = 1000 examples.
    start, stop = re.fullmatch(r'\w+\[(\d*):(\d+)\]', row.val200).groups()
    assert row.train800 == 'train[:800]' and int(stop) - int(start or 0) == 200
  with pytest.raises(ValueError, match="vtab_task 'dmlab' has no derived label"):
    vtab.example('dmlab', {'image': tf.constant(b'')})


# ------------------------------------------------------------- TFDS mock examples
def _common_length(sequence, length):
  """Every column of a Sequence({...}) example cut or repeated to `length` rows (TFDS mock
  data draws each column's length on its own, which encoding refuses)."""
  return {k: np.resize(v, (length,) + np.shape(v)[1:]) for k, v in sequence.items()}


def _clevr(i, ex, rng):
  objects = _common_length(ex['objects'], 3 + i % 8)  # CLEVR: 3 to 10 objects.
  objects['pixel_coords'][:, 2] = rng.uniform(7.5, 10.5, len(objects['size']))
  return dict(ex, objects=objects, question_answer={'question': ['?'], 'answer': ['!']})


def _kitti(i, ex, rng):
  objects = _common_length(ex['objects'], i % 5)
  objects['location'][:, 2] = rng.uniform(-1, 30, len(objects['type']))
  objects['bbox'] = np.sort(objects['bbox'].reshape(-1, 2, 2), axis=1).reshape(-1, 4)  # min <= max
  return dict(ex, objects=objects)


def _arrays(tree):
  """An encoded example's lists (of arrays, of 0-d text arrays) as plain arrays, as
  tf.data.Dataset.from_generator takes them."""
  if isinstance(tree, dict):
    return {k: _arrays(v) for k, v in tree.items()}
  array = np.asarray(tree)
  if array.dtype == object:
    array = np.array([np.asarray(x).item() for x in array.ravel()], object).reshape(array.shape)
  return array


def _mock_as_dataset(edit):
  """A TFDS `_as_dataset` that encodes the mock examples of the builder's real features
  after `edit(i, example, rng)` and decodes them as TFDS does, decoders included."""

  def as_dataset(self, split, decoders=None, read_config=None, **kwargs):
    del split, read_config, kwargs
    features = self.info.features

    def generate():
      rng = np.random.default_rng(0)
      for i, ex in enumerate(mocking.RandomFakeGenerator(features, NUM_EXAMPLES)):
        yield _arrays(features.encode_example(edit(i, ex, rng)))

    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype),
                                 features.get_serialized_info())
    ds = tf.data.Dataset.from_generator(generate, output_signature=spec)
    return ds.map(functools.partial(features.decode_example, decoders=decoders))

  return as_dataset


MOCKS = {  # task -> mock_data arguments
    'clevr': dict(as_dataset_fn=_mock_as_dataset(_clevr)),
    'kitti': dict(as_dataset_fn=_mock_as_dataset(_kitti)),
    'dsprites': dict(max_value=2),  # dSprites pixels are 0 or 1.
    'smallnorb': {},
}


@pytest.mark.parametrize('task', vtab.DERIVED_LABEL_TASKS)
def test_derived_label_through_the_input_pipeline(task):
  """The labels eval_batches yields for a finetune.py row are the reference ones of the
  same mock examples, read whole by TFDS."""
  c = finetune.get_config(f'ViT-B_16,vtab/{task}')
  c.train_split = c.eval_split = 'train'
  c.image_size = 64 if task.startswith('dsprites') else 16  # dSprites: no resampling.
  with tfds.testing.mock_data(num_examples=NUM_EXAMPLES, **MOCKS[c.dataset]):
    data_sources.clear_cache()
    info = input_pipeline.get_info(c)
    batches = list(input_pipeline.eval_batches(c, global_batch=8))
    raw = list(tfds.as_numpy(tfds.builder(c.dataset).as_dataset(split='train')))
  data_sources.clear_cache()
  assert (info.num_classes, info.num_eval_examples) == (c.num_classes, NUM_EXAMPLES)
  labels = np.concatenate([b['label'][b['mask']] for b in batches])
  want = [reference_label(task, ex) for ex in raw]
  np.testing.assert_array_equal(labels, want)
  assert labels.min() >= 0 and labels.max() < c.num_classes
  if task.startswith('dsprites'):  # 0/1 pixels scaled to 0/255, as task_adaptation does.
    images = np.concatenate([b['image'][b['mask']] for b in batches])
    pixels = np.stack([ex['image'] for ex in raw]).astype(np.float32) * 255
    np.testing.assert_allclose(images, np.broadcast_to(pixels / 127.5 - 1, images.shape), atol=1e-6)
    assert {-1.0, 1.0} <= set(np.unique(images))


def test_other_dataset_of_a_derived_task_config_keeps_its_labels():
  """A few-shot evaluator reads another dataset with the run's config: its own labels."""
  assert vtab.derives_label('clevr_count', 'clevr') and vtab.derives_label(
      'kitti_distance', 'kitti:3.1.0')
  assert not vtab.derives_label('clevr_count', 'dmlab') and not vtab.derives_label('dmlab', 'dmlab')
  c = finetune.get_config('ViT-B_16,vtab/clevr_count')
  c.dataset, c.train_split, c.eval_split, c.image_size = 'dmlab', 'train', 'train', 16
  with tfds.testing.mock_data(num_examples=8):
    data_sources.clear_cache()
    info = input_pipeline.get_info(c)
    labels = np.concatenate([b['label'] for b in input_pipeline.eval_batches(c, global_batch=8)])
    raw = [ex['label'] for ex in tfds.as_numpy(tfds.builder('dmlab').as_dataset(split='train'))]
  data_sources.clear_cache()
  assert info.num_classes == 6 and list(labels) == raw


# ------------------------------------------------------------------- launch/vtab.py
# The processes of a runner test see TFDS mock data: Python imports sitecustomize from
# PYTHONPATH at start-up, and this one enters tfds.testing.mock_data for the whole process.
MOCK_SITECUSTOMIZE = """
import os
if os.environ.get('VIT_TEST_TFDS_MOCK_EXAMPLES'):
  import tensorflow_datasets as tfds
  MOCK = tfds.testing.mock_data(  # Kept: collecting it would end the mock.
      num_examples=int(os.environ['VIT_TEST_TFDS_MOCK_EXAMPLES']), max_value=2)
  MOCK.__enter__()
"""
TINY = [
    '--config.image_size=32', '--config.total_steps=2', '--config.warmup_steps=1',
    '--config.batch_size=8', '--config.eval_batch_size=8', '--config.log_every_steps=1',
    '--config.shuffle_buffer=8', '--config.train_split=train', '--config.eval_split=test'
]  # VTAB slices pass 16 examples.
# A natural task and two structured ones; the two dSprites tasks have the same inputs and
# classes, so the second runs the first's programs from the run's compilation cache.
RUN_TASKS = ('dtd', 'dsprites_location', 'dsprites_orientation')


def _vtab_shell(command, cwd, shim):
  env = dict(os.environ, PYTHONPATH=str(shim), VIT_TEST_TFDS_MOCK_EXAMPLES='16',
             XLA_FLAGS='--xla_force_host_platform_device_count=1')
  return subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=600)


def test_vtab_runner_on_mock_tasks(tmp_path):
  """Three tasks run from a shell with a relative workdir, the same command again skips
  them, and the tables hold each run's final accuracy and the means of those."""
  shim = tmp_path / 'shim'
  shim.mkdir()
  (shim / 'sitecustomize.py').write_text(MOCK_SITECUSTOMIZE)
  # Fine-tuned from a file, as VTAB runs are (it stands in for the published checkpoint), of
  # one block, which each task's run compiles in less time than 12.
  data_fixtures.write_published(tmp_path / 'ViT-Ti_16.npz', 'ViT-Ti_16', num_layers=1)
  command = shlex.join([
      sys.executable, '-m', 'vit_jax.launch.vtab', '--model=ViT-Ti_16', '--workdir=runs/vtab',
      f'--tasks={",".join(RUN_TASKS)}', *TINY, '--config.model.num_layers=1',
      f'--config.pretrained_path={tmp_path}/ViT-Ti_16.npz'
  ])
  first = _vtab_shell(command, tmp_path, shim)
  assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
  workdir = tmp_path / 'runs' / 'vtab'
  finals = {}
  for task in RUN_TASKS:
    assert (workdir / task / 'final.npz').exists()
    log = (workdir / task / 'vtab.log').read_text()
    assert 'ViT-Ti_16 with num_layers=1: ' in log  # a field the finetune config does not list
    finals[task] = float(re.findall(r'Final test top-1 accuracy[^0-9]*([0-9.]+)', log)[-1])
  with open(workdir / 'vtab_results.json') as f:
    results = json.load(f)
  rows = {r['task']: r for r in results['tasks']}
  assert list(rows) == list(RUN_TASKS)
  for task in RUN_TASKS:
    assert rows[task]['accuracy'] == pytest.approx(finals[task], abs=1e-4)
    assert (rows[task]['steps'], rows[task]['status'],
            rows[task]['group']) == (2, 'ok', vtab.VTAB[task].group)
  structured = [finals['dsprites_location'], finals['dsprites_orientation']]
  m = results['means']
  assert m['natural'] == {'mean': pytest.approx(finals['dtd'], abs=1e-4), 'tasks': 1, 'of': 1}
  assert m['specialized'] == {'mean': None, 'tasks': 0, 'of': 0}
  assert m['structured']['mean'] == pytest.approx(np.mean(structured), abs=1e-4)
  assert m['overall']['mean'] == pytest.approx(np.mean(list(finals.values())), abs=1e-4)
  md = (workdir / 'vtab_results.md').read_text()
  assert f'| natural | dtd | {100 * rows["dtd"]["accuracy"]:.2f} | 2 | ok |' in md
  assert f'{100 * m["overall"]["mean"]:.2f} (3 of 19)' in md

  # Again: finished tasks are skipped, an unfinished one (no final.npz) resumes.
  (workdir / 'dtd' / 'final.npz').unlink()
  again = _vtab_shell(command, tmp_path, shim)
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.count('final.npz present, skipped') == 2
  assert 'Resuming from the checkpoint of step 2' in (workdir / 'dtd' / 'vtab.log').read_text()
  with open(workdir / 'vtab_results.json') as f:
    assert json.load(f)['means'] == results['means']


def test_vtab_runner_dry_run_and_bad_arguments(capsys):
  vtab_launch.main(
      ['--model=ViT-B_16', '--workdir=/tmp/v', '--dry-run', '--config.total_steps=500'])
  lines = capsys.readouterr().out.splitlines()
  assert [shlex.split(line) for line in lines] == [[
      sys.executable, '-P', '-m', 'vit_jax.main', f'--config=finetune:ViT-B_16,vtab/{t}',
      f'--workdir=/tmp/v/{t}', '--config.total_steps=500'
  ] for t in vtab.VTAB]
  for argv, message in [(['--tasks=dtd,nope'], 'nope is not a VTAB-1k task'),
                        (['--tasks=dtd,cifar,nope'], 'cifar, nope are not VTAB-1k tasks (did '
                         'you mean cifar100?)'),
                        (['--config.total_stepz=1'], "no field 'total_stepz'"),
                        (['--bogus'], "unknown argument '--bogus'"),
                        (['--config.total_steps=abc'], 'flag --config.total_steps=abc: expected '
                         'an integer'),
                        (['--tasks=svhn,dtd', '--config.batch_size=0'], 'task dtd: preflight '
                         '(devices not checked): batch_size 0 must be > 0')]:
    with pytest.raises(SystemExit) as e:
      vtab_launch.main(['--model=ViT-B_16', '--workdir=/tmp/v', '--dry-run', *argv])
    assert message in str(e.value) and '\n' not in str(e.value)


@pytest.mark.parametrize('sig, says', [('SIGINT', 'interrupted (Ctrl-C)'),
                                       ('SIGTERM', 'stopped (SIGTERM)'),
                                       ('SIGHUP', 'the terminal closed (SIGHUP)')])
def test_a_stop_signal_stops_the_tasks_with_one_line(tmp_path, capsys, monkeypatch, sig, says):
  """Ctrl-C printed a traceback; SIGTERM and SIGHUP killed vit-vtab at once (its task's run
  left behind). (sweep.run_local, which runs a task, passes SIGTERM and SIGHUP on and lets
  the task's run save and exit first: tests/test_sweep.py.)"""
  monkeypatch.setattr(vtab_launch.sweep, 'check_data', lambda *args, **kwargs: None)  # no data
  ran = []

  def runner(argv, log_path):
    del log_path
    ran.append(argv)
    if len(ran) == 2:
      os.kill(os.getpid(), getattr(signal, sig))  # raised here, as in run_local's wait
      time.sleep(5)
    return 0

  before = signal.getsignal(signal.SIGTERM)
  # As in a terminal: a suite started in the background ignores Ctrl-C, one under nohup SIGHUP.
  hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
  ctrl_c = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(SystemExit) as e:
      vtab_launch.main(['--model=ViT-B_16', f'--workdir={tmp_path}/v', '--tasks=dtd,svhn,eurosat'],
                       runner=runner)
  finally:
    signal.signal(signal.SIGHUP, hup)
    signal.signal(signal.SIGINT, ctrl_c)
  assert e.value.code == 128 + getattr(signal, sig) and len(ran) == 2
  assert signal.getsignal(signal.SIGTERM) == before  # given back
  assert capsys.readouterr().err.strip().splitlines() == [
      f"vit-vtab: {says} at task 2/3, svhn (its run's last line above says what it "
      'saved): run the same command to resume the tasks: finished ones are skipped, this one '
      'resumes from its last checkpoint'
  ]


def test_the_tasks_stop_at_the_first_whose_jax_backend_cannot_start(tmp_path, monkeypatch):
  """A TPU another process holds (or JAX_PLATFORMS naming a runtime not installed): every
  task had failed in turn with the same line."""
  monkeypatch.setattr(vtab_launch.sweep, 'check_data', lambda *args, **kwargs: None)  # no data
  held = ('vit-train: JAX cannot start the TPU (The TPU is already in use by process with pid '
          '42): wait for that process to end, or stop it (another vit-train on this VM?)')
  ran = []

  def runner(argv, log_path):
    ran.append(argv)
    with open(log_path, 'a') as log:
      log.write(f'== {argv}\n{held}\n')
    return 1

  with pytest.raises(SystemExit) as e:
    vtab_launch.main(['--model=ViT-B_16', f'--workdir={tmp_path}/v', '--tasks=dtd,svhn,eurosat'],
                     runner=runner)
  assert len(ran) == 1
  assert str(e.value) == ('vit-vtab: error: task dtd: ' + held.removeprefix('vit-train: ')
                          + ' (stopped here: the later tasks would fail the same way)')


@pytest.mark.parametrize('mode', [[], ['--dry-run'], ['--summarize-only']])
def test_a_task_run_of_another_model_is_refused(tmp_path, monkeypatch, mode):
  """A workdir reused for a second model: its finished tasks were skipped and the first
  model's accuracies reported under the second's name, exit 0."""
  monkeypatch.setattr(vtab_launch.sweep, 'check_data', lambda *args, **kwargs: None)  # no data
  (tmp_path / 'v' / 'dtd').mkdir(parents=True)
  (tmp_path / 'v' / 'dtd' / 'config.json').write_text(json.dumps({'model_name': 'ViT-Ti_16'}))
  (tmp_path / 'v' / 'dtd' / 'final.npz').write_bytes(b'')

  def runner(argv, log_path):
    raise AssertionError(f'a task ran: {argv}')

  with pytest.raises(SystemExit) as e:
    vtab_launch.main(['--model=ViT-B_16', f'--workdir={tmp_path}/v', '--tasks=svhn,dtd', *mode],
                     runner=runner)
  assert str(e.value) == (
      f'vit-vtab: error: {tmp_path}/v/dtd holds a run of ViT-Ti_16, not of --model=ViT-B_16: '
      'use another --workdir for ViT-B_16 (--model=ViT-Ti_16 summarizes that one)')


def test_a_finished_task_of_other_flags_is_refused(tmp_path, monkeypatch, capsys):
  """A finished task is skipped and its accuracy reported under this command's flags: one run
  with another --config.base_lr had been reported as this one's, exit 0."""
  monkeypatch.setattr(vtab_launch.sweep, 'check_data', lambda *args, **kwargs: None)  # no data
  monkeypatch.chdir(tmp_path)
  config = configs.load(vtab_launch.task_config('ViT-B_16', 'dtd', False), [])
  os.makedirs('v/dtd')
  rundir.write_config(rundir.with_absolute_paths(config), 'v/dtd')  # as vit-train writes it
  (tmp_path / 'v' / 'dtd' / 'final.npz').write_bytes(b'')
  argv = ['--model=ViT-B_16', '--workdir=v', '--tasks=dtd', '--dry-run']
  vtab_launch.main(argv)  # the same flags: skipped
  assert capsys.readouterr().out.startswith('# final.npz present, skipped: ')
  for mode in ('--dry-run', '--summarize-only', None):  # None: a run
    flags = [a for a in argv if a != '--dry-run'] + ([mode] if mode else [])
    with pytest.raises(SystemExit) as e:
      vtab_launch.main([*flags, f'--config.base_lr={config.base_lr * 10}'])
    assert str(e.value).startswith(
        f'vit-vtab: error: task dtd: workdir v/dtd holds a run with another config (base_lr '
        f'{config.base_lr!r} -> {config.base_lr * 10!r}): to go on with that run, pass its '
        f'value (--config.base_lr={config.base_lr!r})'), e.value
  # A summary with --dev would have called the test split's accuracy the val200 one's.
  with pytest.raises(SystemExit, match='task dtd: workdir v/dtd holds a run with another '):
    vtab_launch.main([*argv[:-1], '--summarize-only', '--dev'])
  assert not os.path.exists('v/vtab_results.md')
  vtab_launch.main([*argv[:-1], '--summarize-only'])
  assert '| natural | dtd | - | - | done |' in capsys.readouterr().out


def test_the_table_tells_finished_started_and_unstarted_tasks_apart(tmp_path):
  """A task never started had been 'not finished', as one stopped part-way."""
  (tmp_path / 'dtd').mkdir()
  (tmp_path / 'dtd' / 'final.npz').write_bytes(b'')
  (tmp_path / 'svhn' / 'checkpoints').mkdir(parents=True)
  rows = vtab_launch.collect(str(tmp_path), ['dtd', 'svhn', 'eurosat'])
  assert [r['status'] for r in rows] == ['done', 'not finished', 'not run']


@pytest.mark.parametrize('dry_run', [True, False])
def test_a_workdir_that_is_a_file_stops_before_the_first_task(tmp_path, dry_run):
  # dtd is not prepared here either: the workdir is named first (the data had been, and once
  # built, the workdir stopped the run next).
  (tmp_path / 'afile').write_text('')
  ran = []
  with pytest.raises(SystemExit) as e:
    vtab_launch.main(['--model=ViT-B_16', f'--workdir={tmp_path}/afile', '--tasks=dtd']
                     + ['--dry-run'] * dry_run, runner=lambda argv, log: ran.append(argv) or 0)
  assert str(e.value).startswith('vit-vtab: error: ') and not ran
  assert f'{tmp_path}/afile is not a directory: choose ' in str(e.value)


@pytest.mark.parametrize(
    'argv,message',
    [
        (['--model=ViT-B16', '--dry-run'
         ], "--model 'ViT-B16' is not a model of vit_jax.models: did "
         'you mean ViT-B_16'),
        (['--model=ViT-B_16', '--tasks=', '--dry-run'], "--tasks '' names no task"),
        (['--model=ViT-B_16', '--tasks= , ', '--dry-run'], "--tasks ' , ' names no task"),
        (['--model=ViT-B_16', '--tasks=dtdd', '--dry-run'], 'dtdd is not a VTAB-1k task (did you '
         'mean dtd?)'),
        (['--model=ViT-B_16', '--tasks=DTD', '--dry-run'], 'DTD is not a VTAB-1k task (did you '
         'mean dtd?)'),
        (['--model=ViT-B_16', '--summarize-only'], 'nothing to summarize in vt: it does not exist; '
         'run without --summarize-only first'),
        # It had trained every task on CIFAR-10 and reported that under the VTAB tasks' names.
        (['--model=ViT-B_16', '--dry-run', '--config.dataset=cifar10'
         ], '--config.dataset is set by '
         'each task from its VTAB definition: leave it out; vit-train --config=finetune:MODEL,'
         'vtab/TASK --config.dataset=... runs one task on other data'),
        (['--model=ViT-B_16', '--config.model_name=ViT-L_16'], '--config.model_name: vit-vtab '
         'takes the model as --model=NAME'),
        (['--model=ViT-B_16', '--config.num_classes=10'], '--config.num_classes is set by each '
         'task from its VTAB definition: leave it out'),
        # argparse and ml_collections had taken the last value.
        (['--model=ViT-B_16', '--tasks=dtd', '--tasks', 'svhn', '--dry-run'
         ], "--tasks is given more than once ('dtd', 'svhn'): give one, its values "
         'comma-separated'),
        (['--model=ViT-B_16', '--model=ViT-L_16', '--dry-run'
         ], "--model is given more than once ('ViT-B_16', 'ViT-L_16'): give one"),
        ([
            '--model=ViT-B_16', '--tasks=dtd', '--config.base_lr=0.1', '--config.base_lr=0.2',
            '--dry-run'
        ], "--config.base_lr is given more than once ('0.1', '0.2'): give one"),
    ])
def test_vtab_bad_arguments_from_the_command_line(tmp_path, argv, message):
  """Refused before any task starts or any file is written: one line, exit 1."""
  p = console_script('vit-vtab', tmp_path, '--workdir=vt', *argv)
  assert p.returncode == 1 and p.stdout == '', p.stdout + p.stderr
  [line] = [l for l in p.stderr.splitlines() if l.startswith('vit-vtab: ')]
  assert line.startswith('vit-vtab: error: ') and message in line, p.stderr
  assert 'Traceback' not in p.stderr and os.listdir(tmp_path) == []


@pytest.mark.parametrize('dry_run', [True, False])
@pytest.mark.parametrize(
    'workdir, message',
    [
        # `--workdir=$DIR` with DIR unset: the dry run put the tasks in the current directory,
        # the run failed as 'cannot create workdir : No such file or directory'.
        ('', '--workdir is empty (an unset shell variable?): pass a folder, e.g. '
         '--workdir=workdirs/vtab'),
        # Each task's checkpoints would have been left unreadable (tests/test_faults.py).
        ('vtab[b16]', "--workdir=vtab[b16]: orbax cannot save checkpoints under a path holding '['"
         " (TMP/vtab[b16]): use a --workdir whose path has no '[' or backslash"),
    ])
def test_a_workdir_no_task_could_run_in_is_refused(tmp_path, dry_run, workdir, message):
  p = console_script('vit-vtab', tmp_path, '--model=ViT-B_16', f'--workdir={workdir}',
                     '--tasks=dtd', *['--dry-run'] * dry_run)
  assert p.returncode == 1 and p.stdout == '', p.stdout + p.stderr
  assert p.stderr.splitlines()[-1] == 'vit-vtab: error: ' + message.replace('TMP', str(tmp_path))
  assert os.listdir(tmp_path) == []


def test_data_not_prepared_stops_before_the_first_task(tmp_path):
  """A task started, failed after some seconds and pointed to its vtab.log; now its data is
  checked first (a finished task's is not needed), as vit-sweep checks its points'."""
  (tmp_path / 'vt' / 'dtd').mkdir(parents=True)
  (tmp_path / 'vt' / 'dtd' / 'final.npz').write_bytes(b'')  # finished: its data is not read
  p = console_script('vit-vtab', tmp_path, '--model=ViT-B_16', '--workdir=vt',
                     '--tasks=dtd,svhn,eurosat', '--config.data_dir=tfds')
  assert p.returncode == 1 and p.stdout == '', p.stdout + p.stderr
  # All the datasets missing, in one line and one `vit-tfds-build` (it had named one per run).
  assert p.stderr.splitlines()[-1] == (
      "vit-vtab: error: 2 tasks' datasets are not prepared in data_dir tfds (svhn, eurosat): run "
      '`vit-tfds-build svhn_cropped eurosat/rgb --data_dir=tfds`, or set --config.data_dir to where '
      'they are prepared')
  assert sorted(os.listdir(tmp_path / 'vt')) == ['dtd']
  # TFDS's own data_dir: the root, also for a dataset with a builder config (eurosat/rgb: the
  # advice had been --data_dir=<root>/eurosat, where the built files are not looked for).
  # resisc45's files are downloaded by hand first.
  p = console_script('vit-vtab', tmp_path, '--model=ViT-B_16', '--workdir=vt', '--tasks=eurosat',
                     TFDS_DATA_DIR=f'{tmp_path}/home_tfds')
  assert p.stderr.splitlines()[-1] == (
      f'vit-vtab: error: task eurosat: dataset eurosat/rgb is not prepared in data_dir '
      f'{tmp_path}/home_tfds: run `vit-tfds-build eurosat/rgb --data_dir={tmp_path}/home_tfds` or set '
      '--config.data_dir to where it is prepared.')
  p = console_script('vit-vtab', tmp_path, '--model=ViT-B_16', '--workdir=vt', '--tasks=resisc45',
                     '--config.data_dir=tfds')
  assert p.stderr.splitlines()[-1] == (
      'vit-vtab: error: task resisc45: dataset resisc45 is not prepared in data_dir tfds: run '
      '`vit-tfds-build resisc45 --data_dir=tfds` (its files downloaded by hand into '
      'tfds/downloads/manual first, as the TFDS catalog says) or set --config.data_dir to where '
      'it is prepared.')
