"""The wheel as a user installs it: a fresh venv, a directory outside the checkout, the
console scripts, and nothing of the repository on sys.path."""
import os
import subprocess

from tests import data_fixtures
from tests.conftest import ROOT, user_env


def _run(cmd, cwd, env, timeout=600):
  out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, f'{cmd[0]} exited {out.returncode}:\n{out.stderr[-3000:]}'
  return out


def test_package_is_one_namespace(wheel_venv, tmp_path):
  env = user_env(wheel_venv)
  out = _run([
      str(wheel_venv / 'bin' / 'python'), '-c',
      'import os, sys, vit_jax, vit_jax.configs, vit_jax.launch.sweep;'
      'print(os.path.dirname(vit_jax.__file__));'
      'print(vit_jax.configs.resolve("finetune:ViT-B_16,cifar10"))'
  ], tmp_path, env)
  package_dir, config_file = out.stdout.split()
  assert package_dir.startswith(str(wheel_venv)) and not package_dir.startswith(ROOT)
  assert config_file == os.path.join(package_dir, 'configs', 'finetune.py:ViT-B_16,cifar10')
  site = os.path.dirname(package_dir)
  assert not {'configs', 'launch', 'tests', 'benchmarks'} & set(os.listdir(site))
  for script in ('vit-train', 'vit-evaluate', 'vit-predict', 'vit-inspect', 'vit-sweep', 'vit-tpu',
                 'vit-vtab', 'vit-tfds-build'):
    assert (wheel_venv / 'bin' / script).exists(), script


def test_train_then_evaluate_from_elsewhere(wheel_venv, tmp_path):
  env = user_env(wheel_venv)
  data = data_fixtures.write_idx(str(tmp_path / 'idx'), num_train=256, num_test=64)
  _run([
      'vit-train', '--config=quickstart', '--workdir=runs/tiny', f'--config.data_dir={data}',
      '--config.total_steps=4', '--config.warmup_steps=1', '--config.batch_size=32',
      '--config.eval_batch_size=32', '--config.log_every_steps=2',
      '--config.checkpoint_every_steps=2', '--config.eval_every_steps=0',
      '--config.model.num_layers=1'
  ], tmp_path, env)
  assert (tmp_path / 'runs' / 'tiny' / 'final.npz').exists()
  out = _run([
      'vit-evaluate', '--workdir', 'runs/tiny', '--shots', '1', '--seeds', '0', '--batch_size', '32'
  ], tmp_path, env)
  lines = out.stdout.strip().splitlines()
  assert lines[0].split() == ['mode', 'metric', 'value']
  # No TPU runtime in this venv: JAX's notice of that is not the user's first line.
  assert 'Unable to initialize backend' not in out.stderr, out.stderr[:2000]
  assert lines[1].startswith('top1') and '(64 images)' in lines[1]
  assert lines[2].split()[:3] == ['fewshot', 'fashion_mnist_local', '1-shot']
  # A mistake typed from the shell is one line naming the fix.
  out = subprocess.run(['vit-train', '--config=quickstart', '--workdir=w', '--config.base_lrr=1'],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1].startswith(
      "vit-train: --config.base_lrr: the config has no field 'base_lrr' (did you mean base_lr?)")


def test_a_mistake_found_after_start_up_is_the_only_line(wheel_venv, tmp_path):
  """Values that pass the flags but not the checks made once TensorFlow and JAX have
  started: stderr is the one line naming the fix, not TensorFlow's C++ notices and JAX's
  "no TPU" above it (vit_jax/tensorflow_quietly.py)."""
  # TFDS's builder of a dataset not prepared logged "Constructing tf.data.Dataset" three
  # times above the line, and left a folder in the temporary root (data_sources.tfds_builder).
  scratch = tmp_path / 'tmp'
  scratch.mkdir()
  env = dict(user_env(wheel_venv), TMPDIR=str(scratch))
  unprepared = (f'vit-train: dataset cifar10 is not prepared in data_dir {tmp_path}/tfds: run '
                f'`vit-tfds-build cifar10 --data_dir={tmp_path}/tfds` or set --config.data_dir to '
                'where it is prepared.')
  for cmd, line in [
      (['vit-train', '--config=quickstart', '--workdir=runs/x',
        '--config.batch_size=0'], 'vit-train: batch_size 0 must be > 0: set --config.batch_size'),
      (['vit-predict', '--checkpoint=nope.npz', '--model=ViT-B_16',
        'cat.jpg'], 'vit-predict: cat.jpg: no such file or folder: pass image files or folders'),
      ([
          'vit-train', '--config=finetune:ViT-B_16,cifar10', '--workdir=runs/x',
          '--config.data_dir=tfds'
      ], unprepared),
  ]:
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stderr.strip().splitlines()) == (1, [line]), out.stderr[-3000:]
  assert not (tmp_path / 'runs').exists()
  assert not os.listdir(scratch)


def test_a_sweep_started_in_a_checkout_runs_the_installed_package(wheel_venv, tmp_path):
  """vit-sweep's points are `python -P -m vit_jax.main`: without -P, a point started in a
  checkout imported the checkout's vit_jax (which has no configs) and every point failed."""
  data = data_fixtures.write_idx(str(tmp_path / 'idx'), num_train=64, num_test=32)
  out = _run([
      'vit-sweep', '--config=quickstart', f'--workdir={tmp_path}/sweep', '--sweep',
      'config.base_lr=[0.001]', '--set', f'config.data_dir={data}', '--set', 'config.total_steps=2',
      '--set', 'config.warmup_steps=1', '--set', 'config.batch_size=32', '--set',
      'config.eval_batch_size=32', '--set', 'config.model.num_layers=1'
  ], ROOT, user_env(wheel_venv))
  assert '| base_lr=0.001 | ok |' in out.stdout, out.stdout[-2000:]
  assert (tmp_path / 'sweep' / 'base_lr=0.001' / 'final.npz').exists()


def test_console_scripts_help_lists_their_flags(wheel_venv, tmp_path):
  """`vit-train --help` printed only "USAGE: vit-train [flags]": a console script's __main__
  is pip's wrapper (cli_help.py). The argparse programs are checked for their names. Every
  one exits 0."""
  env = user_env(wheel_venv)
  expected = {
      'vit-train': ('Entry point: vit-train', '--config:', '--workdir:'),
      'vit-evaluate': ('vit-evaluate: top-1', '--checkpoint:', '--shots:', '--workdir:'),
      'vit-predict': ('Top-k classes of image files', '--checkpoint:', '--top_k:'),
      'vit-inspect': ('Inspecting a Vision Transformer', '--checkpoint:', '--outdir:'),
      'vit-sweep': ('usage: vit-sweep ', '--workdir'),
      'vit-vtab': ('usage: vit-vtab ', '--model'),
      'vit-tpu': ('usage: vit-tpu ', '--accelerator_type'),
      'vit-tfds-build': ('usage: vit-tfds-build ', '--data_dir', '--manual_dir'),
  }
  for script, texts in expected.items():
    out = subprocess.run([script, '--help'], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f'{script} --help exited {out.returncode}'  # absl's is 1
    for t in texts:
      assert t in text, f'{script} --help lacks {t!r}:\n{text[-2000:]}'
  # With a config, --help first lists that config's fields and values (no workdir needed).
  out = subprocess.run(['vit-train', '--config=finetune:ViT-B_16,cifar10', '--help'], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
  assert out.stdout.startswith('--config=finetune:ViT-B_16,cifar10: the fields and values'), out
  for t in ('\ndataset: cifar10\n', '\nimage_size: 384\n', '\nmodel_name: ViT-B_16\n',
            "\nlabel_key: label\n", "\nremat: ''\n", '\npp.train_crop: inception\n',
            '\nfewshot_shots: (1, 5, 10, 25)\n', '--workdir:'):
    assert t in out.stdout, f'{t!r} not in:\n{out.stdout[-3000:]}'
