"""Tests for vit_jax.inspection: rollout, attention distance, position-embedding similarity,
filters, figures and the CLI on a tiny ViT saved with checkpoint.save_npz."""
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from vit_jax import checkpoint
from vit_jax import image_files
from vit_jax import inspection as vit_inspect
from vit_jax import models
from vit_jax import preprocessing
from tests.conftest import console_script
from tests.test_predict import shell
from tests.test_predict import write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(num_layers=2, hidden_size=32, mlp_dim=64, num_heads=2, patch_size=7)
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def _assert_png(data, min_bytes=2000):
  if isinstance(data, str):
    with open(data, 'rb') as f:
      data = f.read()
  assert data[:8] == PNG_SIGNATURE and len(data) > min_bytes


def _broadcast(matrix, layers=3, batch=2, heads=4):
  return np.broadcast_to(matrix, (layers, batch, heads) + matrix.shape)


# ------------------------------------------------------------------ rollout
def test_rollout_of_identity_attention_leaves_nothing_on_patches():
  # Each token attends to itself; with the residual A = (I + I) / 2 = I, so the
  # joint attention is I: the class token keeps all of its weight, patches get 0.
  t = 1 + 16
  maps = vit_inspect.attention_rollout(_broadcast(np.eye(t)), class_token=True)
  assert maps.shape == (2, 4, 4)
  np.testing.assert_array_equal(maps, 0.0)
  np.testing.assert_array_equal(vit_inspect.upsample_mask(maps, 28), 0.0)  # no 0/0


def test_rollout_of_uniform_attention_is_closed_form():
  # A = (U + I) / 2 with U = 1/T everywhere; U^2 = U gives A^L = (1 - 2^-L) U + 2^-L I,
  # so every patch gets (1 - 2^-L) / T from the class token.
  t, layers = 1 + 9, 3
  maps = vit_inspect.attention_rollout(_broadcast(np.full((t, t), 1 / t), layers=layers))
  np.testing.assert_allclose(maps, (1 - 0.5**layers) / t, atol=1e-12)
  mask = vit_inspect.upsample_mask(maps, 12)
  assert mask.shape == (2, 12, 12)
  np.testing.assert_allclose(mask, 1.0, atol=1e-6)


def test_rollout_multiplies_layers_in_order():
  rng = np.random.default_rng(0)
  att = rng.random((2, 1, 3, 5, 5))
  att /= att.sum(-1, keepdims=True)
  a = [(l.mean(1)[0] + np.eye(5)) / 2 for l in att]  # rows already sum to 1
  expected = (a[1] @ a[0])[0, 1:].reshape(2, 2)
  np.testing.assert_allclose(vit_inspect.attention_rollout(att)[0], expected, atol=1e-12)
  # Without a class token: the mean of all rows, over all 4 = 2x2 tokens.
  gap = vit_inspect.attention_rollout(att[..., 1:, 1:] / att[..., 1:, 1:].sum(-1, keepdims=True),
                                      class_token=False)
  assert gap.shape == (1, 2, 2) and np.isclose(gap.sum(), 1.0)


# ------------------------------------------------------- attention distance
def test_attention_distance_self_and_uniform():
  side, ppt, t = 4, 16, 17
  self_att = vit_inspect.mean_attention_distance(_broadcast(np.eye(t)), ppt)
  assert self_att.shape == (3, 4)
  np.testing.assert_array_equal(self_att, 0.0)
  # Uniform attention (class token included in the keys: it is dropped and the rest
  # renormalised) -> the mean distance over all ordered patch pairs, brute force.
  d = vit_inspect.mean_attention_distance(_broadcast(np.full((t, t), 1 / t)), ppt)
  pairs = [
      np.hypot(r1 - r2, c1 - c2) * ppt for r1 in range(side) for c1 in range(side)
      for r2 in range(side) for c2 in range(side)
  ]
  np.testing.assert_allclose(d, np.mean(pairs), rtol=1e-12)


def test_attention_distance_of_neighbour_heads():
  # Head 0 attends to the patch to the right (or itself at the border), head 1 to itself.
  side, ppt = 3, 10
  n = side * side
  att = np.zeros((1, 1, 2, n + 1, n + 1))
  att[..., 0, 0] = 1.0
  for q in range(n):
    right = q + 1 if q % side < side - 1 else q
    att[0, 0, 0, q + 1, right + 1] = 1.0
    att[0, 0, 1, q + 1, q + 1] = 1.0
  d = vit_inspect.mean_attention_distance(att, ppt)
  np.testing.assert_allclose(d, [[ppt * 6 / 9, 0.0]])


# ----------------------------------------------------- position embeddings
def test_posemb_similarity_of_row_sinusoids():
  side, dim = 5, 16
  freqs = 1.0 / 10.0**(np.arange(dim // 2) / (dim // 2))
  rows = np.arange(side)[:, None] * freqs
  row_emb = np.concatenate([np.sin(rows), np.cos(rows)], -1)  # depends on the row only
  emb = np.repeat(row_emb, side, axis=0)  # token r*side + c gets row r's embedding
  cls = np.full((1, dim), 7.0)
  sim = vit_inspect.posemb_similarity(np.concatenate([cls, emb])[None], class_token=True)
  assert sim.shape == (side,) * 4
  for i in range(side):
    for j in range(side):
      tile = sim[i, j]
      np.testing.assert_allclose(tile[i], 1.0, atol=1e-12)  # its own row: identical
      np.testing.assert_allclose(tile, tile[:, :1] * np.ones((1, side)), atol=1e-12)
      np.testing.assert_allclose(tile, sim[i, 0], atol=1e-12)  # same for every column
      assert np.argmax(tile[:, 0]) == i
  flat = sim.reshape(side**2, side**2)
  np.testing.assert_allclose(flat, flat.T, atol=1e-12)
  np.testing.assert_allclose(np.diag(flat), 1.0, atol=1e-12)


def test_embedding_filters_recover_planted_components():
  rng = np.random.default_rng(0)
  p, d = 4, 64
  basis = np.linalg.qr(rng.normal(size=(p * p * 3, 2)))[0].T  # two orthonormal patterns
  coeffs = rng.normal(size=(d, 2)) * [10.0, 3.0]
  kernel = (coeffs @ basis + 0.01 * rng.normal(size=(d, p * p * 3))).T.reshape(p, p, 3, d)
  comps, ratio = vit_inspect.embedding_filters(kernel, num_components=3)
  assert comps.shape == (3, p, p, 3) and ratio[0] > ratio[1] > ratio[2]
  for i in range(2):
    assert abs(comps[i].ravel() @ basis[i]) > 0.99
  with pytest.raises(ValueError, match='not RGB'):
    vit_inspect.embedding_filters(np.zeros((1, 1, 8, 4)))


# ----------------------------------------------------------------- figures
def test_figures_render_to_png():
  rng = np.random.default_rng(0)
  images = rng.uniform(-1, 1, (2, 28, 28, 3))
  _assert_png(vit_inspect.figure_png(vit_inspect.rollout_figure(images, rng.random((2, 28, 28)))))
  _assert_png(vit_inspect.figure_png(vit_inspect.filters_figure(rng.normal(size=(10, 4, 4, 3)))))
  sim = vit_inspect.posemb_similarity(rng.normal(size=(1, 17, 8)))
  _assert_png(vit_inspect.figure_png(vit_inspect.posemb_figure(sim)))
  _assert_png(
      vit_inspect.figure_png(vit_inspect.attention_distance_figure(rng.random((4, 3)) * 28, 28)))


# ---------------------------------------------------------------- a model
@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('inspect')
  model = models.get_model('ViT-Ti_16', num_classes=10, **TINY)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 3)))['params']
  path = str(tmp / 'tiny.npz')
  checkpoint.save_npz(path, params)
  rng = np.random.default_rng(0)
  images = []
  for i, ext in enumerate(('jpg', 'png')):
    images.append(str(tmp / f'photo{i}.{ext}'))
    Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(images[-1])
  return dict(model=model, params=params, path=path, images=images, tmp=tmp)


def test_attention_maps_of_a_model(tiny):
  images = vit_inspect.load_images(tiny['images'], 28)
  assert images.shape == (2, 28, 28, 3) and -1 <= images.min() and images.max() <= 1
  att = vit_inspect.attention_maps(tiny['model'], tiny['params'], images)
  assert att.shape == (2, 2, 2, 17, 17)  # layers, batch, heads, q, k
  np.testing.assert_allclose(att.sum(-1), 1.0, atol=1e-5)
  assert vit_inspect.token_spacing(tiny['model']) == 7


def test_attention_summaries_of_more_images_than_a_pass_equal_one_pass_over_all(tiny):
  """vit-inspect had refused more than 32 images (the paper averages the distances over 128);
  it now runs them IMAGES_PER_PASS at a time: the same rollouts and the same mean."""
  rng = np.random.default_rng(1)
  n = vit_inspect.IMAGES_PER_PASS + 3
  images = rng.uniform(-1, 1, (n, 28, 28, 3)).astype(np.float32)
  grids, distances = vit_inspect.attention_summaries(tiny['model'], tiny['params'], images)
  attention = vit_inspect.attention_maps(tiny['model'], tiny['params'], images)
  np.testing.assert_allclose(grids, vit_inspect.attention_rollout(attention), rtol=1e-5)
  np.testing.assert_allclose(distances, vit_inspect.mean_attention_distance(attention, 7),
                             rtol=1e-5)
  assert grids.shape == (n, 4, 4) and distances.shape == (2, 2)


def test_attention_maps_of_a_model_with_a_pre_logits_layer(tiny):
  """Its Dense layer and the sown features had shared the scope name 'pre_logits':
  vit-inspect drew two figures of the paper's pre-training models and exited 1."""
  model = models.get_model('ViT-Ti_16', num_classes=10, representation_size=8, **TINY)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 3)))['params']
  images = vit_inspect.load_images(tiny['images'], 28)
  assert vit_inspect.attention_maps(model, params, images).shape == (2, 2, 2, 17, 17)


def test_cli_end_to_end(tiny):
  outdir = str(tiny['tmp'] / 'figures')
  cmd = [
      sys.executable, '-m', 'vit_jax.inspection', '--checkpoint', tiny['path'], '--model',
      'ViT-Ti_16', '--model_overrides', ','.join(f'{k}={v}' for k, v in TINY.items()),
      '--image_size', '28', '--num_components', '12', '--outdir', outdir, '--images',
      *tiny['images']
  ]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  names = sorted(os.listdir(outdir))
  assert names == [
      'arrays.npz', 'attention_distance.png', 'embedding_filters.png',
      'position_embedding_similarity.png', 'rollout_00_photo0.png', 'rollout_01_photo1.png'
  ]
  for name in names[1:]:
    _assert_png(os.path.join(outdir, name))
  with np.load(os.path.join(outdir, 'arrays.npz')) as arrays:
    assert arrays['mean_attention_distance'].shape == (2, 2)
    assert arrays['rollout'].shape == (2, 4, 4)
    assert arrays['posemb_similarity'].shape == (4, 4, 4, 4)
    assert arrays['filter_components'].shape == (12, 7, 7, 3)
  # Again into the same folder with one image: the first run's other figures go (a user's
  # file stays), so that the figures are those of the arrays.npz beside them.
  (tiny['tmp'] / 'figures' / 'notes.png').write_bytes(b'mine')
  out = subprocess.run(cmd[:-1], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert sorted(os.listdir(outdir)) == [
      'arrays.npz', 'attention_distance.png', 'embedding_filters.png', 'notes.png',
      'position_embedding_similarity.png', 'rollout_00_photo0.png'
  ]


def test_a_users_first_run_prints_the_figures_alone(tiny, tmp_path):
  """A home without matplotlib's font cache: building it had logged 'generated new
  fontManager' (absl's INFO format) above the figures' paths."""
  out = console_script('vit-inspect', tiny['tmp'], '--checkpoint', tiny['path'], '--model',
                       'ViT-Ti_16', '--model_overrides',
                       ','.join(f'{k}={v}' for k, v in TINY.items()), '--outdir',
                       str(tmp_path / 'f'), HOME=str(tmp_path / 'home'), MPLCONFIGDIR='',
                       XDG_CACHE_HOME='')
  assert out.returncode == 0, out.stderr[-2000:]
  assert (tmp_path / 'home' / '.cache' / 'matplotlib').is_dir()  # built by this run
  assert 'fontManager' not in out.stdout + out.stderr, out.stderr[-2000:]
  assert out.stdout.splitlines()[0] == 'No --images: rollout and attention distance need images.'


def test_a_home_matplotlib_cannot_write_in_changes_nothing_printed(tiny, tmp_path):
  """A read-only home (here a HOME that is a file): matplotlib's import had warned twice,
  recommending MPLCONFIGDIR, above the figures' paths; it draws them from a temporary folder."""
  home = tmp_path / 'home'
  home.write_text('')
  out = console_script('vit-inspect', tiny['tmp'], '--checkpoint', tiny['path'], '--model',
                       'ViT-Ti_16', '--model_overrides',
                       ','.join(f'{k}={v}' for k, v in TINY.items()), '--outdir',
                       str(tmp_path / 'f'), HOME=str(home), MPLCONFIGDIR='', XDG_CACHE_HOME='',
                       XDG_CONFIG_HOME='')
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'MPLCONFIGDIR' not in out.stderr and 'mkdir -p failed' not in out.stderr, out.stderr
  assert out.stdout.splitlines()[0] == 'No --images: rollout and attention distance need images.'
  assert (tmp_path / 'f' / 'embedding_filters.png').is_file()


def test_outdir_that_cannot_be_a_folder(tiny):
  home = tiny['tmp'] / 'outdir_user'
  home.mkdir()
  (home / 'afile').write_text('a file\n')
  model = [
      'vit-inspect', '--checkpoint', tiny['path'], '--model', 'ViT-Ti_16', '--model_overrides',
      ','.join(f'{k}={v}' for k, v in TINY.items()), '--image_size', '28'
  ]
  for outdir, message in (('afile', '--outdir afile is a file: pass a folder (new or existing)'),
                          ('afile/sub', '--outdir afile/sub: part of that path is a file: pass a '
                           'folder path'),
                          ('', '--outdir is empty (an unset shell variable?): pass a folder, e.g. '
                           '--outdir=figures'),
                          ('gs://bucket/figs', '--outdir gs://bucket/figs: vit-inspect writes '
                           'local files: pass a local folder (and copy it to the bucket after, '
                           'e.g. with `gcloud storage cp -r`)')):
    out = shell(model + ['--outdir', outdir], home)
    assert out.returncode == 1 and 'Traceback' not in out.stderr, out.stderr[-2000:]
    assert out.stderr.splitlines()[-1] == f'vit-inspect: {message}'
  (home / 'bad.jpg').write_text('not an image\n')
  out = shell(model + ['--images', 'bad.jpg'], home)
  assert out.returncode == 1 and 'Traceback' not in out.stderr, out.stderr[-2000:]
  assert out.stderr.splitlines()[-1] == (
      'vit-inspect: bad.jpg: not a JPEG, PNG, GIF, BMP or WebP image: convert it to JPEG, PNG, '
      'GIF, BMP or WebP')
  assert not (home / 'inspect').exists()  # the default --outdir: not left behind empty
  assert not (home / 'gs:').exists()
  out = shell(model + ['--num_components', '0'], home)
  assert out.returncode == 1 and out.stderr.splitlines()[-1] == (
      'vit-inspect: flag --num_components=0: 0 is not a positive integer (see --help)')


def test_images_from_a_folder_as_vit_predict_reads_them(tiny):
  """--images DIR: the image files under it, sorted, hidden ones left out; a folder of more
  than MAX_IMAGES, or a path that is not there, is one line."""
  home = tiny['tmp'] / 'folder_user'
  (home / 'photos' / 'sub').mkdir(parents=True)
  for i, path in enumerate(tiny['images']):
    shutil.copy(path, home / 'photos' / ('sub' if i else '') / os.path.basename(path))
  shutil.copy(tiny['images'][0], home / 'photos' / '.hidden.jpg')
  (home / 'photos' / 'notes.txt').write_text('not an image\n')
  model = [
      'vit-inspect', '--checkpoint', tiny['path'], '--model', 'ViT-Ti_16', '--model_overrides',
      ','.join(f'{k}={v}' for k, v in TINY.items()), '--image_size', '28'
  ]
  out = shell(model + ['--images', 'photos', '--outdir', 'figs'], home)
  assert out.returncode == 0, out.stderr[-2000:]
  assert sorted(n for n in os.listdir(home / 'figs') if n.startswith('rollout')) == [
      'rollout_00_photo0.png', 'rollout_01_photo1.png'
  ]
  # 101 images (the paper's distances average 128; 32 had been the most): a rollout each,
  # numbered to list in order, and those of an earlier run into the same folder removed.
  for i in range(99):
    shutil.copy(tiny['images'][0], home / 'photos' / f'copy{i:02d}.jpg')
  out = shell(model + ['--images', 'photos', '--outdir', 'figs'], home)
  assert out.returncode == 0, out.stderr[-2000:]
  rollouts = sorted(n for n in os.listdir(home / 'figs') if n.startswith('rollout'))
  assert rollouts[0] == 'rollout_000_copy00.png' and rollouts[-1] == 'rollout_100_photo1.png'
  assert len(rollouts) == 101
  with np.load(home / 'figs' / 'arrays.npz') as arrays:
    assert arrays['rollout'].shape == (101, 4, 4)
  out = shell(model + ['--images', 'photos/sub', '--outdir', 'figs'], home)
  assert out.returncode == 0, out.stderr[-2000:]
  assert sorted(
      n for n in os.listdir(home / 'figs') if n.startswith('rollout')) == ['rollout_00_photo1.png']
  for i in range(99, vit_inspect.MAX_IMAGES):
    shutil.copy(tiny['images'][0], home / 'photos' / f'copy{i}.jpg')
  for images, message in (('photos', f'--images names {vit_inspect.MAX_IMAGES + 2} images; '
                           'vit-inspect draws a figure for each and holds them all in memory: pass '
                           f'at most {vit_inspect.MAX_IMAGES}'),
                          ('nope.jpg', 'nope.jpg: no such file or folder: pass image files or '
                           'folders')):
    out = shell(model + ['--images', images, '--outdir', 'figs2'], home)
    assert out.returncode == 1 and 'Traceback' not in out.stderr, out.stderr[-2000:]
    assert out.stderr.splitlines()[-1] == f'vit-inspect: {message}'
    assert not (home / 'figs2').exists()


@pytest.mark.parametrize('image,copy', [
    ('gs://b/cat.jpg', 'gcloud storage cp -r'),
    ('https://example.com/cat.jpg?s=1&t=2', "curl -O 'https://example.com/cat.jpg?s=1&t=2'"),
])
def test_an_image_in_a_bucket_is_said_to_be_read_from_local_files(image, copy):
  """gs://B/cat.jpg had been called 'no such file or folder' (vit-predict, vit-inspect); a
  web address had been told to use gcloud."""
  with pytest.raises(ValueError) as e:
    image_files.find([image])
  assert str(e.value) == (f'{image}: images are read from local files: copy them here '
                          f'first (e.g. `{copy}`) and pass that path')


def test_a_trailing_comma_in_images_names_no_file(tmp_path):
  """`--images shoe.png,` had stopped with 'vit-inspect: : no such file or folder'."""
  Image.new('L', (8, 8)).save(tmp_path / 'shoe.png')
  assert image_files.find([str(tmp_path / 'shoe.png'), '']) == [str(tmp_path / 'shoe.png')]
  with pytest.raises(ValueError, match='^No images: pass image files or folders'):
    image_files.find([''])


def test_an_unreadable_image_is_left_out_as_vit_predict_does(tiny):
  """One damaged file among the images had stopped vit-inspect with no figure drawn; now it
  is named in a warning, the others are drawn, and the exit status is 1 (as vit-predict)."""
  home = tiny['tmp'] / 'damaged_user'
  (home / 'photos').mkdir(parents=True)
  shutil.copy(tiny['images'][0], home / 'photos' / 'a.jpg')
  (home / 'photos' / 'b.jpg').write_bytes(open(tiny['images'][1], 'rb').read()[:40])  # cut short
  model = [
      'vit-inspect', '--checkpoint', tiny['path'], '--model', 'ViT-Ti_16', '--model_overrides',
      ','.join(f'{k}={v}' for k, v in TINY.items()), '--image_size', '28'
  ]
  out = shell(model + ['--images', 'photos', '--outdir', 'figs'], home)
  assert out.returncode == 1 and 'Traceback' not in out.stderr, out.stderr[-2000:]
  warnings = [l for l in out.stderr.splitlines() if l.startswith('warning: skipped')]
  assert len(warnings) == 1 and warnings[0].startswith('warning: skipped photos/b.jpg: '), warnings
  assert out.stderr.splitlines()[-1] == (
      'vit-inspect: 1 of 2 images could not be read: fix them as the warnings above say, or '
      'leave them out')
  assert [n for n in os.listdir(home / 'figs') if n.startswith('rollout')] == ['rollout_00_a.png']
  with np.load(home / 'figs' / 'arrays.npz') as arrays:
    assert arrays['images'].shape[0] == 1
  shutil.copy(home / 'photos' / 'b.jpg', home / 'photos' / 'a.jpg')  # none readable now
  out = shell(model + ['--images', 'photos', '--outdir', 'figs2'], home)
  assert out.returncode == 1 and 'Traceback' not in out.stderr, out.stderr[-2000:]
  assert out.stderr.splitlines()[-1] == (
      'vit-inspect: none of the 2 images could be read: fix them as the warnings above say')
  assert not (home / 'figs2').exists()


def test_images_are_preprocessed_as_the_run_evaluates_them(tmp_path):
  """As vit-predict: TF decoding (16-bit PNGs scaled, images past Pillow's pixel limit
  read) and the run's pp.eval_crop (here a central crop)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  config = write_run(str(tmp_path / 'wd'), eval_crop='central')
  ramp = np.linspace(0, 65535, 28 * 28).reshape(28, 28).astype(np.uint16)
  Image.fromarray(ramp).save(tmp_path / 'gray16.png')
  assert Image.open(tmp_path / 'gray16.png').mode == 'I;16'
  rng = np.random.default_rng(0)
  Image.fromarray(rng.integers(0, 256, (30, 60, 3), dtype=np.uint8)).save(tmp_path / 'wide.png')
  Image.new('L', (14000, 14000)).save(tmp_path / 'big.png')  # Pillow's bomb check refuses it
  out = shell([
      'vit-inspect', '--workdir', 'wd', '--images', 'gray16.png,wide.png,big.png', '--outdir',
      'figs'
  ], tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  with np.load(tmp_path / 'figs' / 'arrays.npz') as arrays:
    images = arrays['images']
  assert images.shape == (3, 28, 28, 3)
  for image, name in zip(images[:2], ('gray16.png', 'wide.png')):
    want = preprocessing.preprocess_eval(tf.io.read_file(str(tmp_path / name)), config).numpy()
    np.testing.assert_allclose(image, want, atol=1e-6)
  assert abs(images[0].mean()) < 0.05  # the ramp, not clipped to white
  assert np.all(images[2] == -1)
