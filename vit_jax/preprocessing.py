"""ViT-paper image preprocessing: TF ops on one example, pure functions of (image, seed).

Training: an inception crop (random area and aspect; JPEG bytes decoded only inside the
window) or the whole image, resized to config.image_size, optionally flipped; evaluation:
the whole image resized, or a central crop. Both give float32 [S, S, 3] in [-1, 1]
(`x / 127.5 - 1`); gray and RGBA images become RGB. Randomness comes only from stateless
ops seeded with the example's own seed, so a stream of examples can be resumed exactly.
"""
import tensorflow as tf

from vit_jax import config_checks


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
  return tf.cond(
      tf.shape(image)[-1] == 1, lambda: tf.tile(image, [1, 1, 3]), lambda: image[..., :3])


def _decode(image: tf.Tensor) -> tf.Tensor:
  """Encoded bytes or a uint8 array -> uint8 [H, W, 3]."""
  if image.dtype == tf.string:
    image = tf.io.decode_image(image, channels=3, expand_animations=False)
    image.set_shape([None, None, 3])
    return image
  return _to_rgb(tf.convert_to_tensor(image, tf.uint8))


def _crop_box(shape: tf.Tensor, seed: tf.Tensor, min_area: float):
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      tf.cast(shape, tf.int32), bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
      seed=seed, min_object_covered=0.0, aspect_ratio_range=(3 / 4, 4 / 3),
      area_range=(min_area, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
  return begin, size


def inception_crop(image: tf.Tensor, seed: tf.Tensor, min_area: float = 0.05) -> tf.Tensor:
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
  crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  if config.pp.train_crop == 'inception':
    image = inception_crop(image, crop_seed, config.pp.inception_min_area)
  elif config.pp.train_crop == 'resize':
    image = _decode(image)
  else:
    raise config_checks.unknown_crop('train_crop', config.pp.train_crop, config_checks.TRAIN_CROPS)
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
    raise config_checks.unknown_crop('eval_crop', config.pp.eval_crop, config_checks.EVAL_CROPS)
  return _scale(image)
