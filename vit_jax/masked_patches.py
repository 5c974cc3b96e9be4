r"""Masked patch prediction: the self-supervised pre-training of the paper's Sec. 4.6.

Pure functions; the train loop composes them (config.objective = 'masked_patches'):

  kind, source = draw_corruption(rng, batch, num_patches, cfg)   # which patches, how
  outputs = model.apply(..., corrupt=(kind, source), patch_outputs=num_outputs(cfg, p))
  y = targets(images, p, cfg)                                   # from the clean image
  loss, metrics = prediction_loss(outputs, y, kind, cfg.target)  # corrupted patches only

What the paper says (Sec. 4.6 and Appendix B.1.2 of arXiv:2010.11929v2; the extract in
the project's notes has only these sections' headings):
- "we corrupt 50% of patch embeddings by either replacing their embeddings with a
  learnable [mask] embedding (80%), a random other patch embedding (10%) or just keeping
  them as is (10%)", as BERT does for words;
- "we predict the 3-bit, mean color (i.e., 512 colors in total) of every corrupted patch
  using their respective patch representations";
- targets tried: 1) the mean 3-bit colour (1 prediction of 512 colours), 2) a 4x4
  downsized patch in 3-bit colour (16 predictions of 512 colours), 3) L2 regression on
  the full patch (256 regressions on the 3 RGB channels); all worked, L2 slightly worse,
  1) reported (best few-shot); a 15% corruption rate was slightly worse;
- ViT-B/16, 1M steps (ca. 14 epochs) at batch 4096 on JFT, Adam, base LR 2e-4, 10k
  warm-up steps, cosine decay: 79.9% on ImageNet after fine-tuning, 2% better than from
  scratch, 4% behind supervised pre-training.

Choices where the paper is silent (each one a config field or documented here):
- Exactly round(corrupt_rate * N) patches of every image are corrupted (a uniformly
  random subset, as BERT's data generator picks a fixed count per sequence); each of
  them independently becomes [mask] / a random other patch / itself with probabilities
  mask_prob / random_prob / the rest. A fixed count makes the loss (a mean over
  corrupted patches) the same whether a batch is split into micro-batches or devices.
- "A random other patch embedding" is another patch of the same image (uniform over
  the other N-1 positions): no data moves between images, hence between devices.
- The [mask] embedding is added before the position embeddings (the replaced patch
  keeps its position), initialised normal(0.02) like BERT's token embeddings.
- The prediction head is one zero-initialised Dense on the final (encoder_norm) token
  representation, `masked_patch_head`; it and `mask_embedding` exist only in the
  pre-training parameter tree, and checkpoint.load_pretrained drops them as it drops
  pre-logits, so fine-tuning configs take the result unchanged.
- 3-bit colour of a value v in [0, 255] is its top 3 bits, floor(v * 8 / 256); images
  are in [-1, 1], so v = (x + 1) * 127.5 (rounded to 1/64 so that patch sums are exact
  in float32); the 512 classes are r * 64 + g * 8 + b.
  The mean colour is the per-channel mean over the patch, then quantised. The 4x4
  downsized patch averages (p/4)x(p/4) blocks, then quantises every cell.
- L2 regression predicts the patch's pixels in [-1, 1] (p*p*3 values, row-major HWC);
  the loss is their mean squared error.
- Randomness: kind and source are drawn from fold_in(rng, MASK_STREAM) where rng is the
  loop's fold_in(PRNGKey(seed), step), for the whole global batch at once: a function
  of (seed, step) only, so a resumed run and any device count or accum_steps see the
  same corruption (jax's threefry is partitionable: values do not depend on sharding).
"""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

OBJECTIVES = ('classification', 'masked_patches')
TARGETS = ('mean_color', 'downsized', 'pixels')
KEEP, MASK, RANDOM, SAME = 0, 1, 2, 3  # `kind` values: untouched; corrupted three ways.
MASK_STREAM = 0x6D61736B  # fold_in constant of the corruption draws ('mask').
# Parameters that exist only while pre-training with this objective.
PRETRAIN_ONLY = ('mask_embedding', 'masked_patch_head')


def default_config():
  """The `masked_patches` sub-config (paper defaults); configs/common.py holds a copy."""
  c = ml_collections.ConfigDict()
  c.target = 'mean_color'  # 'mean_color' (paper), 'downsized' (4x4 cells) or 'pixels' (L2).
  c.corrupt_rate = 0.5  # Fraction of each image's patches corrupted (paper: 50%).
  c.mask_prob = 0.8  # Of the corrupted: replaced by the [mask] embedding.
  c.random_prob = 0.1  # Of the corrupted: replaced by another patch; the rest stay as is.
  c.bits = 3  # Bits per colour channel of the classification targets (3: 512 colours).
  c.downsize = 4  # Cells per side of the 'downsized' target (4: 16 predictions).
  return c


# ---------------------------------------------------------------- validation
def validate(config):
  """Start-up checks of config.objective / config.masked_patches; one-line ValueError."""
  objective = config.get('objective', 'classification')
  if objective not in OBJECTIVES:
    raise ValueError(f'objective {objective!r} is unknown: set --config.objective to '
                     + ' or '.join(repr(o) for o in OBJECTIVES))
  if objective != 'masked_patches':
    return
  if 'masked_patches' not in config:
    raise ValueError('objective masked_patches needs the config.masked_patches fields: start '
                     'from --config=masked_patches:... or common.get_config()')
  m = config.masked_patches

  def fail(field, msg):
    raise ValueError(f'masked_patches.{field} {m[field]!r} {msg}')

  if config.get('pretrained_path'):
    raise ValueError(f'pretrained_path {config.pretrained_path!r} cannot start masked patch '
                     'pre-training (it starts from scratch): set --config.pretrained_path= or '
                     '--config.objective=classification')
  if m.target not in TARGETS:
    fail(
        'target', 'is unknown: set --config.masked_patches.target to '
        + ' or '.join(repr(t) for t in TARGETS))
  if not 0 < m.corrupt_rate <= 1:
    fail('corrupt_rate', 'must be in (0, 1]: set --config.masked_patches.corrupt_rate '
         '(the paper uses 0.5)')
  for field in ('mask_prob', 'random_prob'):
    if not 0 <= m[field] <= 1:
      fail(field, f'must be in [0, 1]: set --config.masked_patches.{field}')
  if m.mask_prob + m.random_prob > 1 + 1e-9:
    raise ValueError(f'masked_patches.mask_prob {m.mask_prob} + random_prob {m.random_prob} '
                     'exceed 1: lower one of them (the rest of the corrupted patches stay as is)')
  if m.target != 'pixels' and (int(m.bits) != m.bits or not 1 <= m.bits <= 8):
    fail('bits', 'must be an integer in [1, 8]: set --config.masked_patches.bits (paper: 3)')
  # Imported here: models imports nothing of this module, and tests build configs alone.
  from vit_jax import models  # pylint: disable=g-import-not-at-top
  fields = models.get_variant(config.model_name, **config.model)
  if fields['family'] != 'vit' or fields.get('resnet_layers') is not None:
    raise ValueError(f'model_name {config.model_name!r}: masked patch prediction needs a plain '
                     'ViT (the targets are pixel patches): set --config.model_name=ViT-...')
  p = fields['patch_size']
  if m.target == 'downsized' and (m.downsize < 1 or p % m.downsize):
    fail(
        'downsize', f'does not divide the patch size {p}: set '
        '--config.masked_patches.downsize to a divisor of it (paper: 4 for 16x16 patches)')
  n = (config.image_size // p)**2
  if n < 2:
    raise ValueError(f'image_size {config.image_size} gives {n} patch of size {p}: masked patch '
                     'prediction needs 2 or more; set a larger --config.image_size')
  if num_corrupted(n, m.corrupt_rate) < 1:
    fail('corrupt_rate', f'corrupts no patch of the {n}: raise '
         '--config.masked_patches.corrupt_rate')


def is_masked(config):
  return config.get('objective', 'classification') == 'masked_patches'


# ---------------------------------------------------------------- corruption
def num_corrupted(num_patches, rate):
  """Patches corrupted per image: round(rate * N) (half up)."""
  return int(np.floor(rate * num_patches + 0.5))


def draw_corruption(rng, batch_size, num_patches, cfg):
  """(kind, source), int32 [batch_size, num_patches] each, a pure function of `rng`.

  kind: KEEP (not corrupted), MASK ([mask] embedding), RANDOM (patch `source` of the same
  image, never itself) or SAME (corrupted but kept as is: still predicted).
  Exactly num_corrupted(N, cfg.corrupt_rate) patches per image are not KEEP.
  """
  k = num_corrupted(num_patches, cfg.corrupt_rate)
  r_pick, r_kind, r_src = jax.random.split(rng, 3)
  scores = jax.random.uniform(r_pick, (batch_size, num_patches))
  rank = jnp.argsort(jnp.argsort(scores, axis=1), axis=1)
  corrupted = rank < k
  u = jax.random.uniform(r_kind, (batch_size, num_patches))
  how = jnp.where(u < cfg.mask_prob, MASK,
                  jnp.where(u < cfg.mask_prob + cfg.random_prob, RANDOM, SAME))
  kind = jnp.where(corrupted, how, KEEP).astype(jnp.int32)
  offset = jax.random.randint(r_src, (batch_size, num_patches), 1, num_patches)
  source = ((jnp.arange(num_patches)[None, :] + offset) % num_patches).astype(jnp.int32)
  return kind, source


def corruption_for_step(rng, batch_size, num_patches, cfg):
  """draw_corruption from the loop's per-step rng, on a stream of its own."""
  return draw_corruption(jax.random.fold_in(rng, MASK_STREAM), batch_size, num_patches, cfg)


def corruption_for_images(rng, images, model, cfg):
  """corruption_for_step for a batch of images [n, H, W, C] and a plain-ViT `model`."""
  p = _patch_size(model)
  n, h, w = images.shape[:3]
  return corruption_for_step(rng, n, (h // p) * (w // p), cfg)


# ------------------------------------------------------------------- targets
def patchify(images, p):
  """[n, H, W, C] -> [n, (H/p)*(W/p), p, p, C], patches in row-major order (as the model)."""
  n, h, w, c = images.shape
  x = images.reshape(n, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(n, (h // p) * (w // p), p, p, c)


_STEPS = 64  # Sub-steps of an 8-bit step that pixel values are rounded to (see _units).


def _units(images):
  """[-1, 1] -> integers in [0, 255 * 64] (float32): 8-bit values in 1/64 steps.

  Sums of up to 1024 of them stay below 2**24, so they are exact in float32, and a patch
  mean is the correctly rounded sum / count: a mean on a bin edge is on it (not 1e-5
  below), so the classes are those of exact arithmetic on 8-bit pixels.
  """
  return jnp.round((images.astype(jnp.float32) + 1.0) * (127.5 * _STEPS))


def _classes(units, bits):
  """Colour class of [..., 3] values in _units: r * 4**bits + g * 2**bits + b."""
  levels = 2**int(bits)
  q = jnp.floor(units * (levels / (256.0 * _STEPS)))  # a power of 2: exact
  q = jnp.clip(q, 0, levels - 1).astype(jnp.int32)
  return (q[..., 0] * levels + q[..., 1]) * levels + q[..., 2]


def quantize(images, bits):
  """Colour class of [..., 3] pixels in [-1, 1]: the top `bits` bits of each 8-bit channel,
  r * 4**bits + g * 2**bits + b."""
  return _classes(_units(images), bits)


def num_outputs(cfg, patch_size, channels=3):
  """Outputs of the prediction head per patch."""
  if cfg.target == 'mean_color':
    return 2**(channels * int(cfg.bits))
  if cfg.target == 'downsized':
    return cfg.downsize**2 * 2**(channels * int(cfg.bits))
  return patch_size * patch_size * channels


def targets(images, patch_size, cfg):
  """Targets of every patch from the clean images: int32 [n, N] ('mean_color'), int32
  [n, N, d*d] ('downsized', cells row-major) or float32 [n, N, p*p*3] ('pixels')."""
  x = patchify(images.astype(jnp.float32), patch_size)  # [n, N, p, p, C]
  if cfg.target == 'pixels':
    return x.reshape(x.shape[0], x.shape[1], -1)
  u = _units(x)
  if cfg.target == 'mean_color':
    return _classes(jnp.mean(u, axis=(2, 3)), cfg.bits)
  d, p = cfg.downsize, patch_size
  n, num, _, _, c = u.shape
  cells = u.reshape(n, num, d, p // d, d, p // d, c).mean(axis=(3, 5))
  return _classes(cells.reshape(n, num, d * d, c), cfg.bits)


# ---------------------------------------------------------------------- loss
def prediction_loss(outputs, target, kind, target_kind):
  """(loss, metrics): the mean over corrupted patches (kind != KEEP) of the softmax
  cross-entropy (mean over cells for 'downsized') or of the pixels' squared error.

  outputs: float [n, N, num_outputs] from the model's masked_patch_head.
  metrics: 'masked_patch_accuracy' (classification targets: fraction of corrupted
  patches' predictions that are right) or 'masked_patch_mse'.
  """
  weight = (kind != KEEP).astype(jnp.float32)
  count = jnp.maximum(jnp.sum(weight), 1.0)
  outputs = outputs.astype(jnp.float32)
  if target_kind == 'pixels':
    per_patch = jnp.mean(jnp.square(outputs - target), axis=-1)
    loss = jnp.sum(per_patch * weight) / count
    return loss, {'masked_patch_mse': loss}
  if target_kind == 'mean_color':
    logits, labels = outputs[..., None, :], target[..., None]
  else:
    cells = target.shape[-1]
    logits = outputs.reshape(*outputs.shape[:-1], cells, -1)
    labels = target
  logp = jax.nn.log_softmax(logits, axis=-1)
  xent = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]  # [n, N, cells]
  right = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  loss = jnp.sum(jnp.mean(xent, -1) * weight) / count
  accuracy = jnp.sum(jnp.mean(right, -1) * weight) / count
  return loss, {'masked_patch_accuracy': accuracy}


# ------------------------------------------------------------ model plumbing
def _patch_size(model):
  if getattr(model, 'resnet_layers', None) is not None or not hasattr(model, 'patch_size'):
    raise ValueError('masked patch prediction needs a plain ViT: set --config.model_name=ViT-...')
  return model.patch_size


def apply(model, params, images, corrupt, cfg, *, train, rng=None):
  """The prediction head's outputs [n, N, num_outputs] for corrupted `images`."""
  rngs = {'dropout': rng} if rng is not None else None
  return model.apply({'params': params}, images, train=train, rngs=rngs, corrupt=corrupt,
                     patch_outputs=num_outputs(cfg, _patch_size(model), images.shape[-1]))


def loss_fn(model, params, images, corrupt, cfg, *, rng=None, train=True):
  """(loss, metrics) of one (micro-)batch; `corrupt` from corruption_for_step."""
  outputs = apply(model, params, images, corrupt, cfg, train=train, rng=rng)
  return prediction_loss(outputs, targets(images, _patch_size(model), cfg), corrupt[0], cfg.target)


def init_params(model, rng, image_size, cfg, channels=3):
  """The pre-training parameters: the ordinary ViT tree (class token, encoder; no head or
  pre-logits) plus `mask_embedding` and `masked_patch_head`."""
  n = (image_size // _patch_size(model))**2
  zeros = jnp.zeros((1, n), jnp.int32)
  images = jnp.zeros((1, image_size, image_size, channels), jnp.float32)
  return model.init(rng, images, train=False, corrupt=(zeros, zeros),
                    patch_outputs=num_outputs(cfg, model.patch_size, channels))['params']


def make_eval_step(model, config, seed=None):
  """(params, batch) -> {'correct', 'count'} over the corrupted patches of the valid rows,
  as train.make_eval_step does for images: the loop reports correct / count as the
  evaluation 'accuracy'. Classification targets: the fraction of right predictions (mean
  over cells for 'downsized'); 'pixels': whether the predicted patch has the target's
  3-bit mean colour. The corruption is fixed (drawn from `seed`, default config.seed),
  so evaluations are comparable between steps."""
  cfg = config.masked_patches
  key = jax.random.PRNGKey(config.seed if seed is None else seed)

  def step(params, batch):
    images = batch['image']
    corrupt = corruption_for_images(key, images, model, cfg)
    outputs = apply(model, params, images, corrupt, cfg, train=False)
    p = _patch_size(model)
    if cfg.target == 'pixels':
      patches = outputs.reshape(*outputs.shape[:2], p, p, images.shape[-1])
      predicted = quantize(jnp.mean(patches, axis=(2, 3)), 3)
      wanted = quantize(jnp.mean(patchify(images, p), axis=(2, 3)), 3)
      right = (predicted == wanted).astype(jnp.float32)
    else:
      wanted = targets(images, p, cfg)
      if cfg.target == 'mean_color':
        right = (jnp.argmax(outputs, -1) == wanted).astype(jnp.float32)
      else:
        logits = outputs.reshape(*wanted.shape, -1)
        right = jnp.mean((jnp.argmax(logits, -1) == wanted).astype(jnp.float32), -1)
    weight = (corrupt[0] != KEEP).astype(jnp.float32) * batch['mask'].astype(jnp.float32)[:, None]
    return {'correct': jnp.sum(right * weight), 'count': jnp.sum(weight)}

  return step


def without_pretraining_params(params):
  """The parameter tree without the pre-training-only entries (an ordinary ViT's)."""
  return {k: v for k, v in params.items() if k not in PRETRAIN_ONLY}
