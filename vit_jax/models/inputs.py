"""What the models take: a batch of float images [n, height, width, channels] (NHWC) in
[-1, 1]."""
import jax.numpy as jnp


def check_images(images):
  """ValueError naming the layout where `images` is not a batch of NHWC images: a single
  image, or PyTorch's NCHW, had been refused as a feature map not divisible by the patch;
  and naming the scaling where they are integers: uint8 pixels in [0, 255] had been taken
  without a word, and predicted as if 255x brighter."""
  shape = tuple(images.shape)
  if len(shape) != 4:
    raise ValueError(f'images of shape {shape}: expected a batch [n, height, width, channels] '
                     '(one image: images[None])')
  if shape[1] in (1, 3) and shape[3] not in (1, 3):
    raise ValueError(f'images of shape {shape} look channels-first (NCHW): the models take '
                     'NHWC, images.transpose(0, 2, 3, 1)')
  if not jnp.issubdtype(images.dtype, jnp.floating):
    raise ValueError(f'images of dtype {images.dtype}: the models take float images in [-1, 1] '
                     '(uint8 pixels: images / 127.5 - 1)')
