"""Input pipeline: datasets, ViT-paper preprocessing, host sharding, exact resume.

Sources (`config.dataset`):
  'fashion_mnist_local'  the original Fashion-MNIST IDX files, read from
                         `config.data_dir` or /usr/share/datasets/fashion-mnist.
                         Splits 'train' (60k) and 'test' (10k).
  'folder:<dir>'         one sub-folder per split, one sub-sub-folder per class:
                         <dir>/<split>/<class>/<image>. Class index = position
                         of the class name in the sorted union of the class
                         folders of all splits. JPEG/PNG/GIF/BMP/WebP files.
  anything else          a TFDS dataset (features 'image' and `config.label_key`,
                         default 'label'). A ClassLabel feature gives int32
                         labels; a Sequence(ClassLabel) feature (a set of labels,
                         e.g. imagenet2012_real's 'real_label') gives multi-hot
                         float32 [num_classes] labels, all zero for an empty set.
                         With config.vtab_task one of the 7 VTAB-1k tasks that
                         compute their label from other features of this
                         dataset, that label (vit_jax/vtab.py).
Split names accept TFDS slicing for every source ('train[:90%]', 'test[:500]',
'train+test').

Data order and host sharding. Data is read as "records": cheap, undecoded items
(an index for local data, the encoded bytes for TFDS). Local data (IDX files,
image folders) is random access, so training walks ONE global stream on every
host: epoch `e` is the whole split permuted with a seed derived from (seed, e),
cut into global batches, and host `h` keeps rows [h*L, (h+1)*L) of each; the
batches of a run are therefore the same on 1 host or N. TFDS data is not random
access: each host reads its own shard of the split (`tfds.even_splits`), epoch
`e` of host `h` is its records shuffled in a `shuffle_buffer` window seeded by
(seed, e, h) (files read in their stored order; TFDS shuffles examples when it
prepares a dataset), so there the order depends on the number of hosts.
Batches run across epoch boundaries; no example is dropped.

Exact resume. Augmentation randomness comes from stateless TF ops seeded with
(seed, global example position), where the position of local example `j` of
step `s` is `s * global_batch + h * local_batch + j`. So the stream is a pure
function of (seed, step): `train_batches(config, start_step=k)` starts at the
epoch of stream position k * B (B: global batch for local data, local batch for
TFDS) and skips the records before it in that epoch BEFORE any file read,
decoding or augmentation. Cost: at most one epoch of records is skipped, i.e.
O(n) integer moves for the local sources (about 1 s per million examples) and,
for TFDS, reading (not decoding) up to one epoch of encoded records of the host
shard.

Undecodable images (folder source, TFDS) are never fatal: each batch of records
is decoded in a small dataset that drops failing elements, and the survivors are
put back at their rows. At evaluation a failed row is masked out; at training it
gets a copy of a valid image of the same batch (so batch shapes and the resume
arithmetic are unchanged). Each one is logged and counted: `skipped_examples()`.

Evaluation: each host reads its shard once, in order, in batches of
global_batch // process_count; the last one is padded (mask False, label 0,
zero image) and hosts with a smaller shard add all-padding batches, so that all
hosts yield ceil(largest shard / local batch) batches.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import gzip
import math
import os
import types
from typing import Any, Callable, Iterator

from absl import logging
import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax import vtab

FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'
_IDX_PREFIX = {'train': 'train', 'test': 't10k'}  # split -> IDX file prefix
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.gif', '.bmp', '.webp')
_MAX_HOSTS = 1 << 16  # Only to mix (epoch, host) into one shuffle seed.

# TF must not reserve accelerator memory that JAX needs.
try:
  tf.config.set_visible_devices([], 'GPU')
except RuntimeError:  # TF already initialised its devices; nothing to do.
  pass


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  num_classes: int
  num_train_examples: int
  num_eval_examples: int
  multi_label: bool = False  # Labels are multi-hot float32 [num_classes] vectors.


# ------------------------------------------------------------------ counters
_skipped = 0


def skipped_examples() -> int:
  """Undecodable examples met so far in this process (each occurrence counts)."""
  return _skipped


def reset_skipped_examples() -> None:
  global _skipped
  _skipped = 0


def _count_skipped(n: int, where: str) -> None:
  global _skipped
  _skipped += n
  logging.warning('Skipped %d undecodable image(s) while %s (%d so far in this '
                  'process).', n, where, _skipped)


# ------------------------------------------------------------ preprocessing
def _to_rgb(image: tf.Tensor) -> tf.Tensor:
  """uint8 [H,W], [H,W,1], [H,W,3] or [H,W,4] -> [H,W,3]."""
  if image.shape.rank == 2:
    image = image[..., None]
  channels = image.shape[-1]
  if channels == 1:
    return tf.tile(image, [1, 1, 3])
  if channels == 3:
    return image
  if channels is not None:
    return image[..., :3]
  return tf.cond(tf.shape(image)[-1] == 1,
                 lambda: tf.tile(image, [1, 1, 3]), lambda: image[..., :3])


def _decode(image: tf.Tensor) -> tf.Tensor:
  """Encoded bytes or a uint8 array -> uint8 [H, W, 3]."""
  if image.dtype == tf.string:
    image = tf.io.decode_image(image, channels=3, expand_animations=False)
    image.set_shape([None, None, 3])
    return image
  return _to_rgb(tf.convert_to_tensor(image, tf.uint8))


def _crop_box(shape: tf.Tensor, seed: tf.Tensor, min_area: float):
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      tf.cast(shape, tf.int32),
      bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
      seed=seed,
      min_object_covered=0.0,
      aspect_ratio_range=(3 / 4, 4 / 3),
      area_range=(min_area, 1.0),
      max_attempts=10,
      use_image_if_no_bounding_boxes=True)
  return begin, size


def inception_crop(image: tf.Tensor, seed: tf.Tensor,
                   min_area: float = 0.05) -> tf.Tensor:
  """Random crop of area [min_area, 1] and aspect [3/4, 4/3] -> uint8 [h,w,3].

  `image` is uint8 [H,W,C] or encoded bytes; JPEG bytes are decoded only inside
  the crop window (much faster than decoding the whole image).
  """
  if image.dtype != tf.string:
    image = _decode(image)
    begin, size = _crop_box(tf.shape(image), seed, min_area)
    return tf.slice(image, begin, size)

  def jpeg():
    begin, size = _crop_box(tf.image.extract_jpeg_shape(image), seed, min_area)
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    return tf.image.decode_and_crop_jpeg(image, window, channels=3)

  def other():
    decoded = _decode(image)
    begin, size = _crop_box(tf.shape(decoded), seed, min_area)
    return tf.slice(decoded, begin, size)

  out = tf.cond(tf.io.is_jpeg(image), jpeg, other)
  out.set_shape([None, None, 3])
  return out


def _scale(image: tf.Tensor) -> tf.Tensor:
  return tf.cast(image, tf.float32) / 127.5 - 1.0


def preprocess_train(image: tf.Tensor, seed: tf.Tensor, config) -> tf.Tensor:
  """One training image -> float32 [S, S, 3] in [-1, 1].

  Args:
    image: uint8 [H, W, C] (C in 1, 3, 4) or a scalar string of encoded bytes.
    seed: int32/int64 [2], the stateless seed of this example (crop and flip
      seeds are split from it).
    config: reads image_size, pp.train_crop, pp.inception_min_area, pp.flip.
  """
  seed = tf.convert_to_tensor(seed)
  crop_seed, flip_seed = tf.unstack(
      tf.random.experimental.stateless_split(seed, 2))
  if config.pp.train_crop == 'inception':
    image = inception_crop(image, crop_seed, config.pp.inception_min_area)
  elif config.pp.train_crop == 'resize':
    image = _decode(image)
  else:
    raise ValueError(f"pp.train_crop={config.pp.train_crop!r} is unknown: use "
                     "'inception' or 'resize'.")
  size = config.image_size
  image = tf.image.resize(image, (size, size), method='bilinear')
  if config.pp.flip:
    image = tf.image.stateless_random_flip_left_right(image, flip_seed)
  return _scale(image)


def preprocess_eval(image: tf.Tensor, config) -> tf.Tensor:
  """One evaluation image -> float32 [S, S, 3] in [-1, 1].

  pp.eval_crop='resize': the whole image resized to S x S. 'central': the
  shorter side resized to S / pp.central_crop_fraction (aspect kept), then the
  central S x S crop.
  """
  image = _decode(image)
  size = config.image_size
  if config.pp.eval_crop == 'resize':
    image = tf.image.resize(image, (size, size), method='bilinear')
  elif config.pp.eval_crop == 'central':
    small = tf.cast(round(size / config.pp.central_crop_fraction), tf.float32)
    hw = tf.cast(tf.shape(image)[:2], tf.float32)
    new_hw = tf.cast(tf.math.ceil(hw * small / tf.reduce_min(hw)), tf.int32)
    image = tf.image.resize(image, tf.maximum(new_hw, size), method='bilinear')
    top, left = (tf.shape(image)[0] - size) // 2, (tf.shape(image)[1] - size) // 2
    image = image[top:top + size, left:left + size]
    image.set_shape([size, size, 3])
  else:
    raise ValueError(f"pp.eval_crop={config.pp.eval_crop!r} is unknown: use "
                     "'resize' or 'central'.")
  return _scale(image)


# ------------------------------------------------------------------ sources
def _shard_ranges(spec: str, sizes: dict[str, int], index: int,
                  count: int) -> list[tuple[str, int, int]]:
  """[(split, start, stop)] of part `index` of `count` of `spec`, as TFDS does."""
  infos = {k: types.SimpleNamespace(num_examples=v, shard_lengths=[v])
           for k, v in sizes.items()}
  part = tfds.even_splits(spec, n=count)[index]
  try:
    absolute = part.to_absolute(infos)
  except ValueError as e:
    raise ValueError(f'Split {spec!r}: {e}') from None
  return [(a.splitname, a.from_ or 0, sizes[a.splitname] if a.to is None
           else a.to) for a in absolute]


@dataclasses.dataclass(frozen=True)
class _Shard:
  """The part of one split that one host reads."""
  records: tf.data.Dataset  # Fixed order; cheap items, decoded by `load`.
  size: int  # Records in this host's shard.
  max_size: int  # Largest shard over all hosts (eval batches per host).
  shuffle_buffer: int  # Per-epoch shuffle window (size = a full permutation).
  load: Callable[[Any], dict[str, tf.Tensor]]  # record -> {'image', 'label'}


class _LocalSource:
  """Random-access data held as per-split arrays; records are indices."""
  multi_label = False

  def sizes(self) -> dict[str, int]:
    raise NotImplementedError

  def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
    raise NotImplementedError

  def count(self, spec: str) -> int:
    return sum(b - a for _, a, b in _shard_ranges(spec, self.sizes(), 0, 1))

  def shard(self, spec: str, index: int, count: int, shuffle_buffer: int):
    del shuffle_buffer  # Indices are cheap: shuffle each epoch completely.
    sizes = self.sizes()
    hosts = [_shard_ranges(spec, sizes, i, count) for i in range(count)]
    # This host's examples, gathered once into one pair of arrays.
    parts = [(self.arrays(name), a, b) for name, a, b in hosts[index]]
    items = np.concatenate([x[a:b] for (x, _), a, b in parts])
    labels = np.concatenate([y[a:b] for (_, y), a, b in parts]).astype(np.int32)
    items, labels = tf.constant(items), tf.constant(labels)
    n = len(labels)
    return _Shard(
        records=tf.data.Dataset.range(n),
        size=n,
        max_size=max(sum(b - a for _, a, b in h) for h in hosts),
        shuffle_buffer=max(n, 1),
        load=lambda i: {'image': self.load_item(tf.gather(items, i)),
                        'label': tf.gather(labels, i)})

  def load_item(self, item: tf.Tensor) -> tf.Tensor:
    return item


def _read_idx(path: str, magic: int) -> np.ndarray:
  if not os.path.exists(path):
    raise FileNotFoundError(
        f'Fashion-MNIST file {path} is missing: run `apt-get install '
        'dataset-fashion-mnist` or point --config.data_dir at the IDX files.')
  with gzip.open(path, 'rb') as f:
    data = f.read()
  ndim = magic & 0xFF
  header = np.frombuffer(data, '>i4', count=1 + ndim)
  if header[0] != magic:
    raise ValueError(f'{path} is not an IDX file with magic {magic}: '
                     'replace it with the original Fashion-MNIST file.')
  shape = tuple(int(d) for d in header[1:])
  return np.frombuffer(data, np.uint8, offset=4 * (1 + ndim)).reshape(shape)


class _IdxSource(_LocalSource):
  """Fashion-MNIST from the original IDX files."""
  class_names = ('T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt',
                 'Sneaker', 'Bag', 'Ankle boot')
  num_classes = len(class_names)

  def __init__(self, data_dir: str):
    self.data_dir = data_dir or FASHION_MNIST_DIR

  def _path(self, split: str, kind: str) -> str:
    name = 'images-idx3' if kind == 'images' else 'labels-idx1'
    return os.path.join(self.data_dir, f'{_IDX_PREFIX[split]}-{name}-ubyte.gz')

  @functools.cache
  def sizes(self) -> dict[str, int]:
    # Reads (and checks: presence, format, labels) both splits once; cached.
    return {split: len(self.arrays(split)[1]) for split in _IDX_PREFIX}

  @functools.cache
  def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
    images = _read_idx(self._path(split, 'images'), 2051)[..., None]
    labels = _read_idx(self._path(split, 'labels'), 2049)
    if len(images) != len(labels):
      raise ValueError(f'{self.data_dir}: {len(images)} images but '
                       f'{len(labels)} labels in split {split!r}.')
    if len(labels) and labels.max() >= self.num_classes:
      raise ValueError(f'{self._path(split, "labels")} has label {labels.max()}, but '
                       f'Fashion-MNIST has {self.num_classes} classes: replace it with '
                       'the original file.')
    return images, labels


class _FolderSource(_LocalSource):
  """<root>/<split>/<class>/<image>; images are read and decoded lazily."""
  def __init__(self, root: str):
    self.root = root
    if not tf.io.gfile.isdir(root):
      raise FileNotFoundError(f'Folder dataset {root} not found: expected '
                              '<dir>/<split>/<class>/<image> (dataset=folder:<dir>).')
    self.splits = sorted(d.rstrip('/') for d in tf.io.gfile.listdir(root)
                         if tf.io.gfile.isdir(os.path.join(root, d)))
    classes = set()
    for split in self.splits:
      classes.update(d.rstrip('/') for d in tf.io.gfile.listdir(
          os.path.join(root, split)) if tf.io.gfile.isdir(
              os.path.join(root, split, d)))
    self.classes = sorted(classes)
    if not self.classes:
      raise ValueError(f'Folder dataset {root} has no class folders: expected '
                       '<dir>/<split>/<class>/<image>.')
    self.num_classes = len(self.classes)
    self.class_names = tuple(self.classes)

  @functools.cache
  def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
    paths, labels = [], []
    for label, name in enumerate(self.classes):
      folder = os.path.join(self.root, split, name)
      if not tf.io.gfile.isdir(folder):
        continue
      found = [f for f in sorted(tf.io.gfile.listdir(folder))
               if not f.startswith('.') and f.lower().endswith(IMAGE_EXTENSIONS)]
      if not found:  # would still count as a class: a head unit never trained
        raise ValueError(f'class folder {folder} holds no images '
                         f'({"/".join(IMAGE_EXTENSIONS)}): add its images or '
                         'remove the folder.')
      paths += [os.path.join(folder, f) for f in found]
      labels += [label] * len(found)
    return np.array(paths, dtype=object), np.array(labels, np.int32)

  @functools.cache
  def sizes(self) -> dict[str, int]:
    return {s: len(self.arrays(s)[1]) for s in self.splits}

  def load_item(self, item: tf.Tensor) -> tf.Tensor:
    return tf.io.read_file(item)


class _TfdsSource:
  """A TFDS dataset; images stay encoded until after shuffling."""
  def __init__(self, name: str, data_dir: str, label_key: str = 'label', vtab_task: str = ''):
    self.name = name
    try:
      self.builder = tfds.builder(name, data_dir=data_dir or None)
    except tfds.core.registered.DatasetNotFoundError:
      raise ValueError(f"dataset {name!r} is not a TFDS dataset: set --config.dataset "
                       "to a TFDS name, 'folder:<dir>' or 'fashion_mnist_local'"
                       ) from None
    # The data_dir root, as a user would pass it to `tfds build --data_dir`.
    self.data_dir = data_dir or os.path.dirname(os.path.dirname(
        self.builder.data_dir))
    # A VTAB-1k task whose label is computed from other features (vit_jax/vtab.py); not
    # for another dataset read with the same config (a few-shot evaluator's).
    self.vtab_task = vtab_task if vtab.derives_label(vtab_task, name) else ''
    if self.vtab_task:
      self.label_key, self.multi_label = '', False
      self.num_classes = vtab.VTAB[vtab_task].num_classes
      self.class_names = vtab.class_names(vtab_task)
      return
    features = self.builder.info.features
    if label_key not in features:
      raise ValueError(f'dataset {name} has no feature {label_key!r}: set --config.label_key '
                       f'to one of its features {sorted(features.keys())}')
    self.label_key = label_key
    self.multi_label = isinstance(features[label_key], tfds.features.Sequence)
    classes = features[label_key].feature if self.multi_label else features[label_key]
    self.num_classes = classes.num_classes
    self.class_names = tuple(classes.names)

  def _read(self, split) -> tf.data.Dataset:
    ds = self.builder.as_dataset(
        split=split, shuffle_files=False,
        decoders={'image': tfds.decode.SkipDecoding()})
    if self.vtab_task:
      return ds.map(functools.partial(vtab.example, self.vtab_task))
    return ds.map(lambda ex: {'image': ex['image'], 'label': self._label(ex[self.label_key])})

  def _label(self, label: tf.Tensor) -> tf.Tensor:
    if not self.multi_label:
      return label
    # A set of labels -> multi-hot (fixed size, so it batches; repeats count once).
    hot = tf.math.bincount(tf.cast(label, tf.int32), minlength=self.num_classes,
                           maxlength=self.num_classes, dtype=tf.float32)
    return tf.minimum(hot, 1.0)

  @functools.cache
  def sizes(self) -> dict[str, int]:
    splits = self.builder.info.splits
    if splits:
      return {k: v.num_examples for k, v in splits.items()}
    # tfds.testing.mock_data leaves info.splits empty: count by reading.
    sizes = {}
    for name in ('train', 'validation', 'test'):
      try:
        ds = self._read(name)
      except (ValueError, KeyError, AssertionError):
        continue
      sizes[name] = int(ds.reduce(np.int64(0), lambda c, _: c + 1))
    if not sizes:
      raise FileNotFoundError(
          f'dataset {self.name} is not prepared in data_dir {self.data_dir}: run '
          f'`tfds build {self.name} --data_dir={self.data_dir}` or set '
          '--config.data_dir to where it is prepared.')
    return sizes

  def count(self, spec: str) -> int:
    return sum(b - a for _, a, b in _shard_ranges(spec, self.sizes(), 0, 1))

  def shard(self, spec: str, index: int, count: int, shuffle_buffer: int):
    sizes = self.sizes()
    host_sizes = [sum(b - a for _, a, b in _shard_ranges(spec, sizes, i, count))
                  for i in range(count)]
    n = host_sizes[index]
    return _Shard(
        # take(): the metadata's count is the contract (mock data ignores it).
        records=self._read(tfds.even_splits(spec, n=count)[index]).take(n),
        size=n,
        max_size=max(host_sizes),
        shuffle_buffer=max(1, min(shuffle_buffer, n)),
        load=lambda ex: ex)


def _source_of(config):
  return _source(config.dataset, config.data_dir, config.get('label_key', 'label'),
                 config.get('vtab_task', ''))


@functools.lru_cache(maxsize=8)
def _source(dataset: str, data_dir: str, label_key: str = 'label', vtab_task: str = ''):
  if label_key != 'label' and (dataset == 'fashion_mnist_local' or dataset.startswith('folder:')):
    raise ValueError(f'label_key {label_key!r} applies to TFDS datasets only: set '
                     f'--config.label_key=label for {dataset}')
  if dataset == 'fashion_mnist_local':
    return _IdxSource(data_dir)
  if dataset.startswith('folder:'):
    return _FolderSource(dataset[len('folder:'):])
  return _TfdsSource(dataset, data_dir, label_key, vtab_task)


def get_info(config) -> DatasetInfo:
  """Classes and split sizes (num_train_examples: config value if > 0)."""
  src = _source_of(config)
  n_train = config.num_train_examples
  if n_train is None or n_train <= 0:
    n_train = src.count(config.train_split)
  return DatasetInfo(num_classes=src.num_classes, num_train_examples=n_train,
                     num_eval_examples=src.count(config.eval_split),
                     multi_label=src.multi_label)


def class_names(config) -> tuple[str, ...]:
  """The dataset's class names, index i naming label i (known without reading the data)."""
  return _source_of(config).class_names


# ---------------------------------------------------------------- pipelines
def _hosts(global_batch: int, process_index, process_count):
  index = jax.process_index() if process_index is None else process_index
  count = jax.process_count() if process_count is None else process_count
  if not 0 <= index < count:
    raise ValueError(f'process_index {index} is not in [0, {count}).')
  if global_batch <= 0 or global_batch % count:
    raise ValueError(f'Global batch {global_batch} is not a positive multiple '
                     f'of the process count {count}: change the batch size.')
  return index, count, global_batch // count


def _decode_batches(ds: tf.data.Dataset, fn, local: int, fallback: dict,
                    drop_remainder: bool) -> tf.data.Dataset:
  """(q, record) elements -> batches of `local` fn(q, record), errors survived.

  Each batch of records is mapped in its own small dataset whose failing
  elements are dropped (`ignore_errors`); the survivors are put back at their
  rows (q % local) and the other rows get `fallback`. A bad image thus costs
  its row, never the alignment of the stream. Adds 'mask' (row decoded) and
  'skipped' (records of the batch that failed to decode).
  """
  ds = ds.batch(local, drop_remainder=drop_remainder)

  def decode(q, records):
    good = tf.data.Dataset.from_tensor_slices((q, records)).map(
        lambda q, r: (q, fn(q, r)), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True).ignore_errors().batch(local)
    none = tf.data.Dataset.from_tensors((tf.zeros([0], tf.int64),
                                         _empty(fallback)))
    return good.concatenate(none).take(1).map(
        lambda kept, ex: _place(kept % local, ex, local, fallback,
                                tf.shape(q)[0]))

  return ds.interleave(decode, cycle_length=2, num_parallel_calls=2,
                       deterministic=True)


def _empty(example: dict) -> dict:
  return {k: tf.zeros([0, *v.shape], v.dtype) for k, v in example.items()}


def _place(rows, ex, local, fallback, num_records):
  """Scatters the decoded examples `ex` into rows `rows` of a full batch."""
  def scatter():
    return {k: tf.tensor_scatter_nd_update(
        tf.tile(v[None], [local] + [1] * v.shape.rank), rows[:, None], ex[k])
            for k, v in fallback.items()}

  # The usual case, a full batch decoded, needs no copy.
  full = tf.shape(rows)[0] == local
  out = tf.cond(full, lambda: {k: ex[k] for k in fallback}, scatter)
  for k, v in fallback.items():
    out[k].set_shape([local, *v.shape])
  out['mask'] = tf.scatter_nd(rows[:, None], tf.ones_like(rows, tf.bool),
                              [local])
  out['skipped'] = tf.cast(num_records - tf.shape(rows)[0], tf.int32)
  return out


def _options(ds: tf.data.Dataset) -> tf.data.Dataset:
  options = tf.data.Options()
  options.deterministic = True
  return ds.with_options(options)


def _shuffle_seed(seed: int, epoch: tf.Tensor, host: int) -> tf.Tensor:
  key = tf.stack([tf.constant(seed, tf.int64),
                  epoch * _MAX_HOSTS + tf.constant(host, tf.int64)])
  return tf.random.stateless_uniform([], key, minval=None, maxval=None,
                                     dtype=tf.int64)


def _fallback(config) -> dict[str, tf.Tensor]:
  size = config.image_size
  source = _source_of(config)
  label = (tf.zeros([source.num_classes], tf.float32) if source.multi_label
           else tf.constant(0, tf.int32))
  return {'image': tf.zeros([size, size, 3], tf.float32), 'label': label}


def _label(label: tf.Tensor) -> tf.Tensor:
  """int32 class, or the source's multi-hot float32 vector as it is."""
  return label if label.dtype == tf.float32 else tf.cast(label, tf.int32)


def train_batches(config, *, global_batch: int, start_step: int = 0,
                  process_index: int | None = None,
                  process_count: int | None = None
                  ) -> Iterator[dict[str, np.ndarray]]:
  """Infinite training batches of this host, starting at step `start_step`.

  Yields {'image': float32 [L, S, S, 3] in [-1, 1], 'label': int32 [L]} with
  L = global_batch // process_count ('label' float32 [L, K] for a multi-label
  dataset). A pure function of (config.seed, step): see the module docstring
  for the resume arithmetic and its cost.
  """
  host, hosts, local = _hosts(global_batch, process_index, process_count)
  source = _source_of(config)
  # Local (random-access) data: one global stream that every host walks, each
  # keeping its rows of every global batch, so a run's batches are the same
  # whatever the number of hosts. TFDS: each host reads only its files.
  global_stream = isinstance(source, _LocalSource)
  if global_stream:
    shard = source.shard(config.train_split, 0, 1, config.shuffle_buffer)
    per_batch, stream_host = global_batch, 0
  else:
    shard = source.shard(config.train_split, host, hosts, config.shuffle_buffer)
    per_batch, stream_host = local, host
  if shard.size == 0:
    raise ValueError(f'train_split {config.train_split!r} is empty on host '
                     f'{host}: use a larger split.')
  start = start_step * per_batch  # Position in the stream.
  first_epoch, offset = divmod(start, shard.size)

  def epoch(e):
    return shard.records.shuffle(
        shard.shuffle_buffer, seed=_shuffle_seed(config.seed, e, stream_host))

  ds = tf.data.Dataset.range(first_epoch, np.iinfo(np.int64).max)
  ds = ds.flat_map(epoch).skip(offset)  # Skip before any read or decode.
  ds = ds.enumerate(start)
  if global_stream:  # This host's rows of each global batch (indices only).
    ds = ds.filter(lambda q, _: (q % global_batch) // local == host)

  def example(q, record):
    if global_stream:
      pos = q
    else:
      pos = (q // local) * global_batch + host * local + q % local
    ex = shard.load(record)
    seed = tf.stack([tf.constant(config.seed, tf.int64), pos])
    return {'image': preprocess_train(ex['image'], seed, config),
            'label': _label(ex['label'])}

  ds = _decode_batches(ds, example, local, _fallback(config),
                       drop_remainder=True)
  return _train_numpy(_options(ds.prefetch(2)))


def _train_numpy(ds: tf.data.Dataset) -> Iterator[dict[str, np.ndarray]]:
  for batch in ds.as_numpy_iterator():
    ok, skipped = batch.pop('mask'), int(batch.pop('skipped'))
    if skipped:
      _count_skipped(skipped, 'training')
      bad, good = np.flatnonzero(~ok), np.flatnonzero(ok)
      if not len(good):
        raise ValueError('A whole training batch is undecodable: check the '
                         'image files of the training split.')
      # Fill each bad row with a valid example of the same batch, so the
      # batch keeps its size and the stream stays a function of the step.
      src = good[np.arange(len(bad)) % len(good)]
      batch = {k: np.array(v) for k, v in batch.items()}
      for v in batch.values():
        v[bad] = v[src]
    yield batch


def eval_batches(config, *, global_batch: int, process_index: int | None = None,
                 process_count: int | None = None
                 ) -> Iterator[dict[str, np.ndarray]]:
  """The eval split, read once, in order: this host's part in padded batches.

  Yields {'image', 'label', 'mask'}; mask is False on padding and on
  undecodable images. Every host yields ceil(largest host shard / L) batches,
  the same number, as multi-host jit needs.
  """
  host, hosts, local = _hosts(global_batch, process_index, process_count)
  shard = _source_of(config).shard(config.eval_split, host, hosts, config.shuffle_buffer)
  num_batches = math.ceil(shard.max_size / local)
  if num_batches == 0:
    raise ValueError(f'eval_split {config.eval_split!r} is empty: choose '
                     'another split.')

  def example(q, record):
    del q
    ex = shard.load(record)
    return {'image': preprocess_eval(ex['image'], config),
            'label': _label(ex['label'])}

  fallback = _fallback(config)
  ds = shard.records.take(shard.size).enumerate()
  ds = _decode_batches(ds, example, local, fallback, drop_remainder=False)
  # Hosts with fewer records finish with all-padding batches.
  pad = _place(tf.zeros([0], tf.int64), _empty(fallback), local, fallback, 0)
  ds = ds.concatenate(tf.data.Dataset.from_tensors(pad).repeat())
  return _eval_numpy(_options(ds.take(num_batches).prefetch(2)))


def _eval_numpy(ds: tf.data.Dataset) -> Iterator[dict[str, np.ndarray]]:
  for batch in ds.as_numpy_iterator():
    skipped = int(batch.pop('skipped'))
    if skipped:
      _count_skipped(skipped, 'evaluating')
    yield batch


# ------------------------------------------------------------- to devices
def to_global(batch: dict[str, np.ndarray],
              sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
  """Host-local batch -> global jax.Arrays, batch dimension over `sharding`."""
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def prefetch_to_mesh(iterator, sharding: jax.sharding.Sharding,
                     size: int = 2) -> Iterator[dict[str, jax.Array]]:
  """to_global with `size` batches in flight, overlapping transfer and step."""
  queue = collections.deque()
  for batch in iterator:
    queue.append(to_global(batch, sharding))
    if len(queue) > size:
      yield queue.popleft()
  while queue:
    yield queue.popleft()
