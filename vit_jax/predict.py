r"""Top-k classes of image files, from a finished run or a published checkpoint.

  vit-predict --workdir workdirs/quickstart shoe.png photos/        # a run: its classes
  vit-predict --checkpoint ViT-B_16.npz --model ViT-B_16 --labels names.txt cat.jpg

Images are preprocessed exactly as the run evaluates them (preprocessing.preprocess_eval:
its resolution and evaluation crop; gray images become RGB). Class names come from the
run's dataset (Fashion-MNIST, the class folders of a folder dataset, the TFDS label
names); for a published checkpoint, from --labels (one name per line), else indices.
Folders are searched recursively for image files.
"""
import os
import sys

from absl import app
from absl import flags
import jax
import ml_collections
import numpy as np

from vit_jax import cli_help
from vit_jax import data_sources
from vit_jax import input_pipeline
from vit_jax import model_flags
from vit_jax import preprocessing


def image_files(items):
  """Files as given, and the image files under folders (sorted)."""
  out = []
  for item in items:
    if os.path.isdir(item):
      found = sorted(
          os.path.join(d, f) for d, _, files in os.walk(item) for f in files
          if f.lower().endswith(data_sources.IMAGE_EXTENSIONS))
      if not found:
        raise ValueError(f'{item} holds no image files '
                         f'({", ".join(data_sources.IMAGE_EXTENSIONS)})')
      out.extend(found)
    elif os.path.isfile(item):
      out.append(item)
    else:
      raise ValueError(f'{item}: no such file or folder: pass image files or folders')
  if not out:
    raise ValueError('No images: pass image files or folders as arguments')
  return out


def load_images(files, config):
  """Files -> float32 [n, S, S, 3] in [-1, 1], as the evaluation preprocesses them."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top  (preprocessing loaded it)
  input_pipeline.keep_tf_off_accelerators()
  images = []
  for path in files:
    try:
      data = tf.io.read_file(path)
      images.append(preprocessing.preprocess_eval(data, config).numpy())
    except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError) as e:
      raise ValueError(f'Cannot decode {path} ({e.message.splitlines()[0]}): pass JPEG, PNG, '
                       'GIF or BMP files') from None
  return np.stack(images)


def top_k(logits, k):
  """(indices [n, k], probabilities [n, k]) of the k largest softmax probabilities."""
  probs = np.asarray(jax.nn.softmax(np.asarray(logits, np.float32), axis=-1))
  order = np.argsort(-probs, axis=-1)[:, :k]
  return order, np.take_along_axis(probs, order, axis=-1)


def class_names(run_config, labels_file, num_classes):
  """Names of the model's classes: --labels, else the run's dataset, else None."""
  if labels_file:
    with open(labels_file) as f:
      names = [line.strip() for line in f if line.strip()]
    if len(names) != num_classes:
      raise ValueError(f'{labels_file} has {len(names)} names but the model has {num_classes} '
                       'classes: pass the label file of this checkpoint')
    return names
  if run_config is None:
    return None
  names = input_pipeline.class_names(run_config)
  return list(names) if len(names) == num_classes else None


def predict(model, params, images, batch_size=32):
  apply = jax.jit(lambda p, x: model.apply({'params': p}, x, train=False))
  return np.concatenate([
      np.asarray(apply(params, images[i:i + batch_size]))
      for i in range(0, len(images), batch_size)
  ])


def format_predictions(files, order, probs, names):
  lines = []
  for path, idx, p in zip(files, order, probs):
    lines.append(path)
    for i, q in zip(idx, p):
      label = f'{names[i]} ({i})' if names else f'class {i}'
      lines.append(f'  {q:.4f}  {label}')
  return '\n'.join(lines)


def run(flags_, items):
  run_config, model, params, image_size = model_flags.load(flags_)
  if not model.num_classes:
    raise ValueError('The checkpoint has no classification head: use vit-evaluate --mode '
                     'fewshot for its features')
  pp = (run_config or {}).get('pp', {})
  config = ml_collections.ConfigDict(
      dict(
          image_size=image_size,
          pp=dict(eval_crop=pp.get('eval_crop', 'resize'),
                  central_crop_fraction=pp.get('central_crop_fraction', 0.875))))
  files = image_files(items)
  names = class_names(run_config, flags_.labels, model.num_classes)
  order, probs = top_k(predict(model, params, load_images(files, config)), flags_.top_k)
  return format_predictions(files, order, probs, names)


def _define_flags():
  model_flags.define_flags()
  flags.DEFINE_string(
      'labels', None, 'A text file of class names, one per line (for a '
      'published checkpoint; a run knows its dataset\'s names).')
  flags.DEFINE_integer('top_k', 5, 'Classes shown per image.')


def main(argv):
  try:
    print(run(flags.FLAGS, argv[1:]))
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'vit-predict: {e}')


def run_cli():
  """The `vit-predict` console script."""
  _define_flags()
  cli_help.as_the_program(__name__, model_flags.__name__)
  app.run(main)


if __name__ == '__main__':
  run_cli()
