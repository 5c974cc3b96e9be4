"""Analytic FLOP counts for every model in the zoo, from the variant table alone.

    flops.forward_flops('ViT-B_16')                    # ~35.1e9 per 224px image
    flops.pretraining_exaflops('ViT-L_16', epochs=14)  # ~1567 (Table 6)

Conventions (the same for every family):
  * One multiply-add is 2 FLOPs.
  * Only convolutions and matmuls are counted: the patch embedding, q/k/v/out
    projections, attention logits (q.k) and the weighted sum of values, the MLP, the
    ResNet root conv and bottleneck convs (projections included), pre-logits and head.
    Elementwise work (LayerNorm/GroupNorm, softmax, GELU/ReLU/tanh, residual adds,
    pooling, weight standardisation) is left out; it is well under 1% of a ViT and a
    few % of a ResNet, see tests/test_flops.py for XLA's totals, which include it.
  * Zero padding is not multiplied: a convolution counts only the kernel taps that
    land on real input pixels. That is what XLA's cost analysis reports, and it is the
    convention that reproduces the paper's Table 6 (the ResNet rows are ~3.5% too high
    when padded taps are counted). `count_padding=True` gives the textbook count
    H_out * W_out * k * k * C_in * C_out instead.
  * Training costs 3x the forward pass: the backward pass computes the gradient with
    respect to the activations and with respect to the weights, each costing about one
    forward pass. (The input gradient of the first layer is not needed in practice; it
    is counted anyway, as is usual.)

Feature-map sizes follow the models' padding exactly: TF "SAME" in the hybrid stems
(models/resnet.py), fixed symmetric padding in BiT (models/bit.py); the stride of a
bottleneck sits on its 3x3 conv in both.
"""
import jax

from vit_jax import masked_patches
from vit_jax.models import variants

# JFT-300M, the pre-training set of Table 6: about 303M images in 18,291 classes.
JFT_IMAGES = 303_000_000
JFT_CLASSES = 18_291
# Backward = 2x forward (activation and weight gradients), so one step = 3x forward.
TRAIN_TO_FORWARD = 3


def _taps(size, k, stride, pad_lo, out, count_padding):
  """Along one axis: (output position, kernel offset) pairs that read a real pixel."""
  if count_padding:
    return out * k
  total = 0
  for t in range(k):
    # Output o reads input o * stride - pad_lo + t; keep it inside [0, size).
    first = max(0, -((t - pad_lo) // stride))  # ceil((pad_lo - t) / stride)
    last = min(out - 1, (size - 1 + pad_lo - t) // stride)
    total += max(0, last - first + 1)
  return total


def _conv(size, k, stride, pads, c_in, c_out, count_padding):
  """(FLOPs, output size) of a square k x k conv; pads is (lo, hi) or 'SAME'."""
  if pads == 'SAME':
    out = -(-size // stride)
    total = max((out - 1) * stride + k - size, 0)
    pads = (total // 2, total - total // 2)  # TF puts the odd pixel at the end
  out = (size + pads[0] + pads[1] - k) // stride + 1
  taps = _taps(size, k, stride, pads[0], out, count_padding)
  return 2 * taps * taps * c_in * c_out, out


def _bottleneck_stages(size, channels, layers, width, padding_3x3, count_padding):
  """(FLOPs, size, channels) of ResNet stages; pre- and post-activation alike.

  padding_3x3 is 'SAME' (hybrids) or (1, 1) (BiT).
  Stage i has width * 2**i mid channels and 4x that out; its first unit strides (stage
  2 on) on the 3x3 conv and projects the input when shape or channels change.
  """
  flops = 0
  for i, num_units in enumerate(layers):
    mid = width * 2**i
    for j in range(num_units):
      stride = 2 if i and not j else 1
      f1, _ = _conv(size, 1, 1, (0, 0), channels, mid, count_padding)
      f2, out = _conv(size, 3, stride, padding_3x3, mid, mid, count_padding)
      f3, _ = _conv(out, 1, 1, (0, 0), mid, 4 * mid, count_padding)
      flops += f1 + f2 + f3
      if channels != 4 * mid or stride != 1:
        flops += _conv(size, 1, stride, (0, 0), channels, 4 * mid, count_padding)[0]
      size, channels = out, 4 * mid
  return flops, size, channels


def _hybrid_stem(size, layers, width_factor, count_padding):
  """models/resnet.py: 7x7/2 conv, 3x3/2 max-pool, stages; all TF 'SAME'."""
  width = int(64 * width_factor)
  flops, size = _conv(size, 7, 2, 'SAME', 3, width, count_padding)
  size = -(-size // 2)  # max-pool, SAME
  f, size, channels = _bottleneck_stages(size, width, layers, width, 'SAME', count_padding)
  return flops + f, size, channels


def _bit_body(size, layers, width_factor, count_padding):
  """models/bit.py: 7x7/2 conv (pad 3), pad 1 + 3x3/2 VALID max-pool, stages (pad 1)."""
  width = int(64 * width_factor)
  flops, size = _conv(size, 7, 2, (3, 3), 3, width, count_padding)
  size = (size + 2 - 3) // 2 + 1
  f, size, channels = _bottleneck_stages(size, width, layers, width, (1, 1), count_padding)
  return flops + f, size, channels


def _encoder(tokens, hidden, mlp_dim, num_layers):
  """Transformer encoder: per layer 4 projections, 2 attention matmuls, 2 MLP matmuls."""
  projections = 4 * 2 * tokens * hidden * hidden
  # q.k logits and weights.v, all heads together (heads * head_dim = hidden).
  attention = 2 * 2 * tokens * tokens * hidden
  mlp = 2 * 2 * tokens * hidden * mlp_dim
  return num_layers * (projections + attention + mlp)


def _stem(fields, image_size, count_padding):
  """(FLOPs, size, channels) of the convolutional part before pooling/patching."""
  if fields['family'] == 'bit':
    return _bit_body(image_size, fields['resnet_layers'], fields['resnet_width'], count_padding)
  if fields['resnet_layers'] is None:
    return 0, image_size, 3
  return _hybrid_stem(image_size, fields['resnet_layers'], fields['resnet_width'], count_padding)


def feature_map_size(name, image_size=224, **overrides):
  """Side of the map the ResNet part hands on (BiT: to pooling; ViT: to patching)."""
  return _stem(variants.get_variant(name, **overrides), image_size, False)[1]


def forward_flops(name, image_size=224, num_classes=1000, *, count_padding=False, patch_outputs=0,
                  **overrides):
  """FLOPs of one forward pass of one image_size x image_size image.

  `overrides` are variant fields (patch_size, num_layers, resnet_layers, ...) as in
  models.get_model; num_classes=0 leaves the head out. count_padding: see above.
  patch_outputs: the masked patch objective's call (models/vit.py), whose head maps every
  patch token to patch_outputs values in place of pre-logits and the classification head.
  """
  fields = variants.get_variant(name, **overrides)
  flops, size, channels = _stem(fields, image_size, count_padding)
  if fields['family'] == 'bit':
    return flops + 2 * channels * num_classes  # global average pool -> head

  p, hidden = fields['patch_size'], fields['hidden_size']
  if size % p:
    raise ValueError(f'{name}: feature map {size}x{size} of a {image_size}px image is '
                     f'not divisible by patch size {p}')
  patches = (size // p)**2
  flops += 2 * patches * p * p * channels * hidden  # patch embedding, VALID
  tokens = patches + (fields['classifier'] == 'token')
  flops += _encoder(tokens, hidden, fields['mlp_dim'], fields['num_layers'])
  if patch_outputs:
    return flops + 2 * patches * hidden * patch_outputs
  features = hidden
  if fields['representation_size'] is not None:
    features = fields['representation_size']
    flops += 2 * hidden * features  # pre-logits
  return flops + 2 * features * num_classes


def train_flops(name, image_size=224, num_classes=1000, **overrides):
  """FLOPs of one training step per image: forward + backward = 3x forward."""
  return TRAIN_TO_FORWARD * forward_flops(name, image_size, num_classes, **overrides)


def train_step_flops(name, batch_size, image_size=224, num_classes=1000, **overrides):
  """FLOPs of one training step on a batch of `batch_size` images."""
  return batch_size * train_flops(name, image_size, num_classes, **overrides)


def step_flops(config, num_classes):
  """FLOPs of one step of the loop's `config` (global batch, config.model overrides), the
  numerator of MFU; the masked patch objective's (config.objective) with its head. Remat's
  recomputation and accumulation leave the model's FLOPs unchanged."""
  if masked_patches.is_masked(config):
    patch_size = variants.get_variant(config.model_name, **config.model)['patch_size']
    outputs = masked_patches.num_outputs(config.masked_patches, patch_size)
    return config.batch_size * TRAIN_TO_FORWARD * forward_flops(
        config.model_name, config.image_size, 0, patch_outputs=outputs, **config.model)
  return train_step_flops(config.model_name, config.batch_size, config.image_size, num_classes,
                          **config.model)


def pretraining_exaflops(name, epochs, num_images=JFT_IMAGES, image_size=224,
                         num_classes=JFT_CLASSES, **overrides):
  """Pre-training compute in exaFLOPs (1e18), as Table 6's last column.

  Defaults are JFT-300M's: 303M images, 18,291-way head. (The paper pre-trains ViTs
  with a pre-logits layer, representation_size=hidden_size: +2*D^2, under 0.02%.)
  """
  return train_flops(name, image_size, num_classes, **overrides) * epochs * num_images / 1e18


def xla_flops(fn, *args):
  """FLOPs XLA reports for jit(fn)(*args) after compilation (elementwise ops included)."""
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
    cost = cost[0]
  return float(cost['flops'])


def mfu(flops_per_step, step_seconds, peak_flops_per_second):
  """Model FLOPs utilisation: achieved FLOP/s over the hardware peak, in [0, 1]."""
  if step_seconds <= 0 or peak_flops_per_second <= 0:
    raise ValueError(f'step_seconds ({step_seconds}) and peak_flops_per_second '
                     f'({peak_flops_per_second}) must be positive')
  return flops_per_step / step_seconds / peak_flops_per_second
