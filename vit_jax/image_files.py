"""Image files as vit-predict and vit-inspect read them: found under folders, then decoded
and preprocessed exactly as the run evaluates them (preprocessing.preprocess_eval: its
resolution and evaluation crop; gray and 16-bit images too), a JPEG turned as its EXIF
orientation says (jpeg_orientation).

Finding the files imports no TensorFlow: a command refused for a path it was given says so
before TensorFlow's import (~5 s), which the first decode makes.
"""
import functools
import os
import re
import shlex
import struct
import sys

import ml_collections
import numpy as np

from vit_jax import jpeg_orientation

# What tf.io.decode_image reads; folders (here and folder datasets) are searched for these.
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.gif', '.bmp', '.webp')
FORMATS = 'JPEG, PNG, GIF, BMP or WebP'  # the same, as messages name them (not TIFF)
# Images of formats it does not read: in a folder they are named in a warning (the folder's
# other files, .txt or .json, are passed over without a word).
OTHER_IMAGE_EXTENSIONS = ('.tif', '.tiff', '.heic', '.heif', '.avif', '.jxl', '.jp2', '.ppm')
# TensorFlow's JPEG decoder refuses an image whose pixels take this many bytes or more
# (height x width x the 3 channels decoded), saying only "Invalid JPEG data".
_JPEG_DECODE_LIMIT = 1 << 29
# Its PNG decoder refuses width x height from this many pixels ("PNG size too large for
# int"), and libpng's default limit a side longer than this ("Failed to initialize decoder").
_PNG_PIXEL_LIMIT = 1 << 29
_PNG_SIDE_LIMIT = 1_000_000
# How files of those formats begin (WebP: b'RIFF', 4 bytes of size, b'WEBP').
_SIGNATURES = (b'\xff\xd8\xff', b'\x89PNG\r\n\x1a\n', b'GIF87a', b'GIF89a', b'BM')


class UnreadableImage(ValueError):
  """An image file that cannot be read or decoded: `path`, a short `reason` and what to do
  with the file (`fix`)."""

  def __init__(self, path, reason, fix):
    super().__init__(f'{path}: {reason}: {fix}')
    self.path, self.reason, self.fix = path, reason, fix


def find(items):
  """Files as given, and the image files under folders (sorted; hidden ones left out)."""
  out = []
  for item in items:
    if not item:  # --images a.png, (a trailing comma)
      continue
    if '://' in item:  # had been 'no such file or folder'
      web = item.startswith(('http://', 'https://'))
      copy = f'curl -O {shlex.quote(item)}' if web else 'gcloud storage cp -r'
      raise ValueError(f'{item}: images are read from local files: copy them here first (e.g. '
                       f'`{copy}`) and pass that path')
    if os.path.isdir(item):
      found, others = [], []
      for d, dirs, files in os.walk(item):
        dirs[:] = [x for x in dirs if not x.startswith('.')]
        shown = [os.path.join(d, f) for f in files if not f.startswith('.')]
        found += [f for f in shown if f.lower().endswith(IMAGE_EXTENSIONS)]
        others += [f for f in shown if f.lower().endswith(OTHER_IMAGE_EXTENSIONS)]
      if others:
        print(
            f'warning: left out {len(others)} image file(s) under {item} of a format not read '
            f'(e.g. {sorted(others)[0]}): convert them to {FORMATS}', file=sys.stderr)
      if not found:
        raise ValueError(f'{item} holds no image files ({", ".join(IMAGE_EXTENSIONS)}, searched '
                         f'in its subfolders too): pass folders or files of {FORMATS} images')
      out.extend(sorted(found))
    elif os.path.isfile(item):
      out.append(item)
    else:
      raise ValueError(f'{item}: no such file or folder: pass image files or folders')
  if not out:
    raise ValueError('No images: pass image files or folders as arguments')
  return out


def eval_config(run_config, image_size):
  """The config preprocessing.preprocess_eval reads: the run's pp, else its defaults."""
  pp = dict(eval_crop='resize', central_crop_fraction=0.875)
  pp.update(dict((run_config or {}).get('pp', {})))
  return ml_collections.ConfigDict(dict(image_size=image_size, pp=pp))


@functools.cache
def _preprocessing():
  """vit_jax.preprocessing, imported on the first decode, with TensorFlow kept off the
  accelerators (input_pipeline.keep_tf_off_accelerators)."""
  # pylint: disable=g-import-not-at-top,unused-import
  from vit_jax import tensorflow_quietly  # noqa: F401  (first: before TensorFlow loads)
  from vit_jax import input_pipeline
  from vit_jax import preprocessing
  # pylint: enable=g-import-not-at-top,unused-import
  input_pipeline.keep_tf_off_accelerators()
  return preprocessing


def _short_reason(error):
  """A TF error's message without the op and device it names, nor a closing full stop."""
  text = re.sub(r'\{\{.*?\}\}', '', error.message or '').strip()
  text = re.sub(r'\s*\[Op:\w+\].*', '', text.splitlines()[0] if text else '')
  return text.rstrip('.') or type(error).__name__


def read_image(path, config):
  """One file -> float32 [S, S, 3] in [-1, 1], as the evaluation preprocesses it.

  Raises UnreadableImage when the file cannot be read or decoded.
  """
  preprocessing = _preprocessing()
  # pylint: disable=g-import-not-at-top  (_preprocessing loaded TensorFlow)
  import tensorflow as tf
  from vit_jax import palette_bmp
  # pylint: enable=g-import-not-at-top
  try:
    data = tf.io.read_file(path)
  except tf.errors.OpError as e:
    raise UnreadableImage(path, _short_reason(e), 'check that it can be read') from None
  raw = data.numpy()  # the file's bytes, read once
  if not raw:
    raise UnreadableImage(path, 'empty (0 bytes)', 'replace it with the image it should hold')
  # Told apart here, a file of another format is not decoded: where TensorFlow's C++ log is
  # on (a notebook), it logs a failed decode ("Local rendezvous is aborting ...").
  head = raw[:34]
  if not (head.startswith(_SIGNATURES) or head[:4] == b'RIFF' and head[8:12] == b'WEBP'):
    raise UnreadableImage(path, f'not a {FORMATS} image', f'convert it to {FORMATS}')
  bmp_trouble = palette_bmp.unreadable(head)
  if bmp_trouble:
    raise UnreadableImage(path, *bmp_trouble)
  try:
    turn = jpeg_orientation.orientation(raw) if head.startswith(b'\xff\xd8') else 1
    if turn != 1:  # a phone's portrait photo, say: turned as a viewer shows it
      stored = tf.io.decode_jpeg(data, channels=3).numpy()
      return preprocessing.preprocess_eval(jpeg_orientation.upright(stored, turn), config).numpy()
    return preprocessing.preprocess_eval(palette_bmp.as_png(data), config).numpy()
  except tf.errors.OpError as e:
    reason = _short_reason(e)
    if too_large := _too_large(raw):
      raise UnreadableImage(path, too_large, 'downscale it') from None
    raise UnreadableImage(path, f'damaged or cut short ({reason})',
                          'replace it with an intact copy') from None


def _too_large(head):
  """Why TensorFlow cannot decode a JPEG or PNG whose first bytes are `head`, where it is its
  size."""
  if head.startswith(b'\xff\xd8'):
    size = jpeg_orientation.frame_size(head)
    if size and size[0] * size[1] * 3 >= _JPEG_DECODE_LIMIT:  # decoded as RGB
      return (f'{size[1]}x{size[0]} pixels, too large for TensorFlow\'s JPEG decoder, which '
              f'stops at {_JPEG_DECODE_LIMIT >> 20} MiB of pixels')
  elif head.startswith(b'\x89PNG\r\n\x1a\n') and head[12:16] == b'IHDR' and len(head) >= 24:
    width, height = struct.unpack('>II', head[16:24])
    if width * height >= _PNG_PIXEL_LIMIT or max(width, height) > _PNG_SIDE_LIMIT:
      return (f'{width}x{height} pixels, too large for TensorFlow\'s PNG decoder, which stops '
              f'at {_PNG_PIXEL_LIMIT >> 20} Mi pixels or {_PNG_SIDE_LIMIT:,} on a side')
  return None


def named_with_why(path):
  """`path` of an image a dataset could not decode, with why where it is the image's size or
  its permissions: such a file opens in a viewer, and had been named only as undecodable."""
  try:
    with open(path, 'rb') as f:
      head = f.read(1 << 17)  # the header: EXIF (up to 64 KiB) comes before the frame
  except PermissionError:
    return f'{path} (permission denied: give this user read permission on it)'
  except OSError:
    return path
  too_large = _too_large(head)
  return f'{path} ({too_large}: downscale it)' if too_large else path


def load_images(files, config):
  """Files -> float32 [n, S, S, 3]; UnreadableImage for the first that cannot be read."""
  return np.stack([read_image(path, config) for path in files])


def batches(files, config, batch_size=32, on_skip=None):
  """Yields (paths, images [n <= batch_size, S, S, 3]), decoding one batch at a time.

  A file that cannot be read is passed to on_skip(UnreadableImage) and left out
  (without on_skip, the error is raised).
  """
  paths, images = [], []
  for path in files:
    try:
      images.append(read_image(path, config))
    except UnreadableImage as e:
      if on_skip is None:
        raise
      on_skip(e)
      continue
    paths.append(path)
    if len(paths) == batch_size:
      yield paths, np.stack(images)
      paths, images = [], []
  if paths:
    yield paths, np.stack(images)
