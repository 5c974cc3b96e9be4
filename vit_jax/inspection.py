r"""Inspecting a Vision Transformer (paper Section 4.5, Appendix D.7).

Arrays first (pure numpy functions), matplotlib figures second, then a CLI:
  attention_rollout          Figures 6 / 14: attention from the class token to the input
  embedding_filters          Figure 7 left: principal components of the patch filters
  posemb_similarity          Figure 7 center: cosine similarity of position embeddings
  mean_attention_distance    Figure 7 right / Figure 11: attended distance in pixels
  attention_maps             the attention weights of a model, (layers, batch, heads, q, k)

Choices where the paper is silent:
  - rollout (Abnar & Zuidema, 2020): per layer A = (mean_heads(W) + I), rows
    renormalised (i.e. (W + I) / 2), and R = A_L ... A_1; the map is the class-token
    row of R over the patch tokens. Without a class token (classifier 'gap') the
    rows of all tokens are averaged (the representation is their mean). Masks for
    display are divided by their maximum.
  - mean attention distance: the class token is excluded from queries and keys, and
    each query's weights over the patch keys are renormalised to sum to 1; distances
    are between patch centres, `token_spacing(model)` apart.

CLI (vit-inspect = python -m vit_jax.inspection), a finished run or a published file:
  vit-inspect --workdir workdirs/quickstart --outdir figures/
  vit-inspect --checkpoint ViT-B_16.npz --model ViT-B_16 --images a.jpg b.png --outdir figures/
  vit-inspect --workdir workdirs/quickstart --images photos/   # the image files of a folder
"""
import functools
import io
import logging
import os
import re
import sys

from absl import flags
import jax
import numpy as np

from vit_jax import cli_help
from vit_jax import image_files
from vit_jax import model_flags
from vit_jax import paths
from vit_jax.models import variants

_BLOCK = re.compile(r'encoderblock_(\d+)$')


# ----------------------------------------------------------- model → arrays
@functools.partial(jax.jit, static_argnums=0)  # modules hash by their fields
def _intermediates(model, params, images):
  _, state = model.apply({'params': params}, images, train=False, mutable=['intermediates'])
  return state['intermediates']


def attention_maps(model, params, images):
  """Attention weights of every layer: [layers, batch, heads, q, k] float32.

  `images` are NHWC in [-1, 1]; read from the 'intermediates' the model sows.
  """
  blocks = _intermediates(model, params, images).get('Transformer', {})
  names = sorted((k for k in blocks if _BLOCK.match(k)),
                 key=lambda k: int(_BLOCK.match(k).group(1)))
  if not names:
    raise ValueError('The model sows no attention weights: use a ViT (not a BiT ResNet)')
  return np.stack([
      np.asarray(blocks[n]['MultiHeadDotProductAttention_1']['attention_weights'][0]) for n in names
  ])


# Images per forward pass of attention_summaries: the weights of every layer are held (in
# float64 for the rollout), 0.36 GB for 8 images through ViT-B/16 at 224.
IMAGES_PER_PASS = 8


def attention_summaries(model, params, images):
  """(attention_rollout [n, gh, gw], mean_attention_distance [layers, heads]) of `images`,
  run through the model IMAGES_PER_PASS at a time: any number of images in bounded memory
  (the paper averages the distances over 128)."""
  cls, spacing = has_class_token(params), token_spacing(model)
  grids, distance_sum = [], 0.0
  for start in range(0, len(images), IMAGES_PER_PASS):
    chunk = images[start:start + IMAGES_PER_PASS]
    attention = attention_maps(model, params, chunk)
    grids.append(attention_rollout(attention, cls))
    # Each image weighs the same in the mean (mean_attention_distance averages over images).
    distance_sum = distance_sum + len(chunk) * mean_attention_distance(attention, spacing, cls)
  return np.concatenate(grids), distance_sum / len(images)


def has_class_token(params):
  return 'cls' in params


def token_spacing(model):
  """Pixels between neighbouring token centres of a ViT module: variants.pixels_per_token
  of its own fields (patch size x the hybrid stem's stride)."""
  fields = {'family': 'vit', 'patch_size': model.patch_size, 'resnet_layers': model.resnet_layers}
  return variants.pixels_per_token(fields)


def _grid(num_tokens):
  side = int(round(np.sqrt(num_tokens)))
  if side * side != num_tokens:
    raise ValueError(f'{num_tokens} patch tokens are not a square grid: use square images')
  return side


# ------------------------------------------------------------ pure functions
def attention_rollout(attention, class_token=True):
  """Attention rollout from the output token to the patches.

  Args:
    attention: [layers, batch, heads, T, T] weights (rows sum to 1).
    class_token: whether token 0 is the class token (else the output is the mean
      of all tokens, and their rollout rows are averaged).

  Returns:
    [batch, gh, gw]: the rolled-out weight of each patch (>= 0; with a class token
    the patch weights sum to 1 minus the weight left on the class token itself).
  """
  attention = np.asarray(attention, np.float64)
  num_tokens = attention.shape[-1]
  a = attention.mean(axis=2) + np.eye(num_tokens)  # heads averaged, residual added
  a = a / a.sum(-1, keepdims=True)
  joint = a[0]
  for layer in a[1:]:
    joint = layer @ joint
  if class_token:
    row = joint[:, 0, 1:]
  else:
    row = joint.mean(axis=1)
  side = _grid(row.shape[-1])
  return row.reshape(-1, side, side)


def upsample_mask(grid_map, image_size):
  """[batch, gh, gw] -> [batch, S, S] in [0, 1]: divided by its max, bilinear."""
  grid_map = np.asarray(grid_map, np.float64)
  peak = grid_map.max(axis=(1, 2), keepdims=True)
  grid_map = np.where(peak > 0, grid_map / np.where(peak > 0, peak, 1), 0.0)
  resized = jax.image.resize(grid_map, (grid_map.shape[0], image_size, image_size),
                             method='bilinear')
  return np.clip(np.asarray(resized), 0.0, 1.0)


def embedding_filters(kernel, num_components=28):
  """Principal components of the patch-embedding filters (Figure 7 left).

  Args:
    kernel: [p, p, 3, D], the `embedding` Conv kernel: D filters of p*p*3 values.
    num_components: how many components.

  Returns:
    (components [n, p, p, 3], explained variance ratio [n]). Each component's sign
    makes its sum positive (PCA signs are arbitrary).
  """
  kernel = np.asarray(kernel, np.float64)
  p, q, c, d = kernel.shape
  if c != 3:
    raise ValueError(f'The embedding kernel has {c} input channels, not RGB (a hybrid): '
                     'filters are shown for plain ViTs only')
  filters = kernel.reshape(p * q * c, d).T  # one row per filter
  filters = filters - filters.mean(0)
  _, s, vt = np.linalg.svd(filters, full_matrices=False)
  n = min(num_components, len(s))
  comps = vt[:n] * np.where(vt[:n].sum(1, keepdims=True) < 0, -1.0, 1.0)
  ratio = s[:n]**2 / max(np.sum(s**2), 1e-30)
  return comps.reshape(n, p, q, c), ratio


def posemb_similarity(pos_embedding, class_token=True):
  """Cosine similarity of each patch's position embedding with all others.

  Args:
    pos_embedding: [1, T, D] or [T, D].
    class_token: drop token 0 (the class token's embedding).

  Returns:
    [gh, gw, gh, gw]: entry [i, j] is the tile of patch (row i, column j).
  """
  emb = np.asarray(pos_embedding, np.float64).reshape(-1, np.shape(pos_embedding)[-1])
  if class_token:
    emb = emb[1:]
  side = _grid(len(emb))
  unit = emb / np.maximum(np.linalg.norm(emb, axis=-1, keepdims=True), 1e-12)
  return (unit @ unit.T).reshape(side, side, side, side)


def patch_distances(side, pixels_per_token):
  """[N, N] Euclidean distances in pixels between patch centres of a side x side grid."""
  rows, cols = np.divmod(np.arange(side * side), side)
  centres = np.stack([rows, cols], -1) * float(pixels_per_token)
  return np.linalg.norm(centres[:, None] - centres[None, :], axis=-1)


def mean_attention_distance(attention, pixels_per_token, class_token=True):
  """Mean attended distance in pixels, per layer and head (Figure 7 right).

  For each query patch, the sum over key patches of weight x distance between the
  patch centres; averaged over queries and images. The class token is excluded
  from queries and keys; each query's weights over the patch keys are renormalised.

  Args:
    attention: [layers, batch, heads, T, T].
    pixels_per_token: pixels between neighbouring patch centres (the patch size).
    class_token: whether token 0 is the class token.

  Returns:
    [layers, heads] float64.
  """
  attention = np.asarray(attention, np.float64)
  if class_token:
    attention = attention[..., 1:, 1:]
  weights = attention / np.maximum(attention.sum(-1, keepdims=True), 1e-30)
  dist = patch_distances(_grid(weights.shape[-1]), pixels_per_token)
  per_query = np.einsum('lbhqk,qk->lbhq', weights, dist)
  return per_query.mean(axis=(1, 3))


# ---------------------------------------------------------------- figures
def _pyplot():
  # Where the home's .config is not writable (a read-only or missing home), matplotlib's
  # import warns twice, recommending MPLCONFIGDIR, and goes on in a temporary folder that
  # draws the same figures: those warnings are left out.
  matplotlib_logger = logging.getLogger('matplotlib')
  level = matplotlib_logger.level
  matplotlib_logger.setLevel(logging.ERROR)
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    if ('matplotlib.pyplot' not in sys.modules and 'ipykernel' not in sys.modules
        and not os.environ.get('MPLBACKEND')):
      matplotlib.use('Agg')  # files only; notebooks keep their inline backend
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  finally:
    matplotlib_logger.setLevel(level)
  return plt


def _to_unit(images):
  """Images in [-1, 1] (or uint8) -> float [0, 1] for display."""
  images = np.asarray(images, np.float64)
  if images.max() > 1.5:
    return np.clip(images / 255.0, 0, 1)
  return np.clip((images + 1.0) / 2.0, 0, 1)


def rollout_figure(images, masks, titles=None):
  """One row per image: the image, then the image weighted by its rollout mask."""
  plt = _pyplot()
  images, masks = _to_unit(images), np.asarray(masks)
  n = len(images)
  fig, axes = plt.subplots(n, 2, figsize=(6, 3 * n), squeeze=False)
  for i in range(n):
    axes[i, 0].imshow(images[i])
    axes[i, 0].set_title(titles[i] if titles else 'image')
    axes[i, 1].imshow(images[i] * masks[i][..., None])
    axes[i, 1].set_title('attention rollout')
    for ax in axes[i]:
      ax.axis('off')
  fig.tight_layout()
  return fig


def filters_figure(components, ratio=None, cols=7):
  """Components [n, p, p, 3] as RGB tiles, each scaled to [0, 1] on its own."""
  plt = _pyplot()
  n = len(components)
  rows = -(-n // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(1.2 * cols, 1.2 * rows + 0.4), squeeze=False)
  for i, ax in enumerate(axes.flat):
    ax.axis('off')
    if i < n:
      c = components[i]
      ax.imshow((c - c.min()) / max(c.max() - c.min(), 1e-12), interpolation='nearest')
  title = 'RGB embedding filters (first principal components)'
  if ratio is not None:
    title += f': {100 * np.sum(ratio):.0f}% of variance'
  fig.suptitle(title, fontsize=9)
  return fig


def posemb_figure(similarity):
  """Tiles [gh, gw, gh, gw] in a gh x gw mosaic, as Figure 7 center."""
  plt = _pyplot()
  gh, gw = similarity.shape[:2]
  gap = 1
  mosaic = np.full((gh * (gh + gap) - gap, gw * (gw + gap) - gap), np.nan)
  for i in range(gh):
    for j in range(gw):
      r, c = i * (gh + gap), j * (gw + gap)
      mosaic[r:r + gh, c:c + gw] = similarity[i, j]
  fig, ax = plt.subplots(figsize=(6, 5.4))
  im = ax.imshow(mosaic, vmin=-1, vmax=1, cmap='viridis', interpolation='nearest')
  ticks = [i * (gh + gap) + gh / 2 - 0.5 for i in range(gh)]
  ax.set_yticks(ticks, [str(i + 1) for i in range(gh)], fontsize=6)
  ax.set_xticks([j * (gw + gap) + gw / 2 - 0.5 for j in range(gw)], [str(j + 1) for j in range(gw)],
                fontsize=6)
  ax.set_xlabel('Input patch column')
  ax.set_ylabel('Input patch row')
  ax.set_title('Position embedding similarity')
  fig.colorbar(im, ax=ax, label='Cosine similarity', shrink=0.8)
  return fig


def attention_distance_figure(distances, image_size=None):
  """Scatter: x network depth (layer), y mean attention distance, a dot per head."""
  plt = _pyplot()
  distances = np.asarray(distances)
  layers, heads = distances.shape
  fig, ax = plt.subplots(figsize=(4.5, 4))
  for h in range(heads):
    ax.scatter(np.arange(1, layers + 1), distances[:, h], s=12, label=f'Head {h + 1}')
  ax.set_xticks(np.arange(1, layers + 1, max(1, layers // 12)))
  ax.set_xlabel('Network depth (layer)')
  ax.set_ylabel('Mean attention distance (pixels)')
  ax.set_ylim(0, image_size if image_size else None)
  if heads <= 16:
    ax.legend(fontsize=5, ncol=2, loc='lower right')
  ax.set_title('Size of attended area by head and depth')
  fig.tight_layout()
  return fig


def save_figure(fig, path):
  """Writes `fig` as PNG and closes it."""
  plt = _pyplot()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def figure_png(fig):
  """PNG bytes of `fig` (closes it)."""
  buf = io.BytesIO()
  save_figure(fig, buf)
  return buf.getvalue()


# -------------------------------------------------------------------- CLI
# A rollout figure each, all held in memory at once (0.6 MB each at 224): twice the 128
# images the paper's attention distances average over.
MAX_IMAGES = 256


def image_paths(items):
  """--images as files: folders searched as vit-predict searches them; at most MAX_IMAGES."""
  files = image_files.find(items)
  if len(files) > MAX_IMAGES:
    raise ValueError(f'--images names {len(files)} images; vit-inspect draws a figure for each '
                     f'and holds them all in memory: pass at most {MAX_IMAGES}')
  return files


def load_images(files, image_size, run_config=None):
  """Image files -> float32 [n, S, S, 3] in [-1, 1]: decoded and preprocessed as vit-predict
  does (the run's evaluation crop; 16-bit and gray images too)."""
  return image_files.load_images(files, image_files.eval_config(run_config, image_size))


def load_readable_images(files, image_size, run_config=None):
  """(the files read, their images) as load_images gives them, leaving out with a warning
  each file that cannot be read, as vit-predict does (one had stopped vit-inspect with the
  others unread). None readable: ValueError (one file: its reason)."""
  skipped = []
  config = image_files.eval_config(run_config, image_size)
  batch = next(image_files.batches(files, config, len(files), skipped.append), None)  # all in one
  if batch is None and len(files) == 1:
    raise skipped[0]  # an UnreadableImage: "PATH: its reason: the fix", as vit-predict says
  for error in skipped:
    print(f'warning: skipped {error}', file=sys.stderr, flush=True)
  if batch is None:
    raise ValueError(f'none of the {len(files)} images could be read: fix them as the warnings '
                     'above say')
  return batch


def inspect_model(model, params, image_size, images=None, names=None, outdir='.',
                  num_components=28):
  """Writes every figure for `model` (and `images`) into `outdir`; returns the paths."""
  os.makedirs(outdir, exist_ok=True)
  cls = has_class_token(params)
  written, arrays = [], {}

  def save(fig, name):
    path = os.path.join(outdir, name)
    save_figure(fig, path)
    written.append(path)

  kernel = np.asarray(params['embedding']['kernel'])
  if kernel.shape[2] == 3:
    comps, ratio = embedding_filters(kernel, num_components)
    arrays.update(filter_components=comps, filter_variance_ratio=ratio)
    save(filters_figure(comps, ratio), 'embedding_filters.png')
  sim = posemb_similarity(params['Transformer']['posembed_input']['pos_embedding'], cls)
  arrays['posemb_similarity'] = sim
  save(posemb_figure(sim), 'position_embedding_similarity.png')
  if images is not None and len(images):
    grid_maps, dist = attention_summaries(model, params, images)
    masks = upsample_mask(grid_maps, image_size)
    arrays.update(images=np.asarray(images, np.float32), rollout=grid_maps,
                  mean_attention_distance=dist)
    names = names or [f'image{i}' for i in range(len(images))]
    digits = max(2, len(str(len(names) - 1)))  # the files list in the images' order
    for i, name in enumerate(names):
      stem = os.path.splitext(os.path.basename(name))[0]
      save(rollout_figure(images[i:i + 1], masks[i:i + 1], [stem]),
           f'rollout_{i:0{digits}d}_{stem}.png')
    save(attention_distance_figure(dist, image_size), 'attention_distance.png')
  np.savez(os.path.join(outdir, 'arrays.npz'), **arrays)
  written.append(os.path.join(outdir, 'arrays.npz'))
  _remove_earlier_figures(outdir, written)
  return written


# The names inspect_model gives its figures.
_FIGURE_NAMES = re.compile(r'rollout_\d{2,}_.+\.png|attention_distance\.png|embedding_filters\.png'
                           r'|position_embedding_similarity\.png')


def _remove_earlier_figures(outdir, written):
  """Removes the figures an earlier call left in `outdir` that this one did not write again
  (its arrays.npz is replaced): a run of 2 images, then one of 1, had left the first run's
  second rollout beside the second run's arrays."""
  for name in os.listdir(outdir):
    path = os.path.join(outdir, name)
    if _FIGURE_NAMES.fullmatch(name) and path not in written and os.path.isfile(path):
      os.remove(path)


def _define_flags():
  """The CLI's flags, defined only when run as a program (importing defines none)."""
  model_flags.define_flags()
  flags.DEFINE_list(
      'images', [], 'Image files or folders of them (comma-separated; more may follow as '
      f'arguments: --images a.jpg b.png); at most {MAX_IMAGES} images.')
  flags.DEFINE_integer('num_components', 28, 'Principal components of the filters shown.',
                       lower_bound=1)
  flags.DEFINE_string('outdir', 'inspect', 'Folder the PNGs (and arrays.npz) go to.')
  return flags.FLAGS


def _check_outdir(outdir):
  """A ValueError naming the fix when --outdir cannot hold the figures. Creates nothing:
  a run that stops later (a bad image, a missing model) leaves no empty folder behind."""
  path = paths.resolve_folder_flag(outdir, '--outdir', 'figures')
  if paths.is_remote(path):  # had become a local folder named 'gs:'
    raise ValueError(f'--outdir {outdir}: vit-inspect writes local files: pass a local folder '
                     '(and copy it to the bucket after, e.g. with `gcloud storage cp -r`)')
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f'--outdir {outdir} is a file: pass a folder (new or existing)')
  existing = path
  while not os.path.exists(existing):  # the folder it would be created in
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f'--outdir {outdir}: part of that path is a file: pass a folder path')
  if not os.access(existing, os.W_OK | os.X_OK):
    where = 'is not writable' if existing == path else f'cannot be created in {existing}'
    raise ValueError(f'--outdir {outdir} {where}: pass a folder you can write to')


def main(argv):
  flags_ = flags.FLAGS
  files = list(flags_.images) + list(argv[1:])
  # A user's first matplotlib import builds its font cache and logs 'generated new
  # fontManager' at INFO, which absl's handler would print above the figures' paths.
  logging.getLogger('matplotlib').setLevel(logging.WARNING)
  try:
    _check_outdir(flags_.outdir)  # before the model loads
    run_config, model, params, image_size = model_flags.load(flags_)
    if 'embedding' not in params:
      raise ValueError('inspect draws Vision Transformer figures: this model has no patch '
                       'embedding (a BiT ResNet?)')
    files = image_paths(files) if files else []
    read, images = load_readable_images(files, image_size, run_config) if files else ([], None)
    try:
      written = inspect_model(model, params, image_size, images, read, flags_.outdir,
                              flags_.num_components)
    except OSError as e:
      raise ValueError(f'Cannot write the figures to --outdir {flags_.outdir} '
                       f'({e.strerror or e}): pass a folder you can write to') from None
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'vit-inspect: {e}')
  if not files:
    print('No --images: rollout and attention distance need images.')
  print('\n'.join(written))
  if len(read) < len(files):
    sys.exit(f'vit-inspect: {len(files) - len(read)} of {len(files)} images could not be read: '
             'fix them as the warnings above say, or leave them out')


def run_cli():
  """The `vit-inspect` console script."""
  _define_flags()
  cli_help.run(main, __name__, model_flags.__name__, program='vit-inspect')


if __name__ == '__main__':
  run_cli()
