"""Tests for vit_jax/input_pipeline.py, data_sources.py and preprocessing.py on synthetic
data written here."""
import collections
import io
import logging
import os
import re
import struct
import subprocess
import sys
import zlib

import jax
import numpy as np
from PIL import Image
import pytest
import tensorflow as tf

from vit_jax.configs import common
from tests import data_fixtures as fx
from tests.conftest import ROOT
from tests.conftest import without_root_override
from vit_jax import data_sources
from vit_jax import input_pipeline as ip
from vit_jax import palette_bmp
from vit_jax import preprocessing

NUM_TRAIN, NUM_TEST = 40, 13


def _config(**kw):
  c = common.get_config()
  c.image_size = 28
  c.shuffle_buffer = 100
  for k, v in kw.items():
    setattr(c.pp, k[3:], v) if k.startswith('pp_') else setattr(c, k, v)
  return c


IDX_SIZES = (NUM_TRAIN, NUM_TEST)  # (train, test) sizes of the idx_dir fixture


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('folder'))
  # Classes: sorted union of all splits' class folders -> a=0, b=1, c=2.
  train = fx.write_folder(root, 'train', {'b': [1, 2, 3, 4], 'a': [5, 6, 7]})
  test = fx.write_folder(root, 'test', {'a': [10, 11], 'c': [12, 13, 14]})
  fx.write_folder(root, 'test', {'b': [20, 21]}, fmt='JPEG')
  # Sorted between 00012.png and 00013.png: a hole inside an eval batch.
  fx.write_corrupt(os.path.join(root, 'test', 'c', '00012b.png'))
  fx.write_corrupt(os.path.join(root, 'train', 'a', '99999.png'))
  with open(os.path.join(root, 'train', 'a', 'notes.txt'), 'w') as f:
    f.write('not an image: ignored by extension')
  return root, train, test


def _ids(batch):
  return [fx.image_id(x) for x in batch['image']]


def _take(it, n):
  return [next(it) for _ in range(n)]


# ------------------------------------------------------------ preprocessing
def _png(array):
  buf = io.BytesIO()
  Image.fromarray(array).save(buf, 'PNG')
  return buf.getvalue()


def _jpeg(array):
  buf = io.BytesIO()
  Image.fromarray(array).save(buf, 'JPEG', quality=95)
  return buf.getvalue()


def _smooth_rgb(h, w, seed=0):
  rng = np.random.default_rng(seed)
  small = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
  return np.array(Image.fromarray(small).resize((w, h)))


@pytest.mark.parametrize('crop', ['inception', 'resize'])
def test_preprocess_train_shapes_and_range(crop):
  c = _config(image_size=32, pp_train_crop=crop)
  rgb = _smooth_rgb(48, 64)
  for image in (rgb, rgb[..., :1], tf.constant(_png(rgb)), tf.constant(_jpeg(rgb)),
                tf.constant(_png(rgb[..., 0]))):
    out = preprocessing.preprocess_train(image, tf.constant([3, 4]), c).numpy()
    assert out.shape == (32, 32, 3) and out.dtype == np.float32
    assert -1.0 <= out.min() < out.max() <= 1.0


def test_grayscale_becomes_three_equal_channels():
  gray = fx.id_image(7)
  c = _config(pp_train_crop='resize', pp_flip=False)
  for image in (gray[..., None], tf.constant(_png(gray))):
    for out in (preprocessing.preprocess_train(image, [0, 0], c).numpy(),
                preprocessing.preprocess_eval(image, c).numpy()):
      assert out.shape == (28, 28, 3)
      np.testing.assert_array_equal(out[..., 0], out[..., 1])
      np.testing.assert_array_equal(out[..., 0], out[..., 2])
      # Same size and no crop: the pixels come through exactly, scaled.
      np.testing.assert_allclose(out[..., 0], gray / 127.5 - 1, atol=1e-6)


def test_inception_crop_deterministic_per_seed_and_varies_across_seeds():
  c = _config(image_size=24)
  image = _smooth_rgb(64, 80)
  run = lambda s: preprocessing.preprocess_train(image, tf.constant(s), c).numpy()
  np.testing.assert_array_equal(run([1, 2]), run([1, 2]))
  outs = [run([1, s]) for s in range(6)]
  assert all(not np.allclose(outs[0], o) for o in outs[1:])
  boxes = {
      tuple(np.asarray(preprocessing.inception_crop(image, tf.constant([0, s]), 0.05).shape))
      for s in range(10)
  }
  assert len(boxes) > 5  # Crops of varying sizes.
  assert all(h * w >= 0.05 * 64 * 80 * 0.99 for h, w, _ in boxes)


def test_jpeg_crop_is_the_same_box_as_decode_then_crop():
  image = _smooth_rgb(96, 128)
  jpeg = tf.constant(_jpeg(image))
  decoded = tf.io.decode_jpeg(jpeg, channels=3)
  for s in range(4):
    fused = preprocessing.inception_crop(jpeg, tf.constant([9, s]), 0.1).numpy()
    plain = preprocessing.inception_crop(decoded, tf.constant([9, s]), 0.1).numpy()
    assert fused.shape == plain.shape
    assert np.abs(fused.astype(int) - plain).mean() < 2.0


def test_flip_is_seeded():
  c = _config(pp_train_crop='resize', pp_flip=True)
  image = fx.id_image(3)[..., None]
  outs = [preprocessing.preprocess_train(image, [0, s], c).numpy() for s in range(16)]
  flipped = [np.array_equal(o[:, ::-1], outs[0]) for o in outs]
  assert 0 < sum(flipped) < 16  # Some flipped relative to the first, some not.


def test_preprocess_eval_central_crop():
  c = _config(image_size=32, pp_eval_crop='central', pp_central_crop_fraction=0.5)
  image = np.zeros((40, 100, 3), np.uint8)
  image[:, 55:60] = 255  # A white band right of the centre of a wide image.
  out = preprocessing.preprocess_eval(image, c).numpy()
  assert out.shape == (32, 32, 3)
  # Shorter side 40 -> 64, so width 100 -> 160 and the crop is columns
  # 64..96: the band (88..96) is its last 8 columns. A plain resize would put
  # it at 17.6..19.2 instead.
  np.testing.assert_allclose(out[:, 25:31], 1.0, atol=1e-5)
  np.testing.assert_allclose(out[:, :22], -1.0, atol=1e-5)
  with pytest.raises(ValueError, match='eval_crop'):
    preprocessing.preprocess_eval(image, _config(pp_eval_crop='bogus'))


def _palette_bmp(indices, table, bits, top_down=False):
  """An uncompressed BMP of `bits` (1, 4, 8) per pixel, written by hand: rows padded to 4
  bytes, bottom-up unless top_down; `table` uint8 [n, 3] RGB."""
  rows, width = indices.shape
  stride = (width * bits + 31) // 32 * 4
  per_byte = 8 // bits
  padded = np.zeros((rows, stride * per_byte), np.uint8)
  padded[:, :width] = indices
  shifts = 8 - bits * (np.arange(per_byte) + 1)  # the leftmost pixel in the high bits
  packed = (padded.reshape(rows, stride, per_byte) << shifts).sum(-1).astype(np.uint8)
  pixels = (packed if top_down else packed[::-1]).tobytes()
  colours = np.concatenate([table[:, ::-1], np.zeros((len(table), 1), np.uint8)], 1).tobytes()
  offset = 14 + 40 + len(colours)
  info = np.array([40, width, -rows if top_down else rows], '<i4').tobytes() + np.array(
      [1, bits], '<u2').tobytes() + np.array(
          [0, len(pixels), 2835, 2835, len(table), 0], '<u4').tobytes()
  head = b'BM' + np.array([offset + len(pixels), 0, offset], '<u4').tobytes()
  return head + info + colours + pixels


@pytest.mark.parametrize('bits', [1, 4, 8])
@pytest.mark.parametrize('width', [1, 13, 33])
@pytest.mark.parametrize('top_down', [False, True])
def test_palette_bmps_become_pngs_of_their_colours(bits, width, top_down):
  """TensorFlow's decoder refuses 1- and 4-bit BMPs and reads an 8-bit one's colour indices
  as gray; as_png gives a PNG of their table's colours, in tf.data (a graph) as eagerly."""
  rng = np.random.default_rng(bits * width)
  table = rng.integers(0, 256, (2**bits, 3), np.uint8)
  indices = rng.integers(0, 2**bits, (7, width), np.uint8)
  data = _palette_bmp(indices, table, bits, top_down)
  assert Image.open(io.BytesIO(data)).convert('RGB').tobytes() == table[indices].tobytes()
  eager = tf.io.decode_png(palette_bmp.as_png(tf.constant(data))).numpy()
  graph = next(iter(tf.data.Dataset.from_tensors(data).map(palette_bmp.as_png))).numpy()
  np.testing.assert_array_equal(eager, table[indices])
  np.testing.assert_array_equal(tf.io.decode_png(graph).numpy(), table[indices])


def test_other_images_are_left_as_they_are():
  png = _png(_smooth_rgb(16, 24))
  assert palette_bmp.as_png(tf.constant(png)).numpy() == png
  rgb_bmp = io.BytesIO()
  Image.fromarray(_smooth_rgb(16, 24)).save(rgb_bmp, 'BMP')
  assert palette_bmp.as_png(tf.constant(rgb_bmp.getvalue())).numpy() == rgb_bmp.getvalue()
  assert palette_bmp.as_png(tf.constant(b'BM')).numpy() == b'BM'  # shorter than a header


@pytest.mark.parametrize('damage', ['index past the table', 'run-length encoded', 'cut short'])
def test_a_damaged_palette_bmp_is_undecodable(damage):
  indices = np.array([[0, 5 if damage == 'index past the table' else 1]], np.uint8)
  data = bytearray(_palette_bmp(indices, np.zeros((2, 3), np.uint8), 8))
  if damage == 'run-length encoded':
    data[30] = 1
  elif damage == 'cut short':
    data = data[:-3]
  with pytest.raises(tf.errors.InvalidArgumentError):
    palette_bmp.as_png(tf.constant(bytes(data)))


def test_a_folder_of_palette_bmps_trains_on_their_colours(tmp_path):
  """The folder dataset's 8-bit colour BMP gives the image its PNG twin gives."""
  rng = np.random.default_rng(0)
  table = rng.integers(0, 256, (256, 3), np.uint8)
  indices = rng.integers(0, 256, (28, 28), np.uint8)
  for split in ('train', 'test'):
    for name in ('a', 'b'):
      os.makedirs(tmp_path / split / name)
    Image.fromarray(table[indices]).save(tmp_path / split / 'a' / 'twin.png')
    (tmp_path / split / 'b' / 'colours.bmp').write_bytes(_palette_bmp(indices, table, 8))
  c = _config(dataset=f'folder:{tmp_path}', pp_eval_crop='resize')
  batch = next(iter(ip.eval_batches(c, global_batch=2, process_index=0, process_count=1)))
  assert batch['mask'].all()
  np.testing.assert_array_equal(batch['image'][0], batch['image'][1])
  np.testing.assert_allclose(batch['image'][0], table[indices] / 127.5 - 1, atol=1e-6)


# ------------------------------------------------------------ local IDX
def test_info_and_train_batches(idx_dir):
  c = _config(data_dir=idx_dir)
  assert ip.get_info(c) == ip.DatasetInfo(10, NUM_TRAIN, NUM_TEST)
  c2 = _config(data_dir=idx_dir, train_split='train[:25%]', num_train_examples=-1)
  assert ip.get_info(c2).num_train_examples == NUM_TRAIN // 4
  batch = next(ip.train_batches(c, global_batch=8, process_index=1, process_count=2))
  assert set(batch) == {'image', 'label'}
  assert batch['image'].shape == (4, 28, 28, 3)
  assert batch['image'].dtype == np.float32 and batch['label'].dtype == np.int32
  assert -1.0 <= batch['image'].min() < batch['image'].max() <= 1.0
  assert ((0 <= batch['label']) & (batch['label'] < 10)).all()


@pytest.mark.parametrize('dataset', ['fashion_mnist_local', 'mnist', 'dsprites'])
def test_the_pipelines_are_traced_without_autograph_rewrites(idx_dir, monkeypatch, dataset):
  """The rewrite cost each run ~0.4 s of CPU at start-up (data_sources.as_written), and left
  its generated modules' bytecode in a shared /tmp/__pycache__ (TFDS: a plain label, and a
  VTAB task's label computed by vtab.example)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tensorflow.python.autograph.impl import api  # pylint: disable=g-import-not-at-top
  rewritten = []
  real = api._convert_actual  # pylint: disable=protected-access
  monkeypatch.setattr(
      api, '_convert_actual',
      lambda entity, program_ctx: rewritten.append(entity) or real(entity, program_ctx))
  c = _config(data_dir=idx_dir, dataset=dataset)
  if dataset != 'fashion_mnist_local':
    c.train_split = c.eval_split = 'train'
  if dataset == 'dsprites':
    c.vtab_task = 'dsprites_location'
  with tfds.testing.mock_data(num_examples=16, max_value=2):
    data_sources.clear_cache()
    next(ip.train_batches(c, global_batch=8, process_index=1, process_count=2))
    next(ip.eval_batches(c, global_batch=8))
  data_sources.clear_cache()
  assert not rewritten, rewritten


def test_epochs_are_permutations_of_the_host_shard(idx_dir):
  # 'resize' without flip keeps the pixels, so every example is identified.
  c = _config(data_dir=idx_dir, pp_train_crop='resize', pp_flip=False)
  it = ip.train_batches(c, global_batch=8, process_index=0, process_count=1)
  ids = [i for b in _take(it, 10) for i in _ids(b)]  # 2 epochs of 40.
  labels = [
      l for b in _take(ip.train_batches(c, global_batch=8, process_index=0, process_count=1), 5)
      for l in b['label']
  ]
  assert sorted(ids[:40]) == sorted(ids[40:]) == list(range(NUM_TRAIN))
  assert ids[:40] != ids[40:]  # Reshuffled each epoch.
  assert ids[:40] != sorted(ids[:40])
  assert labels == [i % 10 for i in ids[:40]]
  c1 = _config(data_dir=idx_dir, seed=1, pp_train_crop='resize', pp_flip=False)
  other = ip.train_batches(c1, global_batch=8, process_index=0, process_count=1)
  assert [i for b in _take(other, 5) for i in _ids(b)] != ids[:40]
  # Two hosts: each takes its half of every global batch, so together they see
  # exactly the batches of one host (the run does not depend on the host count).
  halves = []
  for h in range(2):
    it = ip.train_batches(c, global_batch=8, process_index=h, process_count=2)
    halves.append([_ids(b) for b in _take(it, 10)])
  joined = [i for a, b in zip(*halves) for i in list(a) + list(b)]
  assert joined == ids


@pytest.mark.parametrize('hosts', [1, 2])
def test_exact_resume_across_epoch_boundaries(idx_dir, hosts):
  # Inception crop + flip: the augmentation must be resumed exactly too.
  c = _config(data_dir=idx_dir, image_size=16)
  kw = dict(global_batch=12, process_index=hosts - 1, process_count=hosts)
  n = 14
  full = _take(ip.train_batches(c, **kw), n)  # Over 4 epochs of this host.
  local, shard = 12 // hosts, NUM_TRAIN // hosts
  # k=3 resumes in epoch 0, k=7 in epoch 2 (position 84 // hosts); both
  # resumed streams contain batches that straddle an epoch boundary.
  for k in (3, 7):
    assert any((s * local) // shard != ((s + 1) * local - 1) // shard for s in range(k, n))
    resumed = _take(ip.train_batches(c, start_step=k, **kw), n - k)
    for a, b in zip(full[k:], resumed):
      np.testing.assert_array_equal(a['label'], b['label'])
      np.testing.assert_array_equal(a['image'], b['image'])
  # And the augmentation really is random: equal ids get different crops.
  flat = np.concatenate([b['image'] for b in full])
  assert len({x.tobytes() for x in flat}) == len(flat)


def test_eval_complete_over_two_processes(idx_dir):
  c = _config(data_dir=idx_dir)
  per_host = [
      list(ip.eval_batches(c, global_batch=4, process_index=h, process_count=2)) for h in range(2)
  ]
  assert len(per_host[0]) == len(per_host[1]) == 4  # ceil(7 / 2)
  seen = []
  for batches in per_host:
    for b in batches:
      assert b['image'].shape == (2, 28, 28, 3) and b['mask'].dtype == bool
      ids = _ids(b)
      seen += [i for i, m in zip(ids, b['mask']) if m]
      np.testing.assert_array_equal(b['label'][b['mask']],
                                    [i % 10 for i, m in zip(ids, b['mask']) if m])
  assert sorted(seen) == list(range(NUM_TRAIN, NUM_TRAIN + NUM_TEST))
  masks = np.concatenate([b['mask'] for bs in per_host for b in bs])
  assert masks.sum() == NUM_TEST  # 3 padding examples, all masked.


def test_a_split_smaller_than_one_eval_batch_is_read_in_a_smaller_batch(idx_dir):
  """13 test images at an eval batch of 512 make one batch of 16 (a multiple of the 8
  devices), not 512 rows of padding to run; over two hosts, 8 of each host's 7."""
  c = _config(data_dir=idx_dir)
  assert jax.local_device_count() == 8
  (batch,) = ip.eval_batches(c, global_batch=512, process_index=0, process_count=1)
  assert batch['image'].shape == (16, 28, 28, 3) and batch['mask'].sum() == NUM_TEST
  assert sorted(i for i, m in zip(_ids(batch), batch['mask']) if m) == list(
      range(NUM_TRAIN, NUM_TRAIN + NUM_TEST))
  per_host = [
      list(ip.eval_batches(c, global_batch=512, process_index=h, process_count=2)) for h in range(2)
  ]
  assert [[b['mask'].shape for b in bs] for bs in per_host] == [[(8,)], [(8,)]]
  assert sum(b['mask'].sum() for bs in per_host for b in bs) == NUM_TEST
  # A split larger than one batch keeps the batch: 3 batches of 5 (ceil(13 / 5)).
  assert [
      len(b['mask']) for b in ip.eval_batches(c, global_batch=5, process_index=0, process_count=1)
  ] == [5, 5, 5]


def test_missing_idx_files_error(tmp_path):
  c = _config(data_dir=str(tmp_path))
  with pytest.raises(FileNotFoundError, match='apt-get install dataset-fashion'):
    ip.get_info(c)


def test_bad_batch_size_error(idx_dir):
  with pytest.raises(ValueError, match='multiple of the process count'):
    ip.train_batches(_config(data_dir=idx_dir), global_batch=9, process_index=0, process_count=2)


# ------------------------------------------------------------ image folder
def test_folder_eval_skips_and_counts_corrupt(folder, caplog):
  root, _, test = folder
  c = _config(dataset='folder:' + root)
  info = ip.get_info(c)
  assert info.num_classes == 3
  assert info.num_eval_examples == 5 + 2 + 1  # PNGs, JPEGs, the corrupt file.
  # The files in their fixed order (a hash of class/name): host h reads 4 of the 8.
  order = [
      os.path.relpath(p, os.path.join(root, 'test'))
      for p in data_sources.source(c).arrays('test')[0]
  ]
  bad = order.index(os.path.join('c', '00012b.png'))
  iterators = [
      ip.eval_batches(c, global_batch=6, process_index=h, process_count=2) for h in range(2)
  ]
  with caplog.at_level(logging.WARNING):
    per_host = [list(it) for it in iterators]
  assert [it.skipped for it in iterators] == [int(h == bad // 4) for h in range(2)]
  # The warning names the file, so that the user can find it.
  assert "Skipped 1 undecodable image(s) while reading split 'test' (1 so far in this stream): " + \
      os.path.join(root, 'test', 'c', '00012b.png') in caplog.text
  assert len(per_host[0]) == len(per_host[1]) == 2
  labels = collections.Counter()
  png_ids = []
  for b in (b for bs in per_host for b in bs):
    labels.update(b['label'][b['mask']].tolist())
    png_ids += [i for i, m in zip(_ids(b), b['mask']) if m and i in test]
  assert labels == {0: 2, 1: 2, 2: 3}  # a=0, b=1 (JPEGs), c=2.
  assert sorted(png_ids) == sorted(test)  # Lossless PNGs: exact pixels.
  # The corrupt file's host: a hole at its row in a batch of 3, then padding after its 4 files.
  stream = {k: np.concatenate([b[k] for b in per_host[bad // 4]]) for k in ('mask', 'image')}
  np.testing.assert_array_equal(stream['mask'], [i != bad % 4 for i in range(4)] + [False] * 2)
  np.testing.assert_array_equal(stream['image'][4:], 0.0)  # Padding.


def test_folder_order_is_fixed_and_mixes_the_classes(tmp_path):
  """A folder lists its files class by class; slices of the split must not follow that."""
  root = str(tmp_path / 'pets')
  fx.write_folder(root, 'train', {'a': list(range(0, 20)), 'b': list(range(20, 40))})
  c = _config(dataset='folder:' + root)
  paths, labels = data_sources.source(c).arrays('train')
  assert set(labels[:10]) == set(labels[-10:]) == {0, 1}  # both classes in each end
  # The order of files is a function of their names: one more file keeps the others' order.
  fx.write_folder(root, 'train', {'a': [99]})
  data_sources.clear_cache()
  again = list(data_sources.source(c).arrays('train')[0])
  assert len(again) == 41 and [p for p in again if not p.endswith('00099.png')] == list(paths)


def test_split_labels_are_those_the_pipeline_reads(tmp_path, idx_dir):
  """Labels known without the images (vit-evaluate checks shots on them before any
  features): a slice of a folder or of IDX files, as eval_batches gives them; TFDS: None."""
  root = str(tmp_path / 'pets')
  fx.write_folder(root, 'train', {'a': list(range(0, 7)), 'b': list(range(7, 12))})
  for c in (_config(dataset='folder:' + root), _config(data_dir=idx_dir)):
    c.eval_split = 'train[25%:90%]'
    read = [b['label'][b['mask']] for b in ip.eval_batches(c, global_batch=4)]
    np.testing.assert_array_equal(ip.split_labels(c, 'eval_split'), np.concatenate(read))
  assert data_sources.Source().labels('train') is None


def test_folder_hidden_folders_and_other_files_are_left_out_and_said(tmp_path):
  root = str(tmp_path / 'pets')
  fx.write_folder(root, 'train', {'a': [1, 2], 'b': [3, 4]})
  fx.write_folder(root, 'test', {'a': [5], 'b': [6]})
  fx.write_folder(root, 'train', {'.thumbs': [7]})  # a hidden folder is not a class
  os.makedirs(os.path.join(root, 'test', '.ipynb_checkpoints'))  # nor an empty one
  os.makedirs(os.path.join(root, '.cache', 'a'))  # nor a split
  fx.write_folder(os.path.join(root, 'train', 'a'), 'nested', {'deep': [8]})
  with open(os.path.join(root, 'train', 'b', 'scan.tif'), 'wb') as f:
    f.write(b'II*')
  with open(os.path.join(root, 'test', 'stray.png'), 'wb') as f:  # in no class folder
    f.write(b'')
  c = _config(dataset='folder:' + root)
  assert ip.class_names(c) == ('a', 'b')
  assert ip.validate_splits(c) == (
      f'folder:{root}: 2 classes (a, b); train: 4 images, test: 2 images; not read (not '
      '.jpg/.jpeg/.png/.gif/.bmp/.webp files, sub-folders, or files outside a class folder): '
      '3, e.g. test/stray.png, train/a/nested, train/b/scan.tif')


def test_folder_photos_stored_turned_are_warned_about(tmp_path):
  """Phone photos carry an EXIF orientation: training reads them as stored, vit-predict
  upright; the start-up warning names one and the fix."""
  root = str(tmp_path / 'photos')
  fx.write_folder(root, 'train', {'a': [1, 2, 3], 'b': [4, 5, 6]}, fmt='JPEG')
  fx.write_folder(root, 'test', {'a': [7], 'b': [8]}, fmt='JPEG')
  c = _config(dataset='folder:' + root, train_split='train[:5]')
  assert ip.orientation_warning(c) is None  # plain JPEGs
  exif = Image.Exif()
  exif[0x0112] = 6  # stored turned 90 degrees
  turned = os.path.join(root, 'train', 'b', '00005.jpg')
  Image.fromarray(fx.id_image(5)).save(turned, 'JPEG', exif=exif.tobytes())
  assert ip.orientation_warning(c) == (
      f'1 of 6 JPEGs checked in folder:{root}, split \'train\', are stored turned or mirrored '
      f'with an EXIF orientation tag (photos from a phone or camera), e.g. {turned}: training '
      'reads the pixels as stored, while vit-predict and vit-inspect turn them upright. To '
      "train on them upright, turn the files' pixels first (ImageMagick: mogrify -auto-orient "
      '*.jpg)')
  assert ip.orientation_warning(_config(dataset='fashion_mnist_local')) is None
  # A file that cannot be read is not this check's to report (training names it).
  os.remove(turned)
  os.symlink(str(tmp_path / 'gone.jpg'), turned)  # listed, but it cannot be opened
  assert ip.orientation_warning(c) is None


def test_folder_splits_are_checked_before_training(tmp_path):
  root = str(tmp_path / 'pets')
  fx.write_folder(root, 'train', {'Cat': [1], 'dog': [2]})
  fx.write_folder(root, 'test', {'cat': [3], 'dog': [4]})
  os.makedirs(os.path.join(root, 'val'))
  c = _config(dataset='folder:' + root)
  with pytest.raises(
      ValueError, match=r"1 class\(es\) without training images in 'train': "
      r"'cat' \(in test\)\. Class folders are matched by name \(case-sensitive\)"):
    ip.validate_splits(c)
  c.train_split = 'train+test'  # every class has training images now
  assert ip.validate_splits(c).startswith(f'folder:{root}: 3 classes (Cat, cat, dog); ')
  c.eval_split = 'val'
  with pytest.raises(
      ValueError, match=f"^eval_split 'val' of folder:{root} holds no examples: "
      'choose another --config.eval_split$'):
    ip.validate_splits(c)


def test_a_class_name_with_a_comma_is_one_name_in_the_log(tmp_path):
  """The log lists the classes joined by ', ': 'cat, black' and 'dog' had read as three."""
  root = str(tmp_path / 'pets')
  for split, first in (('train', 1), ('test', 5)):
    fx.write_folder(root, split, {'cat, black': [first, first + 1], 'dog': [first + 2]})
  c = _config(dataset='folder:' + root)
  assert ip.validate_splits(c).startswith(f"folder:{root}: 2 classes ('cat, black', dog); ")


def test_a_folder_split_not_read_is_not_checked(tmp_path):
  """A split the run does not read (here 'extra', with an empty class folder) stopped a run
  that reads 'train' and 'test', with an error naming that folder as the eval split's."""
  root = str(tmp_path / 'pets')
  fx.write_folder(root, 'train', {'cat': [1, 2], 'dog': [3, 4]})
  fx.write_folder(root, 'test', {'cat': [5], 'dog': [6]})
  os.makedirs(os.path.join(root, 'extra', 'cat'))
  c = _config(dataset='folder:' + root)
  assert ip.validate_splits(c).startswith(f'folder:{root}: 2 classes (cat, dog); train: 4 '
                                          'images, test: 2 images')
  assert ip.count_split(c, 'eval_split') == 2
  c.eval_split = 'extra'
  with pytest.raises(
      ValueError, match=f"^eval_split 'extra': class folder {root}/extra/cat holds no images "
      r'.*: add its images or remove the folder$'):  # no field to set: the folder
    ip.count_split(c, 'eval_split')


def test_a_folder_dataset_of_one_class_is_refused(tmp_path):
  """Its softmax loss is 0 from the first step: a run had trained to exit 0, learning nothing."""
  root = str(tmp_path / 'cats')
  for split in ('train', 'test'):
    fx.write_folder(root, split, {'cat': [1, 2]})
  with pytest.raises(
      ValueError, match=f'^Folder dataset {root} has one class \\(cat\\): a '
      'classifier needs two or more: add a folder per class under each split'):
    ip.validate_splits(_config(dataset='folder:' + root))


@pytest.mark.parametrize('nested', [False, True])
def test_a_folder_dataset_given_as_its_split_names_the_folder_above(tmp_path, nested):
  """folder:<dir>/train took the class folders for splits: 'no class folders', or with a
  sub-folder in each class 'one class (sub)', which hid the fix."""
  root = str(tmp_path / 'pets')
  for split in ('train', 'test'):
    fx.write_folder(root, split, {'cat': [1, 2], 'dog': [3, 4]})
    if nested:
      fx.write_folder(os.path.join(root, split, 'cat'), 'sub', {'kitten': [5]})
  for given in (os.path.join(root, 'train'), os.path.join(root, 'train') + '/'):
    with pytest.raises(
        ValueError, match=f'^Folder dataset {re.escape(given)} looks like a split, not the '
        r'dataset: its folders \(cat, dog\) hold images themselves, as class folders do: '
        f'set --config.dataset=folder:{re.escape(root)}, the folder holding '
        r'<split>/<class>/<image>$'):
      ip.validate_splits(_config(dataset='folder:' + given))
  ip.validate_splits(_config(dataset='folder:' + root))  # the dataset itself trains


def test_skips_without_file_names_are_logged_at_powers_of_two(caplog):
  """TFDS records do not name their files: a line per batch with a bad image would grow with
  the run; it is logged as the count reaches 1, 2, 4, 8, ..."""
  batches = ip.Batches(None, 'training')
  with caplog.at_level(logging.WARNING):
    for _ in range(9):
      batches._warn(1, np.zeros([0], np.int64))
    batches._warn(7, np.zeros([0], np.int64))  # 16
  assert [r.getMessage() for r in caplog.records] == [
      f'Skipped {n} undecodable image(s) while training ({total} so far in this stream).'
      for n, total in ((1, 1), (1, 2), (1, 4), (1, 8), (7, 16))
  ]
  assert batches.summary() == ('Skipped 16 undecodable image(s) in all while training (their '
                               'records are not named by the dataset)')
  assert ip.Batches(None, 'training').summary() is None


@pytest.mark.parametrize('fmt', ['JPEG', 'PNG'])
def test_an_image_too_large_to_decode_is_named_with_its_size(tmp_path, fmt):
  """An intact 14000x14000 photo (a 40000x40000 PNG) in a folder dataset had been named only
  as undecodable: it opens in a viewer. Here its header only, as TensorFlow's decoder reads it."""
  fx.write_folder(str(tmp_path), 'train', {'a': [1], 'b': [2]}, fmt=fmt)
  (small,) = (tmp_path / 'train' / 'a').iterdir()
  data = small.read_bytes()
  if fmt == 'JPEG':
    frame = data.index(b'\xff\xc0') + 5  # the start of frame's height and width
    huge = data[:frame] + struct.pack('>HH', 14000, 14000) + data[frame + 4:]
    why = "14000x14000 pixels, too large for TensorFlow's JPEG decoder, which stops at 512 MiB"
    name = 'huge.jpg'
  else:
    header = b'IHDR' + struct.pack('>II', 40000, 40000) + data[24:29]  # its checksum made again
    huge = data[:12] + header + struct.pack('>I', zlib.crc32(header)) + data[33:]
    why = ("40000x40000 pixels, too large for TensorFlow's PNG decoder, which stops at 512 Mi "
           'pixels or 1,000,000 on a side')
    name = 'huge.png'
  (tmp_path / 'train' / 'a' / name).write_bytes(huge)
  source = data_sources.source(_config(dataset=f'folder:{tmp_path}'))
  files = source.arrays('train')[0]
  named = {os.path.basename(str(f)): source.describe_items(files)(i) for i, f in enumerate(files)}
  assert named[name].startswith(f'{tmp_path}/train/a/{name} ({why}')
  assert named[name].endswith(': downscale it)')
  assert named[small.name] == str(small)


def test_an_image_this_user_cannot_read_is_named_with_that(tmp_path):
  """It had been named only as undecodable."""
  (tmp_path / 'x.png').write_bytes(b'')
  (tmp_path / 'x.png').chmod(0)
  out = subprocess.run([
      *without_root_override(), sys.executable, '-c',
      'from vit_jax import image_files; print(image_files.named_with_why("x.png"))'
  ], cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert out.stdout == 'x.png (permission denied: give this user read permission on it)\n', (
      out.stderr[-2000:])


def test_folder_train_replaces_corrupt_and_resumes(folder, caplog):
  root, train, _ = folder
  c = _config(dataset='folder:' + root, pp_train_crop='resize', pp_flip=False)
  kw = dict(global_batch=4, process_index=0, process_count=1)
  it = ip.train_batches(c, **kw)
  assert it.skipped == 0
  with caplog.at_level(logging.WARNING):
    full = _take(it, 2)  # 1 epoch of 8 files.
  assert it.skipped == 1
  assert caplog.text.count('undecodable') == 1
  assert 'while training (1 so far in this stream): ' + os.path.join(root, 'train', 'a',
                                                                     '99999.png') in caplog.text
  with caplog.at_level(logging.WARNING):
    full += _take(it, 4)
  assert it.skipped == 3  # Once per epoch, counted by this iterator only.
  assert caplog.text.count('undecodable') == 1  # named once, not on every pass
  assert 'skipped on every pass, each skip counted in data/skipped_images' in caplog.text
  # The run's end says the count the log had not (TensorBoard's data/skipped_images: 3).
  assert it.summary() == ('Skipped 3 undecodable image(s) in all while training of 1 file(s), '
                          'named in the warnings above')
  assert ip.train_batches(c, **kw).skipped == 0
  ids = [i for b in full for i in _ids(b)]
  assert set(ids) == set(train)  # Never the zero placeholder image.
  for b in full:
    np.testing.assert_array_equal(b['label'], [{'a': 0, 'b': 1}[train[i]] for i in _ids(b)])
  resumed = _take(ip.train_batches(c, start_step=3, **kw), 3)
  for a, b in zip(full[3:], resumed):
    np.testing.assert_array_equal(a['image'], b['image'])


def test_folder_missing_error(tmp_path):
  with pytest.raises(FileNotFoundError, match='<split>/<class>'):
    ip.get_info(_config(dataset=f'folder:{tmp_path}/nope'))


# ------------------------------------------------------------ TFDS (mocked)
def test_tfds_source_with_mock_data():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=10):
    c = _config(dataset='mnist', image_size=16)
    assert ip.get_info(c) == ip.DatasetInfo(10, 10, 10)
    batch = next(ip.train_batches(c, global_batch=4, process_index=0, process_count=1))
    assert batch['image'].shape == (4, 16, 16, 3)
    counts = [
        len(list(ip.eval_batches(c, global_batch=4, process_index=h, process_count=2)))
        for h in range(2)
    ]
    assert counts == [3, 3]  # 5 examples per host in batches of 2.


# ------------------------------------------------------------ devices
def test_to_global_and_prefetch_to_mesh(idx_dir):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  assert len(jax.devices()) == 8
  c = _config(data_dir=idx_dir)
  batches = _take(ip.train_batches(c, global_batch=16), 3)
  arrays = ip.to_global(batches[0], sharding)
  assert isinstance(arrays['image'], jax.Array)
  assert arrays['image'].shape == (16, 28, 28, 3)
  assert arrays['label'].shape == (16,)
  assert arrays['image'].sharding.is_equivalent_to(sharding, 4)
  assert {s.data.shape for s in arrays['image'].addressable_shards} == {(2, 28, 28, 3)}
  np.testing.assert_array_equal(np.asarray(arrays['image']), batches[0]['image'])
  out = list(ip.prefetch_to_mesh(iter(batches), sharding, size=2))
  assert len(out) == 3
  for a, b in zip(out, batches):
    np.testing.assert_array_equal(np.asarray(a['label']), b['label'])


def test_two_hosts_see_the_rows_of_one_host_with_the_same_augmentation(idx_dir):
  c = _config(data_dir=idx_dir, image_size=16)  # inception crop + flip
  one = _take(ip.train_batches(c, global_batch=8, process_index=0, process_count=1), 7)
  two = [
      _take(ip.train_batches(c, global_batch=8, process_index=h, process_count=2, start_step=2), 5)
      for h in range(2)
  ]
  for a, b0, b1 in zip(one[2:], *two):
    np.testing.assert_array_equal(a['image'], np.concatenate([b0['image'], b1['image']]))
    np.testing.assert_array_equal(a['label'], np.concatenate([b0['label'], b1['label']]))


def test_label_set_feature_gives_multi_hot_labels():
  """imagenet2012_real's 'real_label' (Sequence(ClassLabel(1000))), mocked: each row's
  label is the multi-hot vector of its set, all zero for an empty set."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  c = _config(dataset='imagenet2012_real', label_key='real_label', eval_split='validation',
              train_split='validation', pp_train_crop='resize', pp_flip=False)
  with fx.mock_real(20):
    assert ip.get_info(c) == ip.DatasetInfo(1000, 20, 20, multi_label=True)
    batches = list(ip.eval_batches(c, global_batch=8, process_index=0, process_count=1))
    train = next(ip.train_batches(c, global_batch=8, process_index=0, process_count=1))
  for b in batches + [train]:
    assert b['label'].shape == (8, 1000) and b['label'].dtype == np.float32
    for image, label in zip(b['image'], b['label']):
      want = np.zeros(1000, np.float32)
      want[fx.label_set(fx.image_id(image))] = 1.0
      np.testing.assert_array_equal(label, want)
  rows = [fx.image_id(x) for b in batches for x, ok in zip(b['image'], b['mask']) if ok]
  assert rows == list(range(20))
  assert not batches[0]['label'][0].any()  # example 0 has an empty set
  # TFDS's own random mock examples: sets with repeated labels count each label once.
  with tfds.testing.mock_data(num_examples=6):
    data_sources.clear_cache()
    raw = [
        ex['real_label'] for ex in tfds.as_numpy(
            tfds.builder('imagenet2012_real').as_dataset(
                split='validation', decoders={'image': tfds.decode.SkipDecoding()}))
    ]
    labels = next(ip.eval_batches(c, global_batch=8, process_index=0, process_count=1))['label']
    data_sources.clear_cache()
  assert any(len(set(r)) < len(r) for r in raw)  # the mock does repeat labels
  for label, r in zip(labels, raw):
    np.testing.assert_array_equal(np.flatnonzero(label), np.unique(r))
  with pytest.raises(ValueError, match="no feature 'labels': set --config.label_key"):
    ip.get_info(_config(dataset='imagenet2012_real', label_key='labels'))
  with pytest.raises(ValueError, match='label_key .* applies to TFDS datasets only'):
    ip.get_info(_config(label_key='real_label'))


# ------------------------------------------------------------ TF devices
def test_tf_devices_are_set_on_first_pipeline_use_not_at_import(idx_dir):
  """Importing vit_jax (every module that reads data) leaves TF's devices alone; the
  first pipeline call hides accelerators from TF, once."""
  code = '\n'.join([
      'import sys', 'import tensorflow as tf', 'calls = []',
      'tf.config.set_visible_devices = lambda *a: calls.append(a)',
      'from vit_jax import evaluate, evaluate_cli, input_pipeline, predict, train',
      'from vit_jax.configs import common', 'print(calls)', 'c = common.get_config()',
      'c.data_dir = sys.argv[1]', 'input_pipeline.get_info(c)',
      'list(input_pipeline.eval_batches(c, global_batch=16))', 'print(calls)'
  ])
  out = subprocess.run([sys.executable, '-c', code, idx_dir], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split('\n')[:2] == ['[]', "[([], 'GPU')]"]
