"""Small synthetic data sets written on the fly for tests (no network)."""
import contextlib
import gzip
import os

import numpy as np
from PIL import Image


def id_image(index: int, size: int = 28) -> np.ndarray:
  """uint8 [size, size] whose first two pixels encode `index` (< 65536)."""
  rng = np.random.default_rng(index)
  image = rng.integers(0, 256, (size, size), dtype=np.uint8)
  image[0, 0], image[0, 1] = index % 256, index // 256
  return image


def image_id(image: np.ndarray) -> int:
  """Inverse of id_image for an image scaled to [-1, 1] (any channel count)."""
  pixels = np.rint((np.asarray(image)[0, :2, 0] + 1.0) * 127.5).astype(int)
  return int(pixels[0] + 256 * pixels[1])


def write_idx(directory: str, num_train: int = 40, num_test: int = 13, num_classes: int = 10,
              start: int = 0) -> str:
  """Fashion-MNIST-like IDX .gz files; example i is id_image(i), label i % C.

  Train examples are numbered from `start`, test ones after the train ones.
  """
  os.makedirs(directory, exist_ok=True)
  first = start
  for prefix, n in (('train', num_train), ('t10k', num_test)):
    ids = np.arange(first, first + n)
    first += n
    images = np.stack([id_image(int(i)) for i in ids]) if n else np.zeros((0, 28, 28), np.uint8)
    labels = (ids % num_classes).astype(np.uint8)
    header = np.array([2051, n, 28, 28], '>i4').tobytes()
    with gzip.open(os.path.join(directory, f'{prefix}-images-idx3-ubyte.gz'), 'wb') as f:
      f.write(header + images.tobytes())
    with gzip.open(os.path.join(directory, f'{prefix}-labels-idx1-ubyte.gz'), 'wb') as f:
      f.write(np.array([2049, n], '>i4').tobytes() + labels.tobytes())
  return directory


def write_folder(root: str, split: str, per_class: dict[str, list[int]], fmt: str = 'PNG',
                 gray_every: int = 3, size: int = 28) -> dict:
  """<root>/<split>/<class>/<id>.<ext> images; returns {id: class name}.

  PNG images keep id_image(id) exactly (lossless); every `gray_every`-th image
  is saved single-channel, the others as RGB with identical channels.
  """
  written = {}
  ext = {'PNG': 'png', 'JPEG': 'jpg'}[fmt]
  for name, ids in per_class.items():
    folder = os.path.join(root, split, name)
    os.makedirs(folder, exist_ok=True)
    for i in ids:
      gray = id_image(i, size)
      pil = Image.fromarray(gray) if i % gray_every == 0 else Image.fromarray(
          np.stack([gray] * 3, -1))
      pil.save(os.path.join(folder, f'{i:05d}.{ext}'), fmt)
      written[i] = name
  return written


def write_corrupt(path: str) -> None:
  """A file with an image extension that no decoder accepts."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'wb') as f:
    f.write(b'\x89PNG\r\n\x1a\n' + b'not really a png' * 8)


def write_jpegs(root: str, num: int, num_classes: int = 4, height: int = 375, width: int = 500,
                seed: int = 0) -> None:
  """ImageNet-sized random-ish JPEGs under <root>/train/<class>/ (benchmarks)."""
  rng = np.random.default_rng(seed)
  base = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
  for i in range(num):
    folder = os.path.join(root, 'train', f'c{i % num_classes}')
    os.makedirs(folder, exist_ok=True)
    # Smooth content compresses like a photo; shift it so files differ.
    image = Image.fromarray(np.roll(base, i, axis=1)).resize((width, height))
    image.save(os.path.join(folder, f'{i:06d}.jpg'), 'JPEG', quality=90)


def label_set(index: int) -> list[int]:
  """The label set of mock example `index`: the set bits of (5 * index) % 32, so classes
  0-4, empty for index 0, 32, 64, ..."""
  code = (5 * index) % 32
  return [c for c in range(5) if code >> c & 1]


def mock_real(num_examples: int):
  """tfds.testing.mock_data for the TFDS dataset imagenet2012_real (features 'image',
  'original_label', 'real_label' = Sequence(ClassLabel(1000))) with examples made here:
  example i is id_image(i) (PNG, RGB), real_label label_set(i), original_label i % 7.
  Every split holds the same examples."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  def png(i):
    return tf.io.encode_png(np.repeat(id_image(i)[..., None], 3, -1)).numpy()

  def as_dataset(self, split, decoders=None, read_config=None, **kwargs):
    del self, split, decoders, read_config, kwargs
    examples = [{
        'image': png(i),
        'original_label': i % 7,
        'real_label': np.array(label_set(i), np.int64),
        'file_name': f'ILSVRC2012_val_{i:08d}.JPEG'
    } for i in range(num_examples)]
    return tf.data.Dataset.from_generator(
        lambda: iter(examples), output_signature={
            'image': tf.TensorSpec((), tf.string),
            'original_label': tf.TensorSpec((), tf.int64),
            'real_label': tf.TensorSpec((None,), tf.int64),
            'file_name': tf.TensorSpec((), tf.string)
        })

  return _fresh_sources(tfds.testing.mock_data(num_examples=num_examples, as_dataset_fn=as_dataset))


@contextlib.contextmanager
def _fresh_sources(mock):
  """`mock`, with the pipeline's per-name source cache emptied on entry and exit (a
  cached source would keep the split sizes of another mock)."""
  from vit_jax import data_sources  # pylint: disable=g-import-not-at-top
  data_sources.clear_cache()
  try:
    with mock:
      yield
  finally:
    data_sources.clear_cache()


def write_published(path, model_name: str, num_classes: int = 1000, **overrides) -> None:
  """A published-format checkpoint of `model_name` at `path` (random values, real shapes,
  a `num_classes` head; `overrides` as for models.get_model), as
  vit_jax.checkpoint.save_npz writes the published files."""
  import jax  # pylint: disable=import-outside-toplevel
  from vit_jax import checkpoint, models  # pylint: disable=import-outside-toplevel
  model = models.get_model(model_name, num_classes=num_classes, **overrides)
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), np.zeros((1, 224, 224, 3), np.float32)))['params']
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
  checkpoint.save_npz(str(path), params)


def write_tfds_cifar10(data_dir: str, num_train: int, num_test: int) -> None:
  """A cifar10 prepared by tfds in `data_dir`, as `tfds build cifar10` leaves it (its files,
  dataset_info.json), of num_train + num_test examples: example i (train first) has
  id_image(i, 32) in each channel and label i % 10."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (slow to import)

  class Cifar10(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """The registered cifar10's name, version and features; examples of our own."""
    VERSION = tfds.builder_cls('cifar10').VERSION

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self, features=tfds.features.FeaturesDict({
              'id': tfds.features.Text(),
              'image': tfds.features.Image(shape=(32, 32, 3)),
              'label': tfds.features.ClassLabel(num_classes=10)
          }))

    def _split_generators(self, dl_manager):
      del dl_manager  # nothing to download
      return {
          'train': self._generate_examples(range(num_train)),
          'test': self._generate_examples(range(num_train, num_train + num_test))
      }

    def _generate_examples(self, ids):
      for i in ids:
        image = np.repeat(id_image(i, 32)[..., None], 3, axis=-1)
        yield i, {'id': f'{i}', 'image': image, 'label': i % 10}

  Cifar10(data_dir=data_dir).download_and_prepare()
