"""Tests for vit-predict (vit_jax/predict.py): the console script on a tiny finished run,
run from the user's directory with relative paths."""
import os
import shlex
import shutil
import struct
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image
from PIL import ImageOps

from tests.conftest import with_flags
from vit_jax.configs import quickstart
from vit_jax import checkpoint
from vit_jax import image_files
from vit_jax import models

BIN = os.path.dirname(sys.executable)
TINY = dict(num_layers=2, hidden_size=32, mlp_dim=64, num_heads=2, patch_size=7)
TF_INTERNALS = ('{{function_node', '[Op:', 'Traceback')


def write_run(workdir, eval_crop='resize'):
  """A finished quickstart-like run of a tiny ViT (28 px, 10 classes): config.json and
  final.npz, as vit-train leaves them."""
  config = quickstart.get_config()
  config.model.update(TINY)
  config.pp.eval_crop = eval_crop
  model = models.from_config(config, 10)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 3)), train=False)['params']
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json())
  checkpoint.save_npz(os.path.join(workdir, 'final.npz'), params)
  return config


def save_random(path, size=(40, 30), mode='RGB', seed=0):
  rng = np.random.default_rng(seed)
  shape = (size[1], size[0], 3) if mode == 'RGB' else (size[1], size[0])
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)


def shell(argv, cwd, **env_vars):
  """Runs argv with the venv's commands on PATH; env_vars set (None: unset) variables."""
  env = dict(os.environ, PATH=f'{BIN}:' + os.environ.get('PATH', ''),
             XLA_FLAGS='--xla_force_host_platform_device_count=1', TF_CPP_MIN_LOG_LEVEL='3')
  env.update(env_vars)
  env = {k: v for k, v in env.items() if v is not None}
  return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def ours(stderr):
  """The lines of stderr that vit-predict writes (not the libraries' logging)."""
  return [l for l in stderr.splitlines() if l.startswith(('vit-predict:', 'warning: skipped'))]


def predicted(stdout):
  """{file: number of class lines} of vit-predict's output."""
  out, last = {}, None
  for line in stdout.splitlines():
    if line.startswith('  '):
      out[last] += 1
    else:
      last = line
      out[last] = 0
  return out


@pytest.fixture(scope='module')
def home(tmp_path_factory):
  """A user's directory: a finished run `wd` and images."""
  home = tmp_path_factory.mktemp('predict')
  write_run(str(home / 'wd'))
  save_random(str(home / 'img/mixed/good.png'))
  save_random(str(home / 'img/mixed/sub/s1.jpg'), seed=1)
  save_random(str(home / 'img/mixed/sub/deeper/s2.webp'), seed=2)
  save_random(str(home / 'img/mixed/.cache/hidden_folder.png'), seed=3)
  (home / 'img/mixed/bad.jpg').write_text('not an image\n')
  (home / 'img/mixed/.hidden.png').write_text('not an image either\n')
  for ext in ('gif', 'bmp', 'tiff'):
    save_random(str(home / f'img/pic.{ext}'), seed=4)
  (home / 'labels_dir').mkdir()
  (home / 'latin1.txt').write_bytes('caf\xe9\n'.encode('latin-1') * 10)
  return home


def test_folder_with_unreadable_and_hidden_files(home):
  out = shell(['vit-predict', '--workdir', 'wd', '--top_k', '2', 'img/mixed'], home)
  assert out.returncode == 1, out.stderr[-2000:]
  # The readable images are predicted; hidden files and folders are not listed at all.
  assert predicted(out.stdout) == {
      'img/mixed/good.png': 2,
      'img/mixed/sub/deeper/s2.webp': 2,
      'img/mixed/sub/s1.jpg': 2
  }
  assert ours(out.stderr) == [
      'warning: skipped img/mixed/bad.jpg: not a JPEG, PNG, GIF, BMP or WebP image: convert it '
      'to JPEG, PNG, GIF, BMP or WebP',
      'vit-predict: 1 of 4 files could not be read: fix them as the warnings above say, or '
      'leave them out'
  ]
  assert not any(s in out.stderr for s in TF_INTERNALS), out.stderr[-2000:]
  assert '.hidden' not in out.stderr + out.stdout and '.cache' not in out.stderr + out.stdout


def test_a_phone_photo_is_read_as_a_viewer_shows_it(home, tmp_path):
  """A JPEG whose EXIF orientation says to turn it (a portrait photo stored sideways) had
  been predicted lying on its side: an ankle boot of Fashion-MNIST came out a dress."""
  rows = np.linspace(0, 255, 28)[:, None] * np.ones((1, 40))
  stored = np.stack([rows, rows[::-1], np.zeros_like(rows)], -1)  # a gradient down the rows
  exif = Image.Exif()
  exif[0x0112] = 6  # stored turned 90 degrees counter-clockwise
  Image.fromarray(stored.astype(np.uint8)).save(tmp_path / 'photo.jpg', quality=100,
                                                exif=exif.tobytes())
  ImageOps.exif_transpose(Image.open(tmp_path / 'photo.jpg')).save(tmp_path / 'upright.png')
  config = image_files.eval_config(None, 28)
  photo, upright = (
      image_files.read_image(str(tmp_path / f), config) for f in ('photo.jpg', 'upright.png'))
  assert np.abs(photo
                - upright).mean() < 0.02  # PIL's and TensorFlow's JPEG decoders (not turned: 0.46)
  out = shell(['vit-predict', '--workdir', f'{home}/wd', 'photo.jpg', 'upright.png'], tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert lines[0] == 'photo.jpg' and lines[6] == 'upright.png', lines
  for a, b in zip(lines[1:6], lines[7:12]):
    assert a.split()[1:] == b.split()[1:] and abs(float(a.split()[0]) - float(b.split()[0])) < 0.02


def test_an_empty_file_and_a_folder_of_other_formats_name_their_fix(home, tmp_path):
  (tmp_path / 'empty.png').write_bytes(b'')
  save_random(str(tmp_path / 'scans/a.tiff'))
  (tmp_path / 'scans/notes.txt').write_text('not an image, not named\n')
  out = shell(['vit-predict', '--workdir', f'{home}/wd', 'empty.png'], tmp_path)
  assert out.returncode == 1 and ours(out.stderr)[0] == (
      'warning: skipped empty.png: empty (0 bytes): replace it with the image it should hold')
  out = shell(['vit-predict', '--workdir', f'{home}/wd', 'scans'], tmp_path)
  assert out.returncode == 1 and out.stderr.strip().splitlines()[-2:] == [
      'warning: left out 1 image file(s) under scans of a format not read (e.g. scans/a.tiff): '
      'convert them to JPEG, PNG, GIF, BMP or WebP',
      'vit-predict: scans holds no image files (.jpg, .jpeg, .png, .gif, .bmp, .webp, searched '
      'in its subfolders too): pass folders or files of JPEG, PNG, GIF, BMP or WebP images'
  ], out.stderr[-2000:]


def test_a_workdir_that_does_not_exist_is_not_called_a_run_without_its_config(tmp_path):
  """A typo had read as a broken run: 'has no config.json', as an empty folder does."""
  out = shell(['vit-evaluate', '--workdir', 'workdirs/quickstrat'], tmp_path)
  assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (
      1, f'vit-evaluate: {tmp_path}/workdirs/quickstrat does not exist: pass the --workdir of a '
      'vit-train run'), out.stderr[-2000:]
  (tmp_path / 'empty').mkdir()
  out = shell(['vit-evaluate', '--workdir', 'empty'], tmp_path)
  assert out.stderr.strip().splitlines()[-1] == (
      f'vit-evaluate: {tmp_path}/empty has no config.json: pass the --workdir of a vit-train run')


def test_a_folder_of_runs_or_a_runs_checkpoints_names_the_workdir_to_pass(tmp_path):
  """A vit-sweep's DIR, or a run's checkpoints/, had been called only a folder without
  config.json."""
  for point in ('base_lr=0.01', 'base_lr=0.03'):
    (tmp_path / 'sweep' / point / 'checkpoints').mkdir(parents=True)
    (tmp_path / 'sweep' / point / 'config.json').write_text('{}')
  (tmp_path / 'sweep' / 'summary.md').write_text('')
  out = shell(['vit-evaluate', '--workdir', 'sweep'], tmp_path)
  assert out.stderr.strip().splitlines()[-1] == (
      f'vit-evaluate: {tmp_path}/sweep has no config.json: pass the --workdir of a vit-train run '
      f'(this folder holds 2 runs in its folders: {tmp_path}/sweep/base_lr=0.01, '
      f'{tmp_path}/sweep/base_lr=0.03)'), out.stderr[-2000:]
  out = shell(['vit-evaluate', '--workdir', 'sweep/base_lr=0.01/checkpoints'], tmp_path)
  assert out.stderr.strip().splitlines()[-1] == (
      f'vit-evaluate: {tmp_path}/sweep/base_lr=0.01/checkpoints has no config.json: pass the '
      f'--workdir of a vit-train run (this is the checkpoints folder of {tmp_path}/sweep/'
      'base_lr=0.01: pass that, with --step N for one of them)'), out.stderr[-2000:]


def test_bmps_of_a_colour_table_predict_as_their_colours(tmp_path):
  """A 1-bit and an 8-bit palette BMP are predicted as the same picture saved as PNG
  (TensorFlow's decoder refused the first and read the second's indices as gray); a 16-bit
  BMP is skipped with what to do."""
  write_run(str(tmp_path / 'wd'))
  rng = np.random.default_rng(5)
  final = tmp_path / 'wd' / 'final.npz'
  with np.load(final, allow_pickle=False) as npz:
    flat = dict(npz)
  flat['head/kernel'] = rng.normal(size=flat['head/kernel'].shape).astype(np.float32)  # not 0
  np.savez(final, **flat)
  colours = rng.integers(0, 256, (4, 3), dtype=np.uint8)
  picture = Image.fromarray(colours[rng.integers(0, 4, (30, 40))])
  picture.save(tmp_path / 'colour.png')
  picture.convert('P', palette=Image.Palette.ADAPTIVE, colors=4).save(tmp_path / 'colour.bmp')
  two_tone = picture.convert('1')
  two_tone.save(tmp_path / 'two_tone.bmp')
  two_tone.convert('RGB').save(tmp_path / 'two_tone.png')
  Image.open(tmp_path / 'colour.png').save(tmp_path / 'rgb.bmp')
  data = bytearray((tmp_path / 'rgb.bmp').read_bytes())
  data[28:30] = (16).to_bytes(2, 'little')
  (tmp_path / 'sixteen.bmp').write_bytes(bytes(data))
  files = ['colour.png', 'colour.bmp', 'two_tone.png', 'two_tone.bmp', 'sixteen.bmp']
  out = shell(['vit-predict', '--workdir', 'wd', *files], tmp_path)
  assert out.returncode == 1, out.stderr[-2000:]
  lines = out.stdout.split('\n')
  shown = {lines[i]: lines[i + 1:i + 6] for i in range(0, len(lines) - 1, 6)}
  assert set(shown) == set(files[:4]), out.stdout
  assert shown['colour.bmp'] == shown['colour.png'] != shown['two_tone.png']
  assert shown['two_tone.bmp'] == shown['two_tone.png']
  assert ours(out.stderr) == [
      'warning: skipped sixteen.bmp: a 16-bit BMP, which is not read: save it as a 24-bit BMP, '
      'a PNG or a JPEG',
      'vit-predict: 1 of 5 files could not be read: fix them as the warnings above say, or '
      'leave them out'
  ]


def test_a_damaged_file_is_named_as_damaged_without_tensorflow_s_log(tmp_path):
  """A JPEG and a PNG cut short had been told to be converted to JPEG, PNG, ..., each after
  two lines of TensorFlow's C++ log (as in a user's shell: no TF_CPP_MIN_LOG_LEVEL)."""
  write_run(str(tmp_path / 'wd'))
  for name in ('cut.jpg', 'cut.png', 'whole.png', 'huge.jpg'):
    save_random(str(tmp_path / name), size=(280, 280))
  for name in ('cut.jpg', 'cut.png'):
    data = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(data[:len(data) // 2])
  # An intact photo of 14000x14000 pixels (here its header only) had been called damaged:
  # TensorFlow's decoder refuses 512 MiB of pixels as "Invalid JPEG data".
  data = (tmp_path / 'huge.jpg').read_bytes()
  frame = data.index(b'\xff\xc0') + 5  # the start of frame's height and width
  (tmp_path / 'huge.jpg').write_bytes(data[:frame] + struct.pack('>HH', 14000, 14000)
                                      + data[frame + 4:])
  # PNG headers of 40000x40000 and 1000001x1 pixels (their checksums made again), as
  # TensorFlow refuses them; the second had been called damaged.
  data = (tmp_path / 'whole.png').read_bytes()
  for name, size in (('vast.png', (40000, 40000)), ('wide.png', (1_000_001, 1))):
    header = b'IHDR' + struct.pack('>II', *size) + data[24:29]
    (tmp_path / name).write_bytes(data[:12] + header + struct.pack('>I', zlib.crc32(header))
                                  + data[33:])
  out = shell([
      'vit-predict', '--workdir', 'wd', 'cut.jpg', 'cut.png', 'whole.png', 'huge.jpg', 'vast.png',
      'wide.png'
  ], tmp_path, TF_CPP_MIN_LOG_LEVEL=None)
  assert out.returncode == 1, out.stderr[-2000:]
  assert predicted(out.stdout) == {'whole.png': 5}
  lines = out.stderr.splitlines()
  assert len(lines) == 6 and lines[0].startswith(
      'warning: skipped cut.jpg: damaged or cut short (') and lines[1].startswith(
          'warning: skipped cut.png: damaged or cut short ('), lines
  assert all(l.endswith('): replace it with an intact copy') for l in lines[:2]), lines
  assert lines[2] == ("warning: skipped huge.jpg: 14000x14000 pixels, too large for "
                      "TensorFlow's JPEG decoder, which stops at 512 MiB of pixels: downscale it")
  assert lines[3:5] == [
      f"warning: skipped {name}: {size} pixels, too large for TensorFlow's PNG decoder, which "
      'stops at 512 Mi pixels or 1,000,000 on a side: downscale it'
      for name, size in (('vast.png', '40000x40000'), ('wide.png', '1000001x1'))
  ]
  assert lines[5] == ('vit-predict: 5 of 6 files could not be read: fix them as the warnings '
                      'above say, or leave them out')


def test_predictions_into_a_reader_that_stopped_end_quietly(home):
  """`vit-predict ... | head -1` had ended with a BrokenPipeError traceback of ~20 lines."""
  read_end, write_end = os.pipe()
  os.close(read_end)
  env = dict(os.environ, PATH=f'{BIN}:' + os.environ.get('PATH', ''), TF_CPP_MIN_LOG_LEVEL='3')
  out = subprocess.run(['vit-predict', '--workdir', 'wd', 'img/pic.gif'], cwd=home, env=env,
                       stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
  os.close(write_end)
  assert (out.returncode, out.stderr) == (141, ''), out.stderr[-3000:]


def test_a_run_without_its_config_json_names_how_to_write_it_again(tmp_path):
  """It had said 'pass the --workdir of a vit-train run', which it was."""
  write_run(str(tmp_path / 'wd'))
  os.remove(tmp_path / 'wd' / 'config.json')
  save_random(str(tmp_path / 'cat.png'))
  out = shell(['vit-predict', '--workdir', 'wd', 'cat.png'], tmp_path)
  assert (out.returncode, ours(out.stderr)) == (1, [
      f'vit-predict: {tmp_path}/wd has a final.npz but no config.json: run its vit-train command '
      "again with --config.resume_changes='*' to write it again, or pass "
      f'--checkpoint={tmp_path}/wd/final.npz with its --model (and --model_overrides)'
  ]), out.stderr[-2000:]


def test_a_checkpoint_is_read_at_its_own_resolution(home, tmp_path):
  """--checkpoint without --image_size had predicted at 224 (position embeddings interpolated
  from the file's grid): a run's final.npz, or a 384 ImageNet file, then answered otherwise
  than at the resolution it was trained at. The file's grid now sets it."""
  shutil.copytree(home / 'wd', tmp_path / 'wd')
  params = checkpoint.load_npz(str(tmp_path / 'wd' / 'final.npz'))
  rng = np.random.default_rng(0)  # a head that tells resolutions apart (write_run's is zeros)
  params['head']['kernel'] = rng.normal(size=params['head']['kernel'].shape).astype(np.float32)
  checkpoint.save_npz(str(tmp_path / 'wd' / 'final.npz'), params)
  save_random(str(tmp_path / 'pic.png'))
  sizes = ','.join(f'{k}={v}' for k, v in TINY.items())
  from_file = [
      'vit-predict', '--checkpoint', 'wd/final.npz', '--model', 'ViT-Ti_16', '--model_overrides',
      sizes, 'pic.png'
  ]
  outs = [
      shell(argv, tmp_path) for argv in (['vit-predict', '--workdir', 'wd', 'pic.png'], from_file,
                                         from_file + ['--image_size', '224'])
  ]
  assert all(o.returncode == 0 for o in outs), [o.stderr[-2000:] for o in outs]
  # The probabilities in order (a published file knows no class names, the run does).
  run, file, at_224 = [[l.split()[0] for l in o.stdout.splitlines()[1:]] for o in outs]
  assert file == run and at_224 != run, [o.stdout for o in outs]


def test_a_checkpoint_of_other_sizes_names_model_overrides(home):
  """A tiny run's final.npz given as ViT-Ti_16 had been told to pick another model, with
  --model_overrides, the flag that gives it its sizes, unnamed."""
  out = shell(
      ['vit-predict', '--checkpoint', 'wd/final.npz', '--model', 'ViT-Ti_16', 'img/pic.gif'], home)
  assert out.returncode == 1, out.stderr[-2000:]
  assert ours(out.stderr)[-1].endswith(
      'the checkpoint has 2 encoder blocks where the model has 12 encoder blocks: pick the model '
      'matching the file, with num_layers=2 (--model, and --model_overrides for sizes that '
      "differ from the variant's, e.g. num_layers=4,hidden_size=64)"), out.stderr[-2000:]


@pytest.mark.parametrize('overrides,fix', [
    ('hidden_size=64', 'model.num_heads 3 does not divide model.hidden_size 64 (each head takes '
     'hidden_size / num_heads channels): set --model_overrides num_heads=N or --model_overrides '
     'hidden_size=N'),
    ('num_layers=0', 'model.num_layers 0 must be a whole number >= 1: set --model_overrides '
     'num_layers=N'),
])
def test_an_override_the_model_refuses_names_model_overrides(home, overrides, fix):
  """The model's checks name vit-train's --config.model.X, a flag vit-predict does not have."""
  out = shell([
      'vit-predict', '--checkpoint', 'wd/final.npz', '--model', 'ViT-Ti_16', '--model_overrides',
      overrides, 'img/pic.gif'
  ], home)
  assert (out.returncode, ours(out.stderr)[-1]) == (1, f'vit-predict: {fix}'), out.stderr[-2000:]


def test_formats_decode_image_reads_and_tiff_named_on_the_command_line(home):
  # As in a user's shell (no TF_CPP_MIN_LOG_LEVEL): a file of another format is told apart
  # before TensorFlow's decode, which logged its failure above the warning.
  out = shell(['vit-predict', '--workdir', 'wd', 'img/pic.tiff', 'img/pic.gif', 'img/pic.bmp'],
              home, TF_CPP_MIN_LOG_LEVEL=None)
  assert out.returncode == 1, out.stderr[-2000:]
  assert predicted(out.stdout) == {'img/pic.gif': 5, 'img/pic.bmp': 5}
  assert out.stderr.splitlines() == [
      'warning: skipped img/pic.tiff: not a JPEG, PNG, GIF, BMP or WebP image: convert it to '
      'JPEG, PNG, GIF, BMP or WebP',
      'vit-predict: 1 of 3 files could not be read: fix them as the warnings above say, or '
      'leave them out'
  ]
  # Every extension a folder is searched for is a format the message names.
  names = {
      '.jpg': 'JPEG',
      '.jpeg': 'JPEG',
      '.png': 'PNG',
      '.gif': 'GIF',
      '.bmp': 'BMP',
      '.webp': 'WebP'
  }
  assert set(image_files.IMAGE_EXTENSIONS) == set(names)
  assert all(n in image_files.FORMATS for n in names.values())
  assert 'TIFF' not in image_files.FORMATS


@pytest.mark.parametrize('labels,reason', [('labels_dir', 'Is a directory'),
                                           ('latin1.txt', 'not UTF-8 text')])
def test_unreadable_labels_file(home, labels, reason):
  out = shell(['vit-predict', '--workdir', 'wd', '--labels', labels, 'img/mixed/good.png'], home)
  assert out.returncode == 1 and 'Traceback' not in out.stderr, out.stderr[-2000:]
  assert ours(out.stderr) == [
      f'vit-predict: --labels {labels}: cannot read it ({reason}): pass a UTF-8 text file of '
      'class names, one per line'
  ]


def test_top_k_is_at_least_one_and_at_most_the_classes(home):
  for k in ('0', '-1'):
    out = shell(['vit-predict', '--workdir', 'wd', f'--top_k={k}', 'img/mixed/good.png'], home)
    assert out.returncode == 1 and not out.stdout, out.stderr[-2000:]
    assert ours(
        out.stderr) == [f'vit-predict: --top_k={k}: pass 1 or more (classes shown per '
                        'image)']
  out = shell(['vit-predict', '--workdir', 'wd', '--top_k=50', 'img/mixed/good.png'], home)
  assert out.returncode == 0, out.stderr[-2000:]
  assert predicted(out.stdout) == {'img/mixed/good.png': 10}


def test_images_are_decoded_one_batch_at_a_time(home, monkeypatch):
  reads = []
  monkeypatch.setattr(image_files, 'read_image',
                      lambda path, config: reads.append(path) or np.zeros((28, 28, 3), np.float32))
  skipped = []
  stream = image_files.batches([f'{i}.png' for i in range(5)], None, batch_size=2,
                               on_skip=skipped.append)
  paths, images = next(stream)
  assert paths == ['0.png', '1.png'] and images.shape == (2, 28, 28, 3)
  assert reads == ['0.png', '1.png']  # nothing beyond the first batch decoded yet
  assert [p for p, _ in stream] == [['2.png', '3.png'], ['4.png']]


def test_a_16_bit_gray_png_is_scaled_not_clipped(tmp_path):
  path = str(tmp_path / 'gray16.png')
  Image.fromarray(np.linspace(0, 65535, 28 * 28).reshape(28, 28).astype(np.uint16)).save(path)
  assert Image.open(path).mode == 'I;16'
  image = image_files.read_image(path, image_files.eval_config(None, 28))
  assert image.shape == (28, 28, 3) and abs(image.mean()) < 0.02  # a ramp from -1 to 1
  assert image.min() == -1 and image.max() == 1


def test_a_published_file_needs_its_model_named(home):
  # The shapes alone do not say the patch size; ViT-B_16 was silently assumed.
  out = shell(['vit-predict', '--checkpoint', 'wd/final.npz', 'img/mixed/good.png'], home)
  assert out.returncode == 1, out.stderr[-2000:]
  assert ours(out.stderr) == [
      'vit-predict: --checkpoint wd/final.npz needs --model NAME: the model the file was '
      'trained as, e.g. ViT-B_16 (names: vit_jax.models.VARIANTS)'
  ]


@pytest.mark.parametrize('program', ['vit-predict', 'vit-evaluate', 'vit-inspect'])
def test_another_runs_final_npz_in_the_workdir_is_one_line(program, tmp_path):
  """A final.npz copied in from a run of another model size: flax's ScopeParamShapeError
  traceback (58 lines) at the first forward pass; vit-inspect without --images exited 0."""
  write_run(str(tmp_path / 'small'))
  config = quickstart.get_config()
  config.model.update(TINY, hidden_size=48)
  model = models.from_config(config, 10)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 3)), train=False)['params']
  checkpoint.save_npz(str(tmp_path / 'small' / 'final.npz'), params)
  save_random(str(tmp_path / 'cat.png'))
  argv = {
      'vit-predict': ['cat.png'],
      'vit-evaluate': ['--shots', '1', '--seeds', '0'],
      'vit-inspect': ['--outdir', 'figures']
  }[program]
  out = shell([program, '--workdir', 'small', *argv], tmp_path)
  assert (out.returncode, out.stderr.strip().splitlines()[-1:]) == (1, [
      f'{program}: {tmp_path}/small/final.npz does not fit the model of its run\'s config.json '
      '(Transformer/encoder_norm/bias: file (48,) vs model (32,)): run vit-train again with the '
      'same --workdir to write it again from the last checkpoint, or pass the file as '
      '--checkpoint with its --model'
  ]), out.stderr[-3000:]
  assert 'Traceback' not in out.stderr and not (tmp_path / 'figures').exists()


@pytest.mark.parametrize('program', ['vit-predict', 'vit-evaluate'])
def test_a_head_kernel_that_disagrees_with_its_bias_is_blamed_on_the_file(program, tmp_path):
  """The head's size is read from its kernel: a kernel cut to 5 classes beside the run's
  10-class bias had been reported as 'head/bias: file (10,) vs model (5,)', the right array."""
  write_run(str(tmp_path / 'run'))
  final = tmp_path / 'run' / 'final.npz'
  with np.load(final, allow_pickle=False) as npz:
    flat = dict(npz)
  flat['head/kernel'] = flat['head/kernel'][:, :5]
  np.savez(final, **flat)
  save_random(str(tmp_path / 'cat.png'))
  argv = ['cat.png'] if program == 'vit-predict' else ['--shots', '1', '--seeds', '0']
  out = shell([program, '--workdir', 'run', *argv], tmp_path)
  assert (out.returncode, out.stderr.strip().splitlines()[-1:]) == (1, [
      f'{program}: {final} holds head/kernel (32, 5) and head/bias (10,), which disagree on '
      "the layer's size: run vit-train again with the same --workdir to write it again from "
      'the last checkpoint'
  ]), out.stderr[-3000:]


def test_a_published_file_without_its_head_bias_is_refused(tmp_path):
  """--checkpoint uses the file's head as it is: a missing head/bias had been replaced by
  zeros, and the predictions printed, exit 0 (the same file in a workdir was refused)."""
  write_run(str(tmp_path / 'run'))
  with np.load(tmp_path / 'run' / 'final.npz', allow_pickle=False) as npz:
    flat = {k: v for k, v in npz.items() if k != 'head/bias'}
  np.savez(tmp_path / 'nobias.npz', **flat)
  save_random(str(tmp_path / 'cat.png'))
  overrides = ','.join(f'{k}={v}' for k, v in TINY.items())
  out = shell([
      'vit-predict', '--checkpoint', 'nobias.npz', '--model', 'ViT-Ti_16', '--image_size', '28',
      '--model_overrides', overrides, 'cat.png'
  ], tmp_path)
  assert (out.returncode, out.stderr.strip().splitlines()[-1:], out.stdout) == (1, [
      'vit-predict: nobias.npz holds head/kernel but no head/bias: it is damaged: download or '
      'export it again'
  ], ''), out.stderr[-3000:]


@pytest.mark.parametrize('program', ['vit-predict', 'vit-evaluate'])
def test_a_damaged_class_names_file_is_one_line(program, tmp_path):
  """A class_names.txt that is not UTF-8: "'utf-8' codec can't decode byte 0xff ...", which
  named neither the file nor the fix."""
  write_run(str(tmp_path / 'run'))
  (tmp_path / 'run' / 'class_names.txt').write_bytes(b'\xff\xfe\x00cat\n')
  save_random(str(tmp_path / 'cat.png'))
  argv = ['cat.png'] if program == 'vit-predict' else ['--shots', '1', '--seeds', '0']
  out = shell([program, '--workdir', 'run', *argv], tmp_path)
  assert (out.returncode, out.stderr.strip().splitlines()[-1:]) == (1, [
      f'{program}: {tmp_path}/run/class_names.txt cannot be read (not UTF-8 text): restore it, '
      "or delete it (the classes are then named from the run's dataset, where it is at hand)"
  ]), out.stderr[-3000:]


def test_class_names_of_another_head_are_one_line(tmp_path):
  """A final.npz whose head is not the recorded classes' had been predicted with bare class
  numbers, exit 0."""
  write_run(str(tmp_path / 'run'))  # a 10-class head
  (tmp_path / 'run' / 'class_names.txt').write_text('cat\ndog\n')
  save_random(str(tmp_path / 'cat.png'))
  out = shell(['vit-predict', '--workdir', 'run', 'cat.png'], tmp_path)
  assert (out.returncode, out.stderr.strip().splitlines()[-1:]) == (1, [
      'vit-predict: run/class_names.txt names 2 classes but final.npz has a 10-class head, so '
      'they are of different runs: run vit-train again with the same --workdir, or pass --labels'
  ]), out.stderr[-3000:]


def test_model_flags_beside_a_workdir_are_refused_not_ignored(home):
  # The run's config.json names its model and resolution: these flags had been dropped silently.
  out = shell([
      'vit-predict', '--workdir', 'wd', '--image_size', '64', '--model_overrides', 'num_layers=2',
      'img/mixed/good.png'
  ], home)
  assert out.returncode == 1, out.stderr[-2000:]
  assert ours(out.stderr) == [
      'vit-predict: --model_overrides and --image_size only with --checkpoint: --workdir wd '
      "brings the run's own model, overrides and resolution (its config.json); drop "
      '--model_overrides and --image_size'
  ]


def test_a_folder_run_keeps_its_class_names_for_predict_and_evaluate(tmp_path):
  """vit-train records the head's class names (class_names.txt). vit-predict names classes
  after the training folder moved; vit-evaluate reads a held-out folder of some of them by
  name and refuses one with a class the run did not train."""
  from tests import data_fixtures  # pylint: disable=g-import-not-at-top
  data_fixtures.write_folder(str(tmp_path / 'pets'), 'train', {
      'Ant': [0, 1],
      'cat': [2, 3],
      'dog': [4, 5]
  })
  data_fixtures.write_folder(str(tmp_path / 'pets'), 'test', {'Ant': [6], 'cat': [7], 'dog': [8]})
  data_fixtures.write_folder(str(tmp_path / 'zoo'), 'test', {'zebra': [6], 'cat': [7], 'dog': [8]})
  data_fixtures.write_folder(str(tmp_path / 'seen'), 'test', {'cat': [7, 9, 11], 'dog': [8, 10]})
  train = shell([
      'vit-train', '--config=quickstart', '--config.dataset=folder:pets', '--workdir=wd',
      '--config.total_steps=2', '--config.warmup_steps=1', '--config.batch_size=6',
      '--config.model.num_layers=1'
  ], tmp_path)
  assert train.returncode == 0, train.stderr[-2000:]
  assert 'folder:' + str(tmp_path / 'pets') + ': 3 classes (Ant, cat, dog); train: 6 images, ' \
      'test: 3 images' in train.stderr
  assert (tmp_path / 'wd' / 'class_names.txt').read_text() == 'Ant\ncat\ndog\n'
  # Resumed with a class folder renamed: the labels, numbered by the sorted names, had
  # shifted without a word, and class_names.txt been rewritten in the new order.
  for split in ('train', 'test'):
    os.rename(tmp_path / 'pets' / split / 'Ant', tmp_path / 'pets' / split / 'bee')
  again = shell(
      with_flags(train.args, ['--config.total_steps=4', '--config.resume_changes=total_steps']),
      tmp_path)
  assert (again.returncode, again.stderr.strip().splitlines()[-1]) == (
      1, f"vit-train: folder:{tmp_path}/pets names its class 0 'bee' where the run in "
      f"{tmp_path}/wd trained 'Ant' (class_names.txt): its labels would no longer be the head's; "
      'give the classes their names back, or use another --workdir for this data'
  ), again.stderr[-2000:]
  assert (tmp_path / 'wd' / 'class_names.txt').read_text() == 'Ant\ncat\ndog\n'
  os.rename(tmp_path / 'pets', tmp_path / 'pets_moved')
  out = shell(['vit-predict', '--workdir', 'wd', '--top_k', '3', 'zoo/test/cat/00007.png'],
              tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  assert sorted(
      line.split()[-2:][0] for line in out.stdout.splitlines()[1:]) == ['Ant', 'cat', 'dog']
  out = shell(['vit-evaluate', '--workdir', 'wd', '--mode', 'top1', '--dataset', 'folder:zoo'],
              tmp_path)
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1:] == [
      "vit-evaluate: folder:zoo has 1 class(es) the run did not train ('zebra'; class_names.txt "
      "of wd names its 3): top-1 reads the head's classes by name: evaluate on folders named as "
      "the run's classes, or use --mode fewshot"
  ]
  # A held-out folder of two of the three classes had been refused (2 classes, a 3-class
  # head). Its labels (cat 0, dog 1) are read by name as the head's (1, 2): its top-1 is
  # vit-predict's. The default mode, all, had stopped at the folder's missing train split:
  # top-1, and a row on why there is no k-shot.
  out = shell(['vit-evaluate', '--workdir', 'wd', '--dataset', 'folder:seen'], tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  row = out.stdout.splitlines()[1].split()
  assert row[:2] == ['top1', 'test'] and ' '.join(row[3:]) == '(5 images of 2 of the 3 classes)'
  assert out.stdout.splitlines()[2].split(None, 2) == [
      'fewshot', 'seen', "skipped: train_split 'train': Unknown split 'train'. Should be one of "
      "['test']: set --train_split"
  ], out.stdout
  top = shell(['vit-predict', '--workdir', 'wd', '--top_k', '1', 'seen'], tmp_path)
  assert top.returncode == 0, top.stderr[-2000:]
  lines = top.stdout.splitlines()  # a file, then its top class indented: "  0.41  cat (1)"
  hits = [f'/{top_class.split()[1]}/' in file for file, top_class in zip(lines[::2], lines[1::2])]
  assert len(hits) == 5 and float(row[2]) == pytest.approx(sum(hits) / 5), (out.stdout, top.stdout)
  # Few-shot on another dataset does not read the run's own (moved away): it had been refused.
  out = shell([
      'vit-evaluate', '--workdir', 'wd', '--mode', 'fewshot', '--fewshot_datasets', 'folder:zoo',
      '--train_split', 'test', '--eval_split', 'test', '--shots', '1', '--seeds', '0'
  ], tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines()[1].split()[:3] == ['fewshot', 'zoo', '1-shot'], out.stdout


def test_few_shot_datasets_of_one_folder_name_are_two_rows(home, tmp_path):
  """Rows were keyed by the folder's name: of two folders named data, one was left out of
  the table and of the mean, without a word."""
  from tests import data_fixtures  # pylint: disable=g-import-not-at-top
  for parent, first in (('c1', 0), ('c2', 20)):
    for split in ('train', 'test'):
      data_fixtures.write_folder(str(tmp_path / parent / 'data'), split, {
          'a': [first, first + 1],
          'b': [first + 2, first + 3]
      })
  out = shell([
      'vit-evaluate', '--workdir', f'{home}/wd', '--mode', 'fewshot', '--fewshot_datasets',
      'folder:c1/data,folder:c2/data', '--shots', '1', '--seeds', '0'
  ], tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [line.split()[:3] for line in out.stdout.splitlines()[1:]]
  assert rows == [['fewshot', 'c1/data', '1-shot'], ['fewshot', 'c2/data', '1-shot'],
                  ['fewshot', 'mean', '1-shot']], out.stdout
  out = shell([
      'vit-evaluate', '--workdir', f'{home}/wd', '--mode', 'fewshot', '--fewshot_datasets',
      'folder:c1/data,folder:c1/data'
  ], tmp_path)
  assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (
      1, 'vit-evaluate: --fewshot_datasets names folder:c1/data twice: list each dataset once')


@pytest.mark.parametrize('program', ['vit-predict', 'vit-evaluate', 'vit-inspect'])
def test_a_mistyped_flag_is_one_line(program, tmp_path):
  """As vit-train's: not absl's 'FATAL Flags parsing error' and its help hint."""
  out = shell([program, '--wokdir', 'run'], tmp_path)
  assert out.returncode == 1 and 'FATAL' not in out.stderr, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1] == (
      f"{program}: Unknown command line flag 'wokdir'. Did you mean: workdir ? (see --help)")


def test_help_and_refused_arguments_answer_before_tensorflow_loads(home):
  """vit-predict and vit-evaluate import TensorFlow (~5 s of a 2-core host) only to read
  data: --help, and a path or value refused before the data, come without it."""
  os.makedirs(os.path.join(home, 'run', 'checkpoints', '2'), exist_ok=True)
  for argv, last in [
      (['vit-predict', '--help'], '--top_k: Classes shown per image'),
      (['vit-evaluate', '--help'], '--shots: Shots per class.'),
      (['vit-predict', '--workdir', 'wd', 'img/mixed/good.png',
        'cat.jpg'], 'vit-predict: cat.jpg: no such file or folder: pass image files or folders'),
      (['vit-predict', '--checkpoint', 'nope.npz', '--model', 'ViT-B_16', 'img/pic.gif'],
       'vit-predict: nope.npz cannot be read (No such file or directory (nope.npz)): check '
       'the path, or download the file (README: "Published checkpoints")'),
      # A published file's name: the download that fixes it (it had said 'download').
      (['vit-predict', '--checkpoint', 'ViT-B_16.npz', '--model', 'ViT-B_16', 'img/pic.gif'],
       'vit-predict: ViT-B_16.npz cannot be read (No such file or directory (ViT-B_16.npz)): '
       'check the path, or download it: curl -O '
       'https://storage.googleapis.com/vit_models/imagenet21k/ViT-B_16.npz'),
      # A run's orbax checkpoint, given as if it were a file of parameters.
      (['vit-predict', '--checkpoint', 'run/checkpoints/2', '--model', 'ViT-B_16', 'img/pic.gif'],
       'vit-predict: run/checkpoints/2 cannot be read (Is a directory (run/checkpoints/2)): pass '
       "an .npz file: the folders under a run's checkpoints/ hold its training state "
       '(vit-evaluate, vit-predict and vit-inspect read one as --workdir RUN --step STEP)'),
      (['vit-evaluate', '--workdir', 'wd', '--shots=1,five'],
       'vit-evaluate: --shots=1,five: expected whole numbers >= 1, comma-separated: e.g. '
       '--shots=1,5'),
  ]:
    out = shell(argv, home, PYTHONPROFILEIMPORTTIME='1')  # a line of stderr per import
    imported = {
        l.rsplit('|', 1)[-1].strip() for l in out.stderr.splitlines()
        if l.startswith('import time:')
    }
    assert 'vit_jax.model_flags' in imported and 'tensorflow' not in imported, argv
    lines = [l for l in (out.stdout + out.stderr).splitlines() if not l.startswith('import time:')]
    assert (out.returncode,
            any(l.strip().startswith(last) for l in lines)) == (0 if '--help' in argv else 1,
                                                                True), (argv, lines[-5:])


@pytest.mark.parametrize('argv,line', [
    (['vit-evaluate', '--workdir=a', '--workdir', 'b'
     ], "vit-evaluate: --workdir is given more than once ('a', 'b'): give one (see --help)"),
    (['vit-inspect', '--workdir=a', '--images=x.png', '--images', 'y.png'
     ], "vit-inspect: --images is given more than once ('x.png', 'y.png'): give one, its values "
     'comma-separated (see --help)'),
])
def test_a_flag_given_twice_is_refused(argv, line, tmp_path):
  """absl takes the last: `--workdir=a --workdir=b` had evaluated b without a word."""
  out = shell(argv, tmp_path)
  assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (1, line), out.stderr[-2000:]


@pytest.mark.parametrize('program,flag', [('vit-evaluate', '--batch_size'),
                                          ('vit-predict', '--top_k')])
def test_a_flag_value_of_the_wrong_type_is_in_plain_words(program, flag, tmp_path):
  """As vit-train's --config.total_steps=abc: 'expected an integer', not int()'s words."""
  out = shell([program, '--workdir', 'run', f'{flag}=abc'], tmp_path)
  assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
      f'{program}: flag {flag}=abc: expected an integer (see --help)'), out.stderr[-2000:]
  # Before a model is loaded (vit-evaluate had refused a batch size 0 after 5-7 s).
  out = shell([program, '--workdir', 'run', f'{flag}=0'], tmp_path)
  assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == {
      'vit-evaluate': 'vit-evaluate: flag --batch_size=0: 0 is not a positive integer (see --help)',
      'vit-predict': 'vit-predict: --top_k=0: pass 1 or more (classes shown per image)'
  }[program], out.stderr[-2000:]


def test_non_ascii_names_on_an_ascii_stdout_are_escaped(home, tmp_path):
  """PYTHONIOENCODING=ascii (some ssh and cron set-ups): vit-predict had printed one line and
  none of its predictions, vit-inspect a UnicodeEncodeError traceback once its figures were
  written."""
  shutil.copy(home / 'img/mixed/good.png', tmp_path / 'été.png')
  out = shell(['vit-predict', '--workdir', f'{home}/wd', 'été.png'], tmp_path,
              PYTHONIOENCODING='ascii')
  assert out.returncode == 0, out.stderr[-2000:]
  assert predicted(out.stdout) == {'\\xe9t\\xe9.png': 5}, out.stdout
  out = shell(['vit-inspect', '--workdir', f'{home}/wd', '--images', 'été.png', '--outdir', 'fig'],
              tmp_path, PYTHONIOENCODING='ascii')
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'fig/rollout_00_\\xe9t\\xe9.png' in out.stdout.splitlines(), out.stdout


def test_python_m_runs_as_the_console_scripts_do(home, tmp_path):
  """`python -m vit_jax.inspection ... 2>&-` had exited 1 without a word or a figure (its
  first write to the closed stderr raised), and `python -m vit_jax.predict` on an ASCII stdout
  had not escaped a file name: only the console scripts prepared the process."""
  shutil.copy(home / 'img/mixed/good.png', tmp_path / 'été.png')
  out = shell([sys.executable, '-m', 'vit_jax.predict', '--workdir', f'{home}/wd', 'été.png'],
              tmp_path, PYTHONIOENCODING='ascii')
  assert out.returncode == 0, out.stderr[-2000:]
  assert predicted(out.stdout) == {'\\xe9t\\xe9.png': 5}, out.stdout
  inspect = [
      sys.executable, '-m', 'vit_jax.inspection', '--workdir', f'{home}/wd', '--images', 'été.png',
      '--outdir', 'fig'
  ]
  out = shell(['bash', '-c', f'exec {shlex.join(inspect)} >&- 2>&- <&-'], tmp_path)
  assert out.returncode == 0
  assert (tmp_path / 'fig' / 'rollout_00_été.png').exists(), os.listdir(tmp_path)
