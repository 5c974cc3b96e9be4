"""Executes the Colab notebooks end to end with nbclient, tiny and offline.

The cell tagged 'parameters' keeps its defaults and gets overrides appended (as
papermill injects them): TINY, OFFLINE, a DATA_DIR that does not exist yet (so the
synthetic Fashion-MNIST stand-in is written) and a temporary WORKDIR.
"""
import os

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         'notebooks')


def _run(name, tmp_path, monkeypatch, **params):
  # One CPU device in the kernel: the notebooks' defaults are for Colab; here
  # fewer simulated devices means less to compile.
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=1')
  nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
  cells = [c for c in nb.cells if 'parameters' in c.metadata.get('tags', [])]
  assert len(cells) == 1, f'{name} needs exactly one cell tagged "parameters"'
  overrides = {'TINY': True, 'OFFLINE': True, 'DATA_DIR': str(tmp_path / 'data'),
               'WORKDIR': str(tmp_path / 'work'), **params}
  cells[0].source += '\n# Injected by tests/test_notebooks.py\n' + ''.join(
      f'{k} = {v!r}\n' for k, v in overrides.items())
  client = NotebookClient(nb, timeout=300, kernel_name='python3',
                          resources={'metadata': {'path': NOTEBOOKS}})
  client.execute()  # raises CellExecutionError naming the failing cell
  return nb


def _outputs(nb):
  return [o for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', [])]


def test_quickstart_notebook(tmp_path, monkeypatch):
  nb = _run('quickstart.ipynb', tmp_path, monkeypatch, FINETUNE_STEPS=4)
  text = ''.join(o.get('text', '') for o in _outputs(nb))
  assert 'synthetic stand-in' in text
  assert 'step 4: loss' in text and 'top-1 accuracy' in text
  assert os.path.exists(tmp_path / 'work' / 'finetune' / 'final.npz')
  assert any('image/png' in o.get('data', {}) for o in _outputs(nb))


def test_inspect_notebook(tmp_path, monkeypatch):
  nb = _run('inspect.ipynb', tmp_path, monkeypatch, NUM_IMAGES=16)
  pngs = [o for o in _outputs(nb) if 'image/png' in o.get('data', {})]
  assert len(pngs) == 4  # rollout, filters, position embeddings, attention distance
  text = ''.join(o.get('text', '') for o in _outputs(nb))
  assert '(2, 16, 2, 17, 17)' in text  # layers, images, heads, q, k
