"""Every command of README.md, run as a user types it (relative paths, from a shell, in a
directory of its own with the venv's commands on PATH): a README edit that breaks a command
breaks this test.

The two set-up commands (`make quickstart`, `make test`) are run verbatim by .ci/run. Here
each other shell line is matched by one rule of RULES; a line no rule knows fails the test
until a rule is added. Where the README's command is large, the rule runs it as written
with small overrides appended (absl and the sweep take the last value of a flag); commands
that need the network are only listed. The quickstart run the README's later commands read
is made by the Makefile's own quickstart command, with small overrides appended.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
from PIL import Image
import pytest

from tests import data_fixtures
from tests.conftest import built_once
from tests.conftest import ROOT
from tests.conftest import with_flags

README = os.path.join(ROOT, 'README.md')
USER_DATA = 'fashion'  # the user's Fashion-MNIST IDX folder, relative to their directory
BIN = os.path.dirname(sys.executable)  # the venv's console scripts
SMALL_RUN = [
    '--config.total_steps=6', '--config.warmup_steps=1', '--config.batch_size=32',
    '--config.eval_batch_size=32', '--config.log_every_steps=3',
    '--config.checkpoint_every_steps=3', '--config.eval_every_steps=0',
    '--config.model.num_layers=1'
]
SMALL_SWEEP = [
    '--set', 'config.total_steps=2', '--set', 'config.warmup_steps=1', '--set',
    'config.batch_size=16', '--set', 'config.eval_batch_size=16', '--set',
    'config.log_every_steps=1', '--set', 'config.model.num_layers=1'
]  # the README's command chooses on train[90%:] of the user's 256 training images

# Every phase of the masked-patch experiment (pre-training, fine-tuning from it and from
# scratch, 5-shot on frozen features) in seconds; its workdir and data are the test's.
SMALL_EXPERIMENT = [
    '--pretrain_steps=2', '--finetune_steps=2', '--finetune_batch=16', '--labels=32', '--seeds=0',
    '--fewshot_pool=100', '--fewshot_draws=1'
]


def fenced_blocks(text):
  """[(language, body)] of the README's fenced code blocks."""
  return re.findall(r'^```(\w*)\n(.*?)^```', text, re.MULTILINE | re.DOTALL)


def shell_lines(body):
  """Commands of a shell block: continuations joined, comments and blank lines dropped."""
  joined = body.replace('\\\n', ' ')
  return [
      shlex.split(line, comments=True) for line in joined.splitlines()
      if shlex.split(line, comments=True)
  ]


def readme_commands():
  with open(README) as f:
    blocks = fenced_blocks(f.read())
  shell = [argv for lang, body in blocks if lang in ('bash', 'sh') for argv in shell_lines(body)]
  python = [body for lang, body in blocks if lang == 'python']
  return blocks, shell, python


def _flag(argv, name):
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      return arg.split('=', 1)[1]
    if arg == f'--{name}' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def rule(argv):
  """(action, extra args) for one README command; action None: no rule knows it."""
  prog = argv[0]
  if prog == 'make':
    return 'ci', []  # .ci/run runs the two set-up commands verbatim
  if prog == 'source' and argv[1:] == ['.venv/bin/activate']:
    return 'activate', []  # the tests put the venv's commands on PATH themselves
  if prog in ('curl', 'pip', 'gcloud', 'tfds', 'vit-tfds-build'):
    return 'network', []
  if prog == 'python' and argv[1] == 'experiments/masked_patches_fashion.py':
    return 'experiment', SMALL_EXPERIMENT
  if prog == 'python' and argv[1] == '-c' and 'shoe.png' in argv[2]:
    return 'run', []  # the image the commands after it read (also made by user_dir)
  if prog == 'vit-train':
    if _flag(argv, 'config') in ('quickstart', 'masked_patches:quickstart'):
      return 'run', SMALL_RUN
    return 'parse', []  # its data is not here: the command line must parse and load
  if prog in ('vit-evaluate', 'vit-predict', 'vit-inspect'):
    if _flag(argv, 'dataset') not in (None, 'fashion_mnist_local'):
      return 'run', [
          '--dataset', 'folder:photos', '--shots', '1', '--seeds', '0', '--batch_size', '4'
      ]  # a folder stands in for the TFDS set
    return 'run', []
  if prog == 'vit-sweep':  # the quickstart's for real (on the user's data), others dry
    if _flag(argv, 'config') == 'quickstart':
      return 'run', SMALL_SWEEP + ['--set', f'config.data_dir={USER_DATA}']
    return 'run', ['--dry-run']
  if prog in ('vit-tpu', 'vit-vtab'):
    return 'run', ['--dry-run']
  return None, []


def _make_user_dir(home):
  """A user's directory after `make quickstart` (small) with the files the README names."""
  data = data_fixtures.write_idx(str(home / USER_DATA), num_train=256, num_test=64)
  with open(os.path.join(ROOT, 'Makefile')) as f:
    recipe = re.search(r'^quickstart:.*\n\t(.+)$', f.read(), re.MULTILINE).group(1)
  argv = shlex.split(recipe.replace('$(VENV)/bin/', ''))
  _shell(argv + SMALL_RUN + [f'--config.data_dir={data}'], home)
  [shoe] = [a for a in readme_commands()[1] if a[0] == 'python' and 'shoe.png' in a[-1]]
  _shell(shoe, home)  # as the README makes it, from the Debian package's Fashion-MNIST
  assert Image.open(home / 'shoe.png').size == (28, 28)
  photos = home / 'photos'
  for name, index in (('shoe.png', 0), ('cat.jpg', 1), ('a.jpg', 2), ('b.png', 3)):
    if name != 'shoe.png':
      Image.fromarray(data_fixtures.id_image(index)).convert('RGB').save(home / name)
    for split in ('train', 'test'):
      os.makedirs(photos / split / f'class{index % 2}', exist_ok=True)
      Image.fromarray(data_fixtures.id_image(index)).convert('RGB').save(
          photos / split / f'class{index % 2}' / name.replace('.jpg', '.png'))
  data_fixtures.write_published(home / 'ViT-B_16.npz', 'ViT-B_16')
  with open(home / 'names.txt', 'w') as f:
    f.write(''.join(f'class {i}\n' for i in range(1000)))


@pytest.fixture(scope='module')
def user_dir(tmp_path_factory):
  """The user's directory, made once for all workers and copied for this one: the README's
  commands write into it."""
  made = built_once(tmp_path_factory, 'user_made', _make_user_dir)
  home = tmp_path_factory.mktemp('user')
  shutil.copytree(made, home, dirs_exist_ok=True)
  return home


def _shell(argv, cwd):
  # A user's shell: no XLA_FLAGS (the suite's force 8 CPU devices).
  env = dict(os.environ, PATH=f'{BIN}:' + os.environ.get('PATH', ''), XLA_FLAGS='')
  out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, (f'{shlex.join(argv)} exited {out.returncode}:\n'
                               f'{out.stdout[-1500:]}\n{out.stderr[-3000:]}')
  return out


def test_the_first_command_trains_on_two_cpu_devices(user_dir):
  # configs/quickstart.py splits the CPU in two (data parallel), and says so in the log.
  with open(user_dir / 'workdirs' / 'quickstart' / 'train.INFO') as f:
    log = f.read()
  assert '2 local / 2 global devices (cpu)' in log
  assert 'CPU devices: 2 (--config.cpu_devices=2)' in log


def test_every_shell_line_has_a_rule():
  _, shell, _ = readme_commands()
  unknown = [shlex.join(argv) for argv in shell if rule(argv)[0] is None]
  assert not unknown, f'README commands no rule in tests/test_readme.py runs: {unknown}'


def test_the_two_setup_commands_come_first():
  blocks, _, _ = readme_commands()
  assert blocks[0][0] == 'bash'
  assert [shlex.join(a) for a in shell_lines(blocks[0][1])] == ['make quickstart', 'make test']


@pytest.mark.parametrize('argv', [a for a in readme_commands()[1] if rule(a)[0] == 'run'],
                         ids=lambda a: shlex.join(a)[:60])
def test_runs_as_written(argv, user_dir):
  out = _shell(with_flags(argv, rule(argv)[1]), user_dir)
  if argv[0] == 'vit-evaluate':
    assert out.stdout.splitlines()[0].split() == ['mode', 'metric', 'value']
  if argv[0] == 'vit-predict':
    assert len([l for l in out.stdout.splitlines() if l.startswith('  ')]) % 5 == 0
  if argv[0] == 'vit-sweep' and '--dry-run' not in argv + rule(argv)[1]:
    assert 'failed (exit' not in out.stdout and 'Winner (best final accuracy): **' in out.stdout
    # Chosen on held-out training data, and the final run's command line follows.
    assert re.search(
        r"^Chosen on eval_split 'train\[90%:\]', held out of train_split "
        r"'train\[:90%\]'; train the winner on the whole training set: "
        r'`vit-train --config=quickstart .*--config.base_lr=[\d.]+ --config.model.dropout_'
        r'rate=[\d.]+ --workdir=\S+/final`.$', out.stdout, re.MULTILINE), out.stdout[-800:]
  if argv[0] == 'vit-inspect':  # all four figures: the rollout and distance need --images
    figures = os.listdir(user_dir / _flag(argv, 'outdir'))
    assert {'position_embedding_similarity.png', 'embedding_filters.png',
            'attention_distance.png'} <= set(figures), figures
    assert any(f.startswith('rollout_') for f in figures), figures


@pytest.mark.parametrize('argv', [a for a in readme_commands()[1] if rule(a)[0] == 'experiment'],
                         ids=lambda a: shlex.join(a)[:60])
def test_experiments_run_as_written_in_miniature(argv, user_dir, tmp_path):
  """From the repository root, as the README runs them, on the user's small data."""
  out = _shell(
      with_flags(
          argv,
          rule(argv)[1] + [f'--workdir={tmp_path / "run"}', f'--data_dir={user_dir / USER_DATA}']),
      ROOT)
  assert '| labelled images | from scratch | masked patch pre-trained |' in out.stdout
  # Not TensorFlow's start-up notices (vit_jax/tensorflow_quietly.py) before anything else.
  assert not re.search('absl::InitializeLog|oneDNN custom operations', out.stderr), out.stderr[:800]
  assert '| 32 (0.0533333%), test accuracy % over 1 seed |' in out.stdout, out.stdout[-1500:]


@pytest.mark.parametrize('argv', [a for a in readme_commands()[1] if rule(a)[0] == 'parse'],
                         ids=lambda a: shlex.join(a)[:60])
def test_training_commands_parse(argv, tmp_path):
  """The command line of a run whose data is not here loads its config and overrides."""
  code = ('import sys; from vit_jax import main; main.parse_flags(sys.argv);'
          'print(main.FLAGS.config.model_name)')
  out = _shell([sys.executable, '-c', code, *argv[1:]], tmp_path)
  assert out.stdout.strip()


@pytest.mark.parametrize('index', range(len(readme_commands()[2])))
def test_python_blocks(index, user_dir, monkeypatch):
  monkeypatch.chdir(user_dir)
  namespace = {'images': np.zeros((2, 224, 224, 3), np.float32)}
  exec(readme_commands()[2][index], namespace)  # pylint: disable=exec-used
  if 'logits' in namespace:
    assert namespace['logits'].shape == (2, 1000)
  if 'arrays' in namespace:  # the user's quickstart run (SMALL_RUN): its last step
    assert int(namespace['arrays']['step']) == 6 and namespace['scale'].ndim == 1
