"""What the models take: a batch of images [n, height, width, channels] (NHWC)."""


def check_images(images):
  """ValueError naming the layout where `images` is not a batch of NHWC images: a single
  image, or PyTorch's NCHW, had been refused as a feature map not divisible by the patch."""
  shape = tuple(images.shape)
  if len(shape) != 4:
    raise ValueError(f'images of shape {shape}: expected a batch [n, height, width, channels] '
                     '(one image: images[None])')
  if shape[1] in (1, 3) and shape[3] not in (1, 3):
    raise ValueError(f'images of shape {shape} look channels-first (NCHW): the models take '
                     'NHWC, images.transpose(0, 2, 3, 1)')
