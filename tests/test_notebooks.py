"""The Colab notebooks, executed as a user opens them: the kernel is the Python of a fresh
venv holding only the installed wheel, and the working directory is outside the checkout.

The cell tagged 'parameters' keeps its defaults and gets overrides appended (as papermill
injects them): TINY, OFFLINE, a DATA_DIR that does not exist (so Fashion-MNIST is fetched
from FASHION_MNIST_URL, here a file:// folder, or the synthetic stand-in is written, under
WORKDIR) and a temporary WORKDIR. REPO_URL stays unset: with the package installed the
set-up cell must not need it.
"""
import email.parser
import json
import os
import shutil
import subprocess
import sys

import packaging.requirements
import pytest

from tests import data_fixtures
from tests.conftest import NOT_SOURCE, ROOT, user_env

# Runs inside the wheel's venv: nbclient executes the notebook with that venv's kernel.
_EXECUTE = '''
import json, sys
import nbformat
from nbclient import NotebookClient
source, target, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
nb = nbformat.read(source, as_version=4)
cells = [c for c in nb.cells if 'parameters' in c.metadata.get('tags', [])]
assert len(cells) == 1, 'the notebook needs exactly one cell tagged "parameters"'
cells[0].source += '\\n# Injected by tests/test_notebooks.py\\n' + ''.join(
    f'{k} = {v!r}\\n' for k, v in overrides.items())
NotebookClient(nb, timeout=300, kernel_name='python3',
               resources={'metadata': {'path': '.'}}).execute()
nbformat.write(nb, target)
'''


def _code_cells(name):
  with open(os.path.join(ROOT, 'notebooks', name)) as f:
    return [''.join(c['source']) for c in json.load(f)['cells'] if c['cell_type'] == 'code']


def _run(name, wheel_venv, tmp_path, **params):
  overrides = {
      'TINY': True,
      'OFFLINE': True,
      'DATA_DIR': str(tmp_path / 'data'),
      'WORKDIR': str(tmp_path / 'work'),
      **params
  }
  executed = tmp_path / f'executed-{name}'
  out = subprocess.run([
      str(wheel_venv / 'bin' / 'python'), '-c', _EXECUTE,
      os.path.join(ROOT, 'notebooks', name),
      str(executed),
      json.dumps(overrides)
  ], cwd=tmp_path, env=user_env(wheel_venv), capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-4000:]
  with open(executed) as f:
    nb = json.load(f)
  outputs = [o for c in nb['cells'] if c['cell_type'] == 'code' for o in c.get('outputs', [])]
  text = ''.join(''.join(o.get('text', '')) for o in outputs)
  return outputs, text


def test_quickstart_notebook(wheel_venv, tmp_path):
  """Online (Colab): Fashion-MNIST's files are fetched into WORKDIR, then fine-tuned on."""
  mirror = data_fixtures.write_idx(str(tmp_path / 'mirror'), num_train=512, num_test=256)
  outputs, text = _run('quickstart.ipynb', wheel_venv, tmp_path, FINETUNE_STEPS=4, OFFLINE=False,
                       FASHION_MNIST_URL=f'file://{mirror}/')
  assert f'vit_jax from {wheel_venv}' in text  # the installed package, not the checkout
  fetched = tmp_path / 'work' / 'fashion_mnist'
  assert f'Fashion-MNIST from file://{mirror}/ is in {fetched}' in text, text
  assert f'data: {fetched}' in text and 'synthetic' not in text
  assert sorted(os.listdir(fetched)) == sorted(os.listdir(mirror))  # no .part left
  assert not os.path.exists(tmp_path / 'data')  # the user's DATA_DIR is never written
  assert 'step 4: loss' in text and 'top-1 accuracy' in text
  assert os.path.exists(tmp_path / 'work' / 'finetune' / 'final.npz')
  assert any('image/png' in o.get('data', {}) for o in outputs)
  # ipykernel shows what TensorFlow's C++ libraries write to fd 2 as they load in the cell's
  # output: the notebook imports vit_jax.tensorflow_quietly first, which keeps them out.
  assert 'absl::InitializeLog' not in text and 'oneDNN custom operations' not in text, text


def test_inspect_notebook(wheel_venv, tmp_path):
  """A download that fails leaves the synthetic stand-in, in WORKDIR."""
  outputs, text = _run('inspect.ipynb', wheel_venv, tmp_path, NUM_IMAGES=16, OFFLINE=False,
                       FASHION_MNIST_URL=f'file://{tmp_path}/no_such_mirror/')
  assert f'vit_jax from {wheel_venv}' in text
  assert f'Fashion-MNIST download from file://{tmp_path}/no_such_mirror/ failed' in text
  assert f"synthetic stand-in goes to {tmp_path / 'work' / 'fashion_mnist_synthetic'}" in text
  assert not os.path.exists(tmp_path / 'data')
  pngs = [o for o in outputs if 'image/png' in o.get('data', {})]
  assert len(pngs) == 4  # rollout, filters, position embeddings, attention distance
  assert '(2, 16, 2, 17, 17)' in text  # layers, images, heads, q, k


def test_unset_repo_url_stops_with_one_line(wheel_venv, tmp_path):
  """Where vit_jax is not installed and no checkout is near, the set-up cell says what to set."""
  venv = tmp_path / 'bare'
  subprocess.run([str(wheel_venv / 'bin' / 'python'), '-m', 'venv', '--without-pip',
                  str(venv)], check=True)
  cells = _code_cells('quickstart.ipynb')
  params, setup = cells[0], cells[1]
  out = subprocess.run([str(venv / 'bin' / 'python'), '-c', params + '\n' + setup], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1].startswith(
      'vit_jax is not installed: set REPO_URL in the first code cell')


def test_the_set_up_cell_installs_the_checkout_it_sits_in(wheel_venv, tmp_path):
  """A kernel of a venv with the dependencies but not vit_jax, in a checkout (its root, or
  notebooks/): the cell installs the checkout and imports it in the same process. Before,
  an editable install was not importable until a restart, and at the root the bare source
  tree counted as installed (vit_jax.configs is mapped from configs/ only by installing)."""
  venv, src = tmp_path / 'venv', tmp_path / 'src'
  shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
  subprocess.run([str(wheel_venv / 'bin' / 'python'), '-m', 'venv', str(venv)], check=True)
  # The dependencies are wheel_venv's, seen through a .pth file (installing them again took
  # ~2 minutes): every one of its packages but vit_jax and pip, linked into one folder.
  deps = tmp_path / 'dependencies'
  deps.mkdir()
  installed, = (wheel_venv / 'lib').glob('python*/site-packages')
  for entry in installed.iterdir():
    if not entry.name.startswith(('vit_jax', 'pip', '__editable__')):
      (deps / entry.name).symlink_to(entry)
  own, = (venv / 'lib').glob('python*/site-packages')
  (own / 'dependencies.pth').write_text(f'{deps}\n')
  pip = [str(venv / 'bin' / 'python'), '-m', 'pip', '-q']
  cells = _code_cells('quickstart.ipynb')
  code = '\n'.join(
      cells[:2]) + '\nfrom vit_jax.configs import quickstart\nprint(quickstart.__file__)'
  for cwd in (src, src / 'notebooks'):
    subprocess.run(pip + ['uninstall', '-y', 'vit_jax'], check=True, capture_output=True)
    out = subprocess.run([str(venv / 'bin' / 'python'), '-c', code], cwd=cwd, env=user_env(venv),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-2:] == [
        f'vit_jax from {src}/vit_jax', f'{src}/configs/quickstart.py'
    ], out.stdout


# Runs the set-up cell (argv[1]) with `python -S` on a sys.path holding only the folder argv[2]
# (fake distributions) and the standard library, REPO_URL set and subprocess.check_call
# recording the pip commands; a command that installs vit_jax "installs" the package and the
# metadata of the wheel (argv[3]) into that folder, as pip would. Prints the commands as JSON.
_SET_UP_WITH_A_RECORDING_PIP = '''
import json, os, shutil, subprocess, sys
cell, site_dir, metadata = sys.argv[1:]
sys.path.insert(0, site_dir)
REPO_URL = 'https://example.org/vit_jax.git'
CALLS = []
def check_call(command):
  CALLS.append(command[command.index('install') + 1:])
  if f'git+{REPO_URL}' in command:
    for package in ('vit_jax', 'vit_jax/configs'):
      os.makedirs(os.path.join(site_dir, package))
      open(os.path.join(site_dir, package, '__init__.py'), 'w').close()
    os.makedirs(os.path.join(site_dir, 'vit_jax-0.2.0.dist-info'))
    shutil.copy(metadata, os.path.join(site_dir, 'vit_jax-0.2.0.dist-info', 'METADATA'))
subprocess.check_call = check_call
exec(open(cell).read())
print(json.dumps(CALLS))
'''


def test_the_notebooks_share_one_set_up_cell():
  setup, = {_code_cells(name)[1] for name in ('quickstart.ipynb', 'inspect.ipynb')}
  assert setup.startswith('# Set-up: vit_jax')


@pytest.mark.parametrize('installed, vit_jax_with_deps, jax_extras', [
    ('tensorflow==2.21.0 jax==0.10.2 jax_cuda12_plugin==0.10.2', False, ''),
    ('tensorflow==2.21.0 jax==0.9.2 jax_cuda12_plugin==0.9.2', False, 'cuda12'),
    ('tensorflow_cpu==2.21.0 jax==0.10.2', True, None),
    ('jax==0.9.2', True, None),
], ids=['colab', 'colab-old-jax', 'tensorflow-cpu', 'no-tensorflow'])
def test_set_up_cell_keeps_an_installed_tensorflow(wheel_venv, tmp_path, installed,
                                                   vit_jax_with_deps, jax_extras):
  """Colab ships the full `tensorflow` (a CUDA build) and its own jax. Before, the set-up cell
  ran `pip install git+REPO_URL`, which installed vit_jax's tensorflow-cpu beside it: the same
  tensorflow/ folder, its libraries overwritten by the CPU build (tf.test.is_built_with_cuda()
  then False), and uninstalling either left `import tensorflow` broken. Where a tensorflow
  other than tensorflow-cpu is installed, vit_jax goes in with --no-deps and its requirements
  follow with that distribution in tensorflow-cpu's place; a jax that has to move takes the
  installed CUDA plugin along (jax[cuda12]). Elsewhere it stays one `pip install`."""
  site_dir = tmp_path / 'site-packages'
  # What importlib.metadata finds of each installed distribution.
  for name, version in (d.split('==') for d in installed.split()):
    info = site_dir / f'{name}-{version}.dist-info'
    info.mkdir(parents=True)
    (info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')
    top_level = 'tensorflow' if name.startswith('tensorflow') else name
    (info / 'top_level.txt').write_text(f'{top_level}\n')
  shutil.copytree(os.path.dirname(packaging.__file__), site_dir / 'packaging')
  wheel_metadata, = (wheel_venv / 'lib').glob('python*/site-packages/vit_jax-*.dist-info/METADATA')
  cells = _code_cells('quickstart.ipynb')
  (tmp_path / 'cell.py').write_text(cells[1])
  out = subprocess.run([
      sys.executable, '-S', '-c', _SET_UP_WITH_A_RECORDING_PIP,
      str(tmp_path / 'cell.py'),
      str(site_dir),
      str(wheel_metadata)
  ], cwd=tmp_path, capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.splitlines()[-2] == f'vit_jax from {site_dir}/vit_jax'
  calls = json.loads(out.stdout.splitlines()[-1])
  target = 'git+https://example.org/vit_jax.git'
  if vit_jax_with_deps:
    assert calls == [['-q', target]]
    return
  assert calls[0] == ['-q', '--no-deps', target] and len(calls) == 2, calls
  # The wheel's own requirements (not its extras'), the installed TensorFlow in
  # tensorflow-cpu's place.
  expected = set()
  for r in email.parser.Parser().parsestr(wheel_metadata.read_text()).get_all('Requires-Dist'):
    r = packaging.requirements.Requirement(r)
    if not r.marker:
      if r.name == 'tensorflow-cpu':
        r.name = 'tensorflow'
      elif r.name == 'jax':
        r.extras = set(jax_extras.split())
      expected.add(str(r))
  assert calls[1][:2] == ['-q', '--no-warn-conflicts'], calls  # not its own tensorflow-cpu
  assert 'tensorflow-cpu' not in ' '.join(calls[1]) and set(calls[1][2:]) == expected, calls
