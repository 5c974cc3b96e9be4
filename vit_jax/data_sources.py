"""Data sources: a dataset's classes, split sizes, and the records of one host's shard.

Sources (`config.dataset`):
  'fashion_mnist_local'  the original Fashion-MNIST IDX files, read from
                         `config.data_dir` or /usr/share/datasets/fashion-mnist.
                         Splits 'train' (60k) and 'test' (10k).
  'folder:<dir>'         one sub-folder per split, one sub-sub-folder per class:
                         <dir>/<split>/<class>/<image>. Class index = position
                         of the class name in the sorted union of the class
                         folders of all splits. JPEG/PNG/GIF/BMP/WebP files;
                         hidden files and folders are left out. Files are in a
                         fixed pseudo-random order, so that slices hold every
                         class (_FolderSource.arrays).
  anything else          a TFDS dataset (features 'image' and `config.label_key`,
                         default 'label'). A ClassLabel feature gives int32
                         labels; a Sequence(ClassLabel) feature (a set of labels,
                         e.g. imagenet2012_real's 'real_label') gives multi-hot
                         float32 [num_classes] labels, all zero for an empty set.
                         With config.vtab_task one of the 7 VTAB-1k tasks that
                         compute their label from other features of this
                         dataset, that label (vit_jax/vtab.py).
Split names accept TFDS slicing for every source ('train[:90%]', 'test[:500]',
'train+test'); a split is cut among hosts as `tfds.even_splits` cuts it.

Data is read as "records": cheap, undecoded items (an index for local data, the
encoded bytes for TFDS), loaded into {'image', 'label'} only after shuffling. Local
data (IDX files, image folders) is random access; TFDS data is read in its stored
order, each host its own shard of the split.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import hashlib
import os
import shlex
import tempfile
import types
import zlib
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax import errors
from vit_jax import image_files
from vit_jax import jpeg_orientation
from vit_jax import palette_bmp
from vit_jax import tfds_build
from vit_jax import vtab

FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'
_IDX_PREFIX = {'train': 'train', 'test': 't10k'}  # split -> IDX file prefix


class _EachWhenAsked(Mapping):
  """{name: value(name)} for `names`, each value computed when first asked for. TFDS's
  split arithmetic asks only for the splits a spec names: a folder's other splits are not
  read, so one of them with an empty class folder does not stop a read of another."""

  def __init__(self, names, value):
    self._names = tuple(names)
    self._value = functools.cache(value)

  def __getitem__(self, name):
    if name not in self._names:
      raise KeyError(name)
    return self._value(name)

  def __iter__(self):
    return iter(self._names)

  def __len__(self):
    return len(self._names)


def _shard_ranges(spec: str, sizes: Mapping[str, int], index: int,
                  count: int) -> list[tuple[str, int, int]]:
  """[(split, start, stop)] of part `index` of `count` of `spec`, as TFDS does."""
  infos = _EachWhenAsked(
      sizes, lambda k: types.SimpleNamespace(num_examples=sizes[k], shard_lengths=[sizes[k]]))
  part = tfds.even_splits(spec, n=count)[index]
  try:
    absolute = part.to_absolute(infos)
  except FixInTheData:  # a split's size read from its files: the fix is there
    raise
  except ValueError as e:
    raise ValueError(f'Split {spec!r}: {e}') from None
  except AssertionError as e:  # TFDS asserts what a reversed slice ('train[90%:80%]') breaks
    raise ValueError(f'Split {spec!r}: its slice ends before it starts ({e})') from None
  return [
      (a.splitname, a.from_ or 0, sizes[a.splitname] if a.to is None else a.to) for a in absolute
  ]


def _length(ranges: list[tuple[str, int, int]]) -> int:
  return sum(b - a for _, a, b in ranges)


@dataclasses.dataclass(frozen=True)
class Shard:
  """The part of one split that one host reads."""
  records: tf.data.Dataset  # Fixed order; cheap items, decoded by `load`.
  size: int  # Records in this host's shard.
  max_size: int  # Largest shard over all hosts (eval batches per host).
  shuffle_buffer: int  # Per-epoch shuffle window (size = a full permutation).
  load: Callable[[Any], dict[str, tf.Tensor]]  # record -> {'image', 'label'}
  # Index record -> what a user can look for (a file's path); None where records are not
  # indices or name nothing.
  describe: Callable[[int], str] | None = None


class Source:
  """What every source answers: classes, split sizes, and the shard of a split one host reads."""
  num_classes: int
  class_names: tuple[str, ...]  # Index i names label i.
  multi_label = False  # Labels are multi-hot float32 [num_classes] vectors.
  random_access = False  # Records are indices: any host can walk the whole split cheaply.

  def sizes(self) -> Mapping[str, int]:
    """{split name: examples}."""
    raise NotImplementedError

  def host_ranges(self, spec: str, count: int) -> list[list[tuple[str, int, int]]]:
    """For each of `count` hosts, the [(split, start, stop)] it reads of `spec`."""
    sizes = self.sizes()
    return [_shard_ranges(spec, sizes, i, count) for i in range(count)]

  def count(self, spec: str) -> int:
    """Examples in the split `spec` (TFDS slicing accepted)."""
    return _length(self.host_ranges(spec, 1)[0])

  def shard(self, spec: str, index: int, count: int, shuffle_buffer: int) -> Shard:
    """Part `index` of `count` of the split `spec`."""
    raise NotImplementedError

  def check_classes(self, train_spec: str) -> None:
    """Raises ValueError where a class cannot be learnt from `train_spec` (folders)."""
    del train_spec

  def summary(self, splits: tuple[str, ...]) -> str | None:
    """A line for the log on what the run reads of these splits, where it is not obvious."""
    del splits
    return None

  def orientation_warning(self, spec: str) -> str | None:
    """A warning where the split `spec` holds photos that are stored turned, or None."""
    del spec
    return None

  def labels(self, spec: str) -> np.ndarray | None:
    """The labels of the split `spec` where they are known without reading its images, else
    None (a TFDS dataset stores them beside each image)."""
    del spec
    return None


class _LocalSource(Source):
  """Random-access data held as per-split arrays; records are indices."""
  random_access = True

  def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
    raise NotImplementedError

  def shard(self, spec: str, index: int, count: int, shuffle_buffer: int) -> Shard:
    del shuffle_buffer  # Indices are cheap: shuffle each epoch completely.
    hosts = self.host_ranges(spec, count)
    # This host's examples, gathered once into one pair of arrays.
    parts = [(self.arrays(name), a, b) for name, a, b in hosts[index]]
    items = np.concatenate([x[a:b] for (x, _), a, b in parts])
    labels = np.concatenate([y[a:b] for (_, y), a, b in parts]).astype(np.int32)
    describe = self.describe_items(items)
    items, labels = tf.constant(items), tf.constant(labels)
    n = len(labels)
    return Shard(
        records=tf.data.Dataset.range(n), size=n, max_size=max(_length(h) for h in hosts),
        shuffle_buffer=max(n, 1), load=lambda i: {
            'image': self.load_item(tf.gather(items, i)),
            'label': tf.gather(labels, i)
        }, describe=describe)

  def labels(self, spec: str) -> np.ndarray:
    return np.concatenate(
        [self.arrays(name)[1][a:b] for name, a, b in self.host_ranges(spec, 1)[0]]).astype(np.int32)

  def load_item(self, item: tf.Tensor) -> tf.Tensor:
    return item

  def describe_items(self, items: np.ndarray) -> Callable[[int], str] | None:
    """Shard.describe of a shard holding `items`; in-memory arrays name nothing."""
    del items
    return None


class FixInTheData(ValueError):
  """A fault of the data's own files or folders: its message names the fix there, not a split
  or field to set."""


class DamagedFile(FixInTheData):
  """A data file that exists but cannot be read whole: the fix is the file, not a split."""


class DataDirUnreadable(ValueError):
  """A data_dir that cannot be read at all: a bucket misnamed or not this machine's to read,
  no network, a folder this user may not read. TFDS's error had ended the command in a
  traceback, and a folder it may not look into was called not prepared."""

  def __init__(self, data_dir: str, error: Exception):
    fix = errors.GCS_FIX if data_dir.startswith('gs://') else 'check the path and its permissions'
    denied = type(error).__name__ in ('PermissionError', 'PermissionDeniedError')
    if denied and not data_dir.startswith('gs://'):
      fix = f'give this user read permission on it (chmod -R a+rX {shlex.quote(data_dir)})'
    super().__init__(f'cannot read data_dir {data_dir}: {errors.storage_why(error)}: {fix}')


@contextlib.contextmanager
def _reading(data_dir: str | None):
  """TensorFlow's errors reading data_dir (OpError, or TFDS's RuntimeError around one) become
  DataDirUnreadable."""
  try:
    yield
  except (RuntimeError, tf.errors.OpError) as e:
    cause = e.__cause__ if isinstance(e, RuntimeError) else e
    if not isinstance(cause, tf.errors.OpError):
      raise
    raise DataDirUnreadable(data_dir or '~/tensorflow_datasets', cause) from None


class NotPrepared(FileNotFoundError):
  """A TFDS dataset with no prepared files in its data_dir (`vit-tfds-build` makes them)."""

  def __init__(self, name: str, data_dir: str, manual: bool, field: str = '',
               fix: str = 'set --config.data_dir to where it is prepared'):
    self.name, self.data_dir, self.manual = name, data_dir, manual
    said = f'{field}: ' if field else ''
    super().__init__(f'{said}dataset {name} is not prepared in data_dir {data_dir}: '
                     f'{build_advice([self])} or {fix}.')

  def said_of(self, field: str, fix: str) -> 'NotPrepared':
    """The same error for a dataset that the config `field` names (not the run's own
    dataset): its line starts with the field and ends with `fix`."""
    return NotPrepared(self.name, self.data_dir, self.manual, field, fix)


def build_advice(missing: list[NotPrepared]) -> str:
  """'run `vit-tfds-build A B --data_dir=D`' for datasets not prepared in one data_dir D, with
  where the files of those that TFDS cannot download go."""
  names = ' '.join(dict.fromkeys(m.name for m in missing))
  manual = list(dict.fromkeys(m.name for m in missing if m.manual))
  where = shlex.quote(missing[0].data_dir)
  advice = f'run `{tfds_build.PROGRAM} {names} --data_dir={where}`'
  if manual:
    whose = 'its' if len(manual) == 1 else 'their'
    whose = whose if len(missing) == 1 else f'{", ".join(manual)}: {whose}'
    advice += (f' ({whose} files downloaded by hand into '
               f'{os.path.join(missing[0].data_dir, "downloads", "manual")} first, as the TFDS '
               'catalog says)')
  return advice


def _read_idx(path: str, magic: int) -> np.ndarray:
  replace = ('replace it with the original Fashion-MNIST file (`apt-get install --reinstall '
             'dataset-fashion-mnist`)')
  try:
    with gzip.open(path, 'rb') as f:
      data = f.read()
  except FileNotFoundError:
    raise FileNotFoundError(
        f'Fashion-MNIST file {path} is missing: run `apt-get install '
        'dataset-fashion-mnist` or point --config.data_dir at the IDX files.') from None
  except PermissionError as e:  # os.path.exists is False in a folder this user may not search
    raise DataDirUnreadable(os.path.dirname(path), e) from None
  except (OSError, EOFError, zlib.error) as e:  # truncated or not gzip at all
    raise DamagedFile(f'{path} is damaged ({e}): {replace}') from None
  ndim = magic & 0xFF
  head = 4 * (1 + ndim)
  header = np.frombuffer(data[:head], '>i4') if len(data) >= head else np.zeros(1, '>i4')
  if header[0] != magic:
    raise DamagedFile(f'{path} is not an IDX file with magic {magic}: {replace}')
  shape = tuple(int(d) for d in header[1:])
  if len(data) - head != np.prod(shape):
    raise DamagedFile(f'{path} holds {len(data) - head} bytes where its header says '
                      f'{"x".join(map(str, shape))}: {replace}')
  return np.frombuffer(data, np.uint8, offset=head).reshape(shape)


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


def _subfolders(path: str) -> list[str]:
  """The sorted sub-folders of `path`, hidden ones (.ipynb_checkpoints, ...) left out."""
  try:
    names = tf.io.gfile.listdir(path)
  except tf.errors.PermissionDeniedError:  # it had ended the command in a traceback
    raise FixInTheData(f'Folder {path} cannot be read (permission denied): give this user read '
                       f'permission on the dataset (chmod -R a+rX {shlex.quote(path)})') from None
  return sorted(
      d.rstrip('/') for d in names
      if not d.startswith('.') and tf.io.gfile.isdir(os.path.join(path, d)))


class _FolderSource(_LocalSource):
  """<root>/<split>/<class>/<image>; images are read and decoded lazily."""

  def __init__(self, root: str):
    self.root = root
    if tf.io.gfile.exists(root) and not tf.io.gfile.isdir(root):
      raise ValueError(f'Folder dataset {root} is a file: expected a folder '
                       '<dir>/<split>/<class>/<image> (dataset=folder:<dir>).')
    if not tf.io.gfile.isdir(root):
      raise FileNotFoundError(f'Folder dataset {root} not found: set --config.dataset=folder:<dir> '
                              'to where it is, <dir>/<split>/<class>/<image>')
    self.splits = _subfolders(root)
    self.classes_by_split = {s: _subfolders(os.path.join(root, s)) for s in self.splits}
    self.classes = sorted(set().union(*self.classes_by_split.values()))
    if len(self.classes) < 2:
      self._refuse_a_split()
    if not self.classes:
      raise ValueError(f'Folder dataset {root} has no class folders: expected '
                       '<dir>/<split>/<class>/<image>.')
    if len(self.classes) == 1:  # its loss is 0 from the first step: nothing is learned
      raise FixInTheData(f'Folder dataset {root} has one class ({self.classes[0]}): a '
                         'classifier needs two or more: add a folder per class under each '
                         'split (<dir>/<split>/<class>/<image>).')
    self.num_classes = len(self.classes)
    self.class_names = tuple(self.classes)

  @functools.cache
  def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(paths, labels) of a split, in a fixed pseudo-random order: that of a hash of each
    file's class/name. A folder lists its files class by class; TFDS shuffles a dataset
    once as it prepares it. In class order a slice such as 'train[90%:]' would hold only
    the last classes; in this order each slice holds every class in proportion, and a
    file keeps its place among the others when files are added or removed."""
    paths, labels, names = [], [], []
    for label, name in enumerate(self.classes):
      folder = os.path.join(self.root, split, name)
      if name not in self.classes_by_split[split]:
        continue
      found, _ = self._listing(split, name)
      if not found:  # would still count as a class: a head unit never trained
        raise FixInTheData(f'class folder {folder} holds no images '
                           f'({"/".join(image_files.IMAGE_EXTENSIONS)}; sub-folders are not '
                           'read): add its images or remove the folder.')
      paths += [os.path.join(folder, f) for f in found]
      labels += [label] * len(found)
      names += [f'{name}/{f}' for f in found]
    order = np.array(
        sorted(range(len(names)), key=lambda i: hashlib.sha256(names[i].encode()).digest()),
        np.int64)
    return np.array(paths, dtype=object)[order], np.array(labels, np.int32)[order]

  @functools.cache
  def _listing(self, split: str, name: str) -> tuple[list[str], list[str]]:
    """(image files, other entries that are not hidden) of one class folder, sorted."""
    entries = sorted(
        e.rstrip('/') for e in tf.io.gfile.listdir(os.path.join(self.root, split, name)))
    visible = [e for e in entries if not e.startswith('.')]
    found = [e for e in visible if e.lower().endswith(image_files.IMAGE_EXTENSIONS)]
    return found, [e for e in visible if e not in found]

  def _refuse_a_split(self) -> None:
    """Where the folders under root hold images themselves, root is most likely a split
    (its folders the classes) or a class: the error names the folder above it. Called with
    fewer than two classes found, so a dataset that trains is never refused here."""
    holding = [
        s for s in self.splits
        if any(e.lower().endswith(image_files.IMAGE_EXTENSIONS) for e in self._loose_files(s))
    ]
    if holding:
      parent = os.path.dirname(os.path.normpath(self.root)) or '.'
      shown = ', '.join(holding[:3]) + (', ...' if len(holding) > 3 else '')
      raise ValueError(f'Folder dataset {self.root} looks like a split, not the dataset: its '
                       f'folders ({shown}) hold images themselves, as class folders do: set '
                       f'--config.dataset=folder:{parent}, the folder holding '
                       '<split>/<class>/<image>')

  def _loose_files(self, split: str) -> list[str]:
    """Files (not hidden) in a split's folder itself: no class folder holds them."""
    entries = sorted(e.rstrip('/') for e in tf.io.gfile.listdir(os.path.join(self.root, split)))
    return [e for e in entries if not e.startswith('.') and e not in self.classes_by_split[split]]

  def check_classes(self, train_spec: str) -> None:
    """Every class has training images: a class found only in other splits (often a name
    spelt differently, as 'Cat' and 'cat') gets a head unit that can never be learnt."""
    trained = set()
    for split in {name for name, _, _ in self.host_ranges(train_spec, 1)[0]}:
      trained.update(self.classes_by_split[split])
    missing = [c for c in self.classes if c not in trained]
    if missing:
      where = {c: [s for s in self.splits if c in self.classes_by_split[s]] for c in missing}
      listed = '; '.join(f'{c!r} (in {", ".join(where[c])})' for c in missing[:5])
      raise ValueError(f'Folder dataset {self.root}: {len(missing)} class(es) without training '
                       f'images in {train_spec!r}: {listed}. Class folders are matched by name '
                       '(case-sensitive) across splits: rename or remove them.')

  def summary(self, splits: tuple[str, ...]) -> str:
    """One line: classes, images per split, and what in the class folders is not read."""
    shown = [repr(c) if ',' in c else c for c in self.classes[:10]]  # 'a, b' is one class
    names = ', '.join(shown) + (', ...' if self.num_classes > 10 else '')
    counts = ', '.join(f'{s}: {errors.count_of(self.count(s), "image")}' for s in splits)
    read = sorted({name for spec in splits for name, _, _ in self.host_ranges(spec, 1)[0]})
    other = [f'{s}/{e}' for s in read for e in self._loose_files(s)] + [
        f'{s}/{c}/{e}' for s in read for c in self.classes_by_split[s]
        for e in self._listing(s, c)[1]
    ]
    extensions = '/'.join(image_files.IMAGE_EXTENSIONS)
    left_out = (f'; not read (not {extensions} files, sub-folders, or files outside a class '
                'folder): '
                f'{len(other)}, e.g. {", ".join(other[:3])}' if other else '')
    return f'folder:{self.root}: {self.num_classes} classes ({names}); {counts}{left_out}'

  def orientation_warning(self, spec: str, sampled: int = 32) -> str | None:
    """Photos from phones and cameras are often stored turned, with an EXIF tag saying how
    to show them; training reads the pixels as stored (as TFDS and big_vision do) while
    vit-predict turns a JPEG upright, so such a folder trains on sideways images. The first
    `sampled` JPEGs of the split's fixed order (a hash, so from every class) are checked:
    64 KiB each, where the EXIF block lies."""
    split = self.host_ranges(spec, 1)[0][0][0]
    jpegs = [p for p in self.arrays(split)[0] if p.lower().endswith(('.jpg', '.jpeg'))][:sampled]
    turned = []
    for path in jpegs:
      try:
        with tf.io.gfile.GFile(path, 'rb') as f:
          head = f.read(1 << 16)
      except (OSError, tf.errors.OpError):
        continue  # unreadable: training skips it and says so
      if jpeg_orientation.orientation(head) != 1:
        turned.append(path)
    if not turned:
      return None
    return (f'{len(turned)} of {len(jpegs)} JPEGs checked in folder:{self.root}, split '
            f'{split!r}, are stored turned or mirrored with an EXIF orientation tag (photos from '
            f'a phone or camera), e.g. {turned[0]}: training reads the pixels as stored, while '
            'vit-predict and vit-inspect turn them upright. To train on them upright, turn the '
            "files' pixels first (ImageMagick: mogrify -auto-orient *.jpg)")

  @functools.cache
  def sizes(self) -> Mapping[str, int]:
    return _EachWhenAsked(self.splits, lambda s: len(self.arrays(s)[1]))

  def load_item(self, item: tf.Tensor) -> tf.Tensor:
    data = tf.io.read_file(item)
    return palette_bmp.as_png(data) if self._holds_bmps() else data

  @functools.cache
  def _holds_bmps(self) -> bool:
    return any(f.lower().endswith('.bmp') for split in self.splits
               for name in self.classes_by_split[split] for f in self._listing(split, name)[0])

  def describe_items(self, items: np.ndarray) -> Callable[[int], str]:
    return lambda i: image_files.named_with_why(str(items[i]))  # the file's path


class _TfdsSource(Source):
  """A TFDS dataset; images stay encoded until after shuffling."""

  def __init__(self, name: str, data_dir: str, label_key: str = 'label', vtab_task: str = ''):
    self.name = name
    try:
      self.builder = tfds_builder(name, data_dir or None)
    except tfds.core.registered.DatasetNotFoundError:
      if tf.io.gfile.isdir(name):  # no TFDS dataset, but a folder here of that name
        raise _a_path(name) from None
      # TFDS also reads a dataset prepared elsewhere (imagenet21k, jft) from data_dir.
      raise ValueError(f"dataset {name!r} is neither a TFDS dataset nor prepared in data_dir "
                       f"{data_dir or '~/tensorflow_datasets'}: put its prepared files there "
                       f"({name}/<version>/, as `vit-tfds-build` writes them) and set "
                       f"--config.data_dir, or set --config.dataset to {_DATASET_KINDS}") from None
    except DataDirUnreadable:
      raise
    except (ValueError, AssertionError) as e:  # a name TFDS cannot parse, or cannot build
      raise _not_built_by_tfds(name, e) from None
    has_prepared_files(self.builder)  # DataDirUnreadable where this user may not look in
    self.data_dir = data_dir or data_dir_root(self.builder)
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
    ds = self.builder.as_dataset(split=split, shuffle_files=False,
                                 decoders={'image': tfds.decode.SkipDecoding()})
    if self.vtab_task:
      return ds.map(as_written(functools.partial(vtab.example, self.vtab_task)))
    return ds.map(
        as_written(lambda ex: {
            'image': ex['image'],
            'label': self._label(ex[self.label_key])
        }))

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
      self._check_prepared()
      return {k: v.num_examples for k, v in splits.items()}
    # tfds.testing.mock_data leaves info.splits empty: count by reading.
    sizes = {}
    for name in ('train', 'validation', 'test'):
      try:
        ds = self._read(name)
      except (ValueError, KeyError, AssertionError):
        continue
      sizes[name] = int(ds.reduce(np.int64(0), as_written(lambda c, _: c + 1)))
    if not sizes:
      raise self._not_prepared()
    return sizes

  def _check_prepared(self) -> None:
    """NotPrepared where data_dir holds no files of the dataset. TFDS fills info.splits from
    its own bucket's metadata where data_dir has none, on any machine with a network (all
    but these test hosts): such a run had gone on past its start-up checks to a traceback,
    'could not find data in ...'. Mocked TFDS (tests) has no files but reads."""
    if has_prepared_files(self.builder):
      return
    try:
      self.builder.as_dataset(split=next(iter(self.builder.info.splits)))
    except AssertionError:  # 'Dataset x: could not find data in D. Please make sure to call ...'
      raise self._not_prepared() from None

  def _not_prepared(self) -> NotPrepared:
    return NotPrepared(self.name, self.data_dir,
                       bool(getattr(self.builder, 'MANUAL_DOWNLOAD_INSTRUCTIONS', None)))

  def shard(self, spec: str, index: int, count: int, shuffle_buffer: int) -> Shard:
    host_sizes = [_length(r) for r in self.host_ranges(spec, count)]
    n = host_sizes[index]
    return Shard(
        # take(): the metadata's count is the contract (mock data ignores it).
        records=self._read(tfds.even_splits(spec, n=count)[index]).take(n),
        size=n,
        max_size=max(host_sizes),
        shuffle_buffer=max(1, min(shuffle_buffer, n)),
        load=lambda ex: ex)


def as_written(fn: Callable) -> Callable:
  """fn for tf.data, traced as written: AutoGraph's rewrite of it, and of the functions it
  maps in turn, is skipped. None of them branches on a tensor in Python (tf.cond is written
  out). The rewrite cost each run ~0.4 s of CPU at start-up, and left its generated modules'
  bytecode in a shared /tmp/__pycache__."""
  return tf.autograph.experimental.do_not_convert(fn)


def data_dir_root(builder) -> str:
  """The data_dir a TFDS builder reads, as a user would pass it to `vit-tfds-build
  --data_dir`: the builder's folder less <name>[/<config>]/<version>."""
  return builder.data_dir[:-len(builder.info.full_name)].rstrip('/')


def has_prepared_files(builder) -> bool:
  """Whether a TFDS builder's folder holds its prepared dataset: its dataset_info.json (TFDS
  writes into an incomplete.* folder and renames it once whole). Not builder.is_prepared():
  that globs the folder's path, so one holding '[' (which TFDS reads) was found unprepared,
  or a neighbour's files found instead."""
  path = os.path.join(builder.data_dir, 'dataset_info.json')
  with _reading(data_dir_root(builder)):
    if tf.io.gfile.exists(path):
      return True
  if '://' not in path:  # gfile says only 'not there' of a folder it may not look into
    try:
      os.stat(path)
    except PermissionError as e:
      raise DataDirUnreadable(data_dir_root(builder), e) from None
    except OSError:
      pass
  return False


def tfds_builder(name: str, data_dir: str | None):
  """tfds.builder(name, data_dir=data_dir), less a folder TFDS leaves behind: the builder of
  a dataset not prepared in data_dir copies the dataset's metadata into a mkdtemp() folder
  it never removes (TFDS 4.9, DatasetInfo.initialize_from_bucket), one in /tmp for every
  run refused for want of data. Here that folder is made in one removed afterwards."""
  with tempfile.TemporaryDirectory() as folder:
    before, tempfile.tempdir = tempfile.tempdir, folder
    try:
      with _reading(data_dir):
        return tfds.builder(name, data_dir=data_dir)
    finally:
      tempfile.tempdir = before


def source(config) -> Source:
  """The source of config.dataset (fields data_dir, label_key, vtab_task), cached."""
  return _source(config.dataset, config.data_dir, config.get('label_key', 'label'),
                 config.get('vtab_task', ''))


def clear_cache() -> None:
  """Forgets the sources made so far (their split sizes and file lists), e.g. after TFDS
  was mocked or a dataset's files changed."""
  _source.cache_clear()


def check_folder_named(dataset: str) -> None:
  """A 'folder:' dataset with no path after it is refused: taken as the current directory,
  its subfolders had been read as the splits."""
  if dataset.startswith('folder:') and not dataset[len('folder:'):].strip():
    raise ValueError('dataset folder: names no folder (an unset shell variable?): set '
                     '--config.dataset=folder:<dir>, <dir> holding <split>/<class>/<image>')


@functools.lru_cache(maxsize=8)
def _source(dataset: str, data_dir: str, label_key: str = 'label', vtab_task: str = ''):
  if not isinstance(dataset, str) or not dataset.strip():
    raise ValueError(f'dataset {dataset!r} names no dataset (an unset shell variable?): set '
                     f'--config.dataset to {_DATASET_KINDS}')
  if label_key != 'label' and (dataset == 'fashion_mnist_local' or dataset.startswith('folder:')):
    raise ValueError(f'label_key {label_key!r} applies to TFDS datasets only: set '
                     f'--config.label_key=label for {dataset}')
  if dataset == 'fashion_mnist_local':
    return _IdxSource(data_dir)
  if dataset.startswith('folder:'):
    check_folder_named(dataset)
    return _FolderSource(dataset[len('folder:'):])
  if dataset.startswith(('/', './', '../', '~', 'gs://')):  # no TFDS name looks so
    # TFDS would print its 18-line help on builder names ('Parsing builder name ...').
    raise _a_path(dataset)
  return _TfdsSource(dataset, data_dir, label_key, vtab_task)


_DATASET_KINDS = "a TFDS name, 'folder:<dir>' or 'fashion_mnist_local'"


def _not_built_by_tfds(name: str, error: Exception) -> ValueError:
  """One line for a name TFDS refuses before looking for data (why_tfds_refuses)."""
  why = why_tfds_refuses(error)
  if why.startswith(_NOT_A_NAME):
    return ValueError(f'dataset {name!r} is {why}: set --config.dataset to {_DATASET_KINDS}')
  return ValueError(f'dataset {name!r} cannot be built by TFDS ({why}): set --config.dataset to '
                    'a config and version the dataset has (tensorflow.org/datasets/catalog), or '
                    'to its name alone')


_NOT_A_NAME = 'not a TFDS name'


def why_tfds_refuses(error: Exception) -> str:
  """Why TFDS refused a dataset name before looking for data, in a few words: a name it
  cannot parse (its own message is an 18-line help), or a version or config the dataset
  does not have."""
  text = str(error).strip()
  if text.startswith('Parsing builder name string'):
    return f'{_NOT_A_NAME} (TFDS reads name[/config][:version], e.g. cifar10 or oxford_iiit_pet:3.*.*)'
  # 'Failed to construct dataset "x", builder_kwargs "{...}": <why>. Here are ...'
  return text.splitlines()[0].split('": ', 1)[-1].split(' Here are ')[0].rstrip(' .:')


def _a_path(dataset: str) -> ValueError:
  return ValueError(f'dataset {dataset!r} is a path: a folder of images '
                    f'(<dir>/<split>/<class>/<image>) is set as --config.dataset=folder:{dataset}')
