"""Input pipeline: batches of a dataset for training and evaluation, host sharding, exact
resume, transfer to the devices. The public entry point: get_info, class_names,
train_batches, eval_batches, to_global, prefetch_to_mesh. Datasets are read through
vit_jax/data_sources.py (which datasets, records, how a split is cut among hosts); images
are prepared by vit_jax/preprocessing.py.

Data order and host sharding. Data is read as "records" (data_sources.py). Local
data (IDX files, image folders) is random access, so training walks ONE global
stream on every host: epoch `e` is the whole split permuted with a seed derived from (seed, e),
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
arithmetic are unchanged). Each one is logged and counted by the iterator that met
it: `train_batches(...).skipped` (likewise eval_batches), which the loop reports.

Evaluation: each host reads its shard once, in order, in batches of
global_batch // process_count (smaller for a split smaller than one batch: see
_eval_local_batch); the last one is padded (mask False, label 0, zero image) and
hosts with a smaller shard add all-padding batches, so that all hosts yield
ceil(largest shard / local batch) batches.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Callable, Iterator

from absl import logging
import jax
import numpy as np
import tensorflow as tf

from vit_jax import data_sources
from vit_jax import pipeline_priority
from vit_jax import preprocessing

_MAX_HOSTS = 1 << 16  # Only to mix (epoch, host) into one shuffle seed.


@functools.cache
def keep_tf_off_accelerators() -> None:
  """Hides accelerators from TensorFlow, once, so that it reserves no memory JAX needs.

  Called where TF is first used for data (the functions below; vit-predict), not at
  import: importing vit_jax leaves TF's devices as they are.
  """
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


# ------------------------------------------------------------------ datasets
def get_info(config) -> DatasetInfo:
  """Classes and split sizes (num_train_examples: config value if > 0)."""
  keep_tf_off_accelerators()
  src = data_sources.source(config)
  n_train = config.num_train_examples
  if n_train is None or n_train <= 0:
    n_train = _count(src, config, 'train_split')
  n_eval = _count(src, config, 'eval_split')
  return DatasetInfo(num_classes=src.num_classes, num_train_examples=n_train,
                     num_eval_examples=n_eval, multi_label=src.multi_label)


def count_split(config, field, what=None, flag=None):
  """Examples in the split config[field]; a split the dataset lacks is one line: `what`
  (default: the field) names the split, `flag` (default: the field) the config field to set."""
  return _count(data_sources.source(config), config, field, what, flag)


def _count(src, config, field, what=None, flag=None):
  """Examples in the split config[field]; a split the dataset lacks names the field to set."""
  spec = config[field]
  try:
    return src.count(spec)
  except (data_sources.DamagedFile, data_sources.DataDirUnreadable):  # not the split's fault
    raise
  except ValueError as e:
    reason = ' '.join(str(e).removeprefix(f'Split {spec!r}: ').split()).rstrip('.')  # TFDS: 2 lines
    fix = '' if isinstance(e, data_sources.FixInTheData) else f': set --config.{flag or field}'
    raise ValueError(f'{what or field} {spec!r}: {reason}{fix}') from None


def validate_splits(config) -> str | None:
  """Start-up check of a training run's data: both splits hold examples, and every class
  has training images. Returns a line for the log on what is read (folders), or None."""
  keep_tf_off_accelerators()
  src = data_sources.source(config)
  for field in ('train_split', 'eval_split'):
    if src.count(config[field]) == 0:
      raise ValueError(f'{field} {config[field]!r} of {config.dataset} holds no examples: '
                       f'choose another --config.{field}')
  src.check_classes(config.train_split)
  return src.summary((config.train_split, config.eval_split))


def orientation_warning(config) -> str | None:
  """A warning where the training split's photos are stored turned (EXIF), or None."""
  keep_tf_off_accelerators()
  return data_sources.source(config).orientation_warning(config.train_split)


def split_labels(config, field) -> np.ndarray | None:
  """The labels of the split config[field] where the dataset knows them without reading its
  images (IDX files, folders), else None (TFDS)."""
  keep_tf_off_accelerators()
  return data_sources.source(config).labels(config[field])


def class_names(config) -> tuple[str, ...]:
  """The dataset's class names, index i naming label i (known without reading the data)."""
  keep_tf_off_accelerators()
  return data_sources.source(config).class_names


# ---------------------------------------------------------------- pipelines
SKIPPED_METRIC = 'data/skipped_images'  # the training loop's count of undecodable images


class Batches:
  """An iterator of host batches (dicts of numpy arrays) that counts what it skipped.

  `skipped`: images of this host's stream that could not be decoded since the iterator
  started, each occurrence counted (a bad file met every epoch counts every epoch); the
  training loop reports it as SKIPPED_METRIC. The warning names each file once: a
  bad file of a folder dataset had been warned about again on every pass over the data, a
  line per batch that met one. Where the records do not name their files (TFDS), it is
  logged when the count reaches 1, 2, 4, 8, ...
  """

  def __init__(self, ds: tf.data.Dataset, stage: str, finish: Callable[[dict], dict] | None = None,
               describe: Callable[[int], str] | None = None, counted_in: str | None = None):
    self._ds, self._stage, self._finish, self._describe = ds, stage, finish, describe
    self._counted_in = counted_in  # the metric that counts the skips, where one does
    self._numpy = None  # Started by the first next(), not here.
    self.skipped = 0
    self._named = set()  # the records whose files a warning named

  def __iter__(self) -> Batches:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._numpy is None:  # tf.data's threads start here (pipeline_priority.py)
      self._numpy, batch = pipeline_priority.numpy_iterator(self._ds)
    else:
      batch = next(self._numpy)
    skipped, failed = int(batch.pop('skipped')), batch.pop('failed')
    if skipped:
      self._warn(skipped, failed)
    return self._finish(batch) if self._finish else batch

  def _warn(self, skipped: int, failed: np.ndarray) -> None:
    before, self.skipped = self.skipped, self.skipped + skipped
    if self._describe is None or not len(failed):
      if self.skipped.bit_length() > before.bit_length():  # the count reached a power of 2
        logging.warning('Skipped %d undecodable image(s) while %s (%d so far in this stream).',
                        skipped, self._stage, self.skipped)
      return
    new = [int(i) for i in failed if int(i) not in self._named]
    if new:
      self._named.update(new)
      again = len(failed) - len(new)
      counted = f', each skip counted in {self._counted_in}' if self._counted_in else ''
      logging.warning(
          'Skipped %d undecodable image(s) while %s (%d so far in this stream)%s%s; a file is '
          "named once and skipped on every pass%s (a bare TensorFlow line on stderr such as "
          "'Input file read error' is one of these)", skipped, self._stage, self.skipped,
          self._names(new), f' (and {again} named before)' if again else '', counted)

  def summary(self) -> str | None:
    """The skips of the stream so far in one line, or None where there were none."""
    if not self.skipped:
      return None
    files = (f' of {len(self._named)} file(s), named in the warnings above'
             if self._named else ' (their records are not named by the dataset)')
    return f'Skipped {self.skipped} undecodable image(s) in all while {self._stage}{files}'

  def _names(self, records: list[int], shown: int = 5) -> str:
    """': a.jpg, b.jpg' for the failed records, so that the user can find the files."""
    names = [self._describe(i) for i in records[:shown]]
    more = f' and {len(records) - shown} more' if len(records) > shown else ''
    return ': ' + ', '.join(names) + more


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
  its row, never the alignment of the stream. Adds 'mask' (row decoded),
  'skipped' (records of the batch that failed to decode) and 'failed' (those
  records where they are indices, for Batches to name; else empty).
  """
  ds = ds.batch(local, drop_remainder=drop_remainder)

  def decode(q, records):
    good = tf.data.Dataset.from_tensor_slices(
        (q, records)).map(lambda q, r: (q, fn(q, r)), num_parallel_calls=tf.data.AUTOTUNE,
                          deterministic=True).ignore_errors().batch(local)
    none = tf.data.Dataset.from_tensors((tf.zeros([0], tf.int64), _empty(fallback)))
    return good.concatenate(none).take(1).map(
        lambda kept, ex: dict(_place(kept % local, ex, local, fallback,
                                     tf.shape(q)[0]), failed=_failed_records(q, kept, records)))

  return ds.interleave(data_sources.as_written(decode), cycle_length=2, num_parallel_calls=2,
                       deterministic=True)


def _failed_records(q, kept, records) -> tf.Tensor:
  """The index records of the batch (stream positions q) whose position is not in kept."""
  if not (isinstance(records, tf.Tensor) and records.dtype == tf.int64):
    return tf.zeros([0], tf.int64)
  return tf.boolean_mask(records, ~tf.reduce_any(q[:, None] == kept[None, :], axis=1))


def _empty(example: dict) -> dict:
  return {k: tf.zeros([0, *v.shape], v.dtype) for k, v in example.items()}


def _place(rows, ex, local, fallback, num_records):
  """Scatters the decoded examples `ex` into rows `rows` of a full batch."""

  def scatter():
    return {
        k: tf.tensor_scatter_nd_update(tf.tile(v[None], [local] + [1] * v.shape.rank),
                                       rows[:, None], ex[k]) for k, v in fallback.items()
    }

  # The usual case, a full batch decoded, needs no copy.
  full = tf.shape(rows)[0] == local
  out = tf.cond(full, lambda: {k: ex[k] for k in fallback}, scatter)
  for k, v in fallback.items():
    out[k].set_shape([local, *v.shape])
  out['mask'] = tf.scatter_nd(rows[:, None], tf.ones_like(rows, tf.bool), [local])
  out['skipped'] = tf.cast(num_records - tf.shape(rows)[0], tf.int32)
  return out


def _options(ds: tf.data.Dataset) -> tf.data.Dataset:
  options = tf.data.Options()
  options.deterministic = True
  return ds.with_options(options)


def _shuffle_seed(seed: int, epoch: tf.Tensor, host: int) -> tf.Tensor:
  key = tf.stack([tf.constant(seed, tf.int64), epoch * _MAX_HOSTS + tf.constant(host, tf.int64)])
  return tf.random.stateless_uniform([], key, minval=None, maxval=None, dtype=tf.int64)


def _fallback(config) -> dict[str, tf.Tensor]:
  size = config.image_size
  source = data_sources.source(config)
  label = (tf.zeros([source.num_classes], tf.float32) if source.multi_label else tf.constant(
      0, tf.int32))
  return {'image': tf.zeros([size, size, 3], tf.float32), 'label': label}


def _label(label: tf.Tensor) -> tf.Tensor:
  """int32 class, or the source's multi-hot float32 vector as it is."""
  return label if label.dtype == tf.float32 else tf.cast(label, tf.int32)


def train_batches(config, *, global_batch: int, start_step: int = 0,
                  process_index: int | None = None, process_count: int | None = None) -> Batches:
  """Infinite training batches of this host, starting at step `start_step`.

  Yields {'image': float32 [L, S, S, 3] in [-1, 1], 'label': int32 [L]} with
  L = global_batch // process_count ('label' float32 [L, K] for a multi-label
  dataset). A pure function of (config.seed, step): see the module docstring
  for the resume arithmetic and its cost. `.skipped`: see Batches.
  """
  keep_tf_off_accelerators()
  host, hosts, local = _hosts(global_batch, process_index, process_count)
  source = data_sources.source(config)
  # Local (random-access) data: one global stream that every host walks, each
  # keeping its rows of every global batch, so a run's batches are the same
  # whatever the number of hosts. TFDS: each host reads only its files.
  global_stream = source.random_access
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
    return shard.records.shuffle(shard.shuffle_buffer,
                                 seed=_shuffle_seed(config.seed, e, stream_host))

  ds = tf.data.Dataset.range(first_epoch, np.iinfo(np.int64).max)
  ds = ds.flat_map(data_sources.as_written(epoch)).skip(offset)  # Skip before any read or decode.
  ds = ds.enumerate(start)
  if global_stream and hosts > 1:  # This host's rows of each global batch (indices only).
    # Not on one host, where it keeps every row and took half the quickstart pipeline's CPU.
    ds = ds.filter(data_sources.as_written(lambda q, _: (q % global_batch) // local == host))

  def example(q, record):
    if global_stream:
      pos = q
    else:
      pos = (q // local) * global_batch + host * local + q % local
    ex = shard.load(record)
    seed = tf.stack([tf.constant(config.seed, tf.int64), pos])
    return {
        'image': preprocessing.preprocess_train(ex['image'], seed, config),
        'label': _label(ex['label'])
    }

  ds = _decode_batches(ds, example, local, _fallback(config), drop_remainder=True)
  return Batches(_options(ds.prefetch(2)), 'training', _fill_undecodable_rows, shard.describe,
                 counted_in=SKIPPED_METRIC)


def _fill_undecodable_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Gives each undecodable row a copy of a valid example of the same batch, so the
  batch keeps its size and the stream stays a function of the step."""
  ok = batch.pop('mask')
  if ok.all():
    return batch
  bad, good = np.flatnonzero(~ok), np.flatnonzero(ok)
  if not len(good):
    raise ValueError('A whole training batch is undecodable: check the '
                     'image files of the training split.')
  src = good[np.arange(len(bad)) % len(good)]
  batch = {k: np.array(v) for k, v in batch.items()}
  for v in batch.values():
    v[bad] = v[src]
  return batch


def eval_batches(config, *, global_batch: int, process_index: int | None = None,
                 process_count: int | None = None) -> Batches:
  """The eval split, read once, in order: this host's part in padded batches.

  Yields {'image', 'label', 'mask'}; mask is False on padding and on
  undecodable images. Every host yields ceil(largest host shard / L) batches,
  the same number, as multi-host jit needs. `.skipped`: see Batches.
  """
  keep_tf_off_accelerators()
  host, hosts, local = _hosts(global_batch, process_index, process_count)
  shard = data_sources.source(config).shard(config.eval_split, host, hosts, config.shuffle_buffer)
  if shard.max_size == 0:
    # Few-shot and vit-evaluate read other splits through here too: name the split only.
    raise ValueError(f'split {config.eval_split!r} of {config.dataset} is empty: choose '
                     'another split.')
  local = _eval_local_batch(shard.max_size, local)
  num_batches = math.ceil(shard.max_size / local)

  def example(q, record):
    del q
    ex = shard.load(record)
    return {
        'image': preprocessing.preprocess_eval(ex['image'], config),
        'label': _label(ex['label'])
    }

  fallback = _fallback(config)
  ds = shard.records.take(shard.size).enumerate()
  ds = _decode_batches(ds, example, local, fallback, drop_remainder=False)
  # Hosts with fewer records finish with all-padding batches.
  pad = dict(_place(tf.zeros([0], tf.int64), _empty(fallback), local, fallback, 0),
             failed=tf.zeros([0], tf.int64))
  ds = ds.concatenate(tf.data.Dataset.from_tensors(pad).repeat())
  # Named by its split: few-shot evaluation reads training splits through here too.
  return Batches(_options(ds.take(num_batches).prefetch(2)), f'reading split {config.eval_split!r}',
                 describe=shard.describe)


def _eval_local_batch(max_size: int, local: int) -> int:
  """The host batch of an eval split: `local`, or for a split smaller than one batch the
  smallest multiple of this host's devices that holds it. A 64-image split at an
  eval_batch_size of 512 would otherwise run (and hold) eight times the images it has."""
  unit = jax.local_device_count()
  return min(local, -(-max_size // unit) * unit)


# ------------------------------------------------------------- to devices
def to_global(batch: dict[str, np.ndarray],
              sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
  """Host-local batch -> global jax.Arrays, batch dimension over `sharding`."""
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


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
