r"""Top-k classes of image files, from a finished run or a published checkpoint.

  vit-predict --workdir workdirs/quickstart shoe.png photos/        # a run: its classes
  vit-predict --checkpoint ViT-B_16.npz --model ViT-B_16 --labels names.txt cat.jpg

Images are preprocessed exactly as the run evaluates them (preprocessing.preprocess_eval:
its resolution and evaluation crop; gray images become RGB). Class names come from the
run's dataset (Fashion-MNIST, the class folders of a folder dataset, the TFDS label
names); for a published checkpoint, from --labels (one name per line), else indices.
Folders are searched recursively for image files (hidden files and folders are left out).
Results are printed batch by batch; a file that cannot be read is warned about and
skipped, and the exit status is then 1.
"""
import functools
import os
import sys

from absl import flags
import jax
import numpy as np

from vit_jax import cli_help
from vit_jax import image_files
from vit_jax import model_flags
from vit_jax import paths

# TensorFlow is imported by the first image's decode (image_files), and by the class names of
# a run (rundir, input_pipeline): a command refused for its arguments or its model exits
# before TensorFlow's ~5 s import.


def top_k(logits, k):
  """(indices [n, k], probabilities [n, k]) of the k largest softmax probabilities."""
  probs = np.asarray(jax.nn.softmax(np.asarray(logits, np.float32), axis=-1))
  order = np.argsort(-probs, axis=-1)[:, :k]
  return order, np.take_along_axis(probs, order, axis=-1)


def class_names(run_config, labels_file, num_classes, workdir=None):
  """Names of the model's classes: --labels, else those the run recorded
  (rundir.record_class_names), else the run's dataset's, else None."""
  if labels_file:
    try:
      with open(labels_file, encoding='utf-8-sig') as f:
        names = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
      reason = 'not UTF-8 text' if isinstance(e, UnicodeDecodeError) else e.strerror or e
      raise ValueError(f'--labels {labels_file}: cannot read it ({reason}): pass a UTF-8 '
                       'text file of class names, one per line') from None
    if len(names) != num_classes:
      raise ValueError(f'--labels {labels_file} has {len(names)} names but the model has '
                       f'{num_classes} classes: pass the label file of this checkpoint')
    return names
  if run_config is None:
    return None
  # pylint: disable=g-import-not-at-top,unused-import  (TensorFlow: see the imports above)
  from vit_jax import tensorflow_quietly  # noqa: F401  (first: before TensorFlow loads)
  from vit_jax import input_pipeline
  from vit_jax import rundir
  # pylint: enable=g-import-not-at-top,unused-import
  recorded = rundir.recorded_class_names(paths.resolve(workdir)) if workdir else None
  if recorded is not None:
    if len(recorded) != num_classes:  # vit-train records them only for its own head
      raise ValueError(
          f'{os.path.join(workdir, rundir.CLASS_NAMES_FILE)} names {len(recorded)} classes but '
          f'final.npz has a {num_classes}-class head, so they are of different runs: run '
          'vit-train again with the same --workdir, or pass --labels')
    return recorded
  names = input_pipeline.class_names(run_config)
  return list(names) if len(names) == num_classes else None


@functools.partial(jax.jit, static_argnums=0)  # compiled once per model and batch shape
def _logits(model, params, images):
  return model.apply({'params': params}, images, train=False)


def predict(model, params, images, batch_size=32):
  """Logits [n, classes] (numpy) of float32 NHWC images in [-1, 1], `batch_size` at a time."""
  return np.concatenate([
      np.asarray(_logits(model, params, images[i:i + batch_size]))
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


def run(flags_, items, batch_size=32):
  """Prints the predictions batch by batch; returns (files, files skipped)."""
  if flags_.top_k < 1:
    raise ValueError(f'--top_k={flags_.top_k}: pass 1 or more (classes shown per image)')
  files = image_files.find(items)
  run_config, model, params, image_size = model_flags.load(flags_)
  if not model.num_classes:
    raise ValueError('The checkpoint has no classification head: use vit-evaluate --mode '
                     'fewshot for its features')
  names = class_names(run_config, flags_.labels, model.num_classes,
                      getattr(flags_, 'workdir', None))
  k = min(flags_.top_k, model.num_classes)
  skipped = []

  def skip(error):
    skipped.append(error.path)
    print(f'warning: skipped {error}', file=sys.stderr, flush=True)

  config = image_files.eval_config(run_config, image_size)
  for batch_files, images in image_files.batches(files, config, batch_size, skip):
    order, probs = top_k(predict(model, params, images, batch_size), k)
    print(format_predictions(batch_files, order, probs, names), flush=True)
  return len(files), len(skipped)


def _define_flags():
  model_flags.define_flags()
  flags.DEFINE_string(
      'labels', None, 'A text file of class names, one per line (for a '
      'published checkpoint; a run knows its dataset\'s names).')
  flags.DEFINE_integer(
      'top_k', 5, 'Classes shown per image (a number above the model\'s classes shows them all).')


def main(argv):
  try:
    total, skipped = run(flags.FLAGS, argv[1:])
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'vit-predict: {e}')
  if skipped:
    sys.exit(f'vit-predict: {skipped} of {total} files could not be read: fix them as the '
             'warnings above say, or leave them out')


def run_cli():
  """The `vit-predict` console script."""
  _define_flags()
  cli_help.run(main, __name__, model_flags.__name__, program='vit-predict')


if __name__ == '__main__':
  run_cli()
