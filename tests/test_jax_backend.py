"""Why JAX's backend cannot start, in one line (vit_jax/jax_backend.py); the commands' own
journeys are in tests/test_faults.py."""
import jax
import pytest

from vit_jax import jax_backend


def _failing(error):

  def devices():
    raise error

  return devices


def test_a_started_backend_says_nothing():
  assert jax_backend.why_not() is None


def test_a_tpu_held_by_another_process_names_it(monkeypatch):
  """libtpu's refusal on a TPU VM where another run holds the chips."""
  held = RuntimeError("Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by "
                      'process with pid 4242. Not attempting to load libtpu.so in this process.')
  monkeypatch.setattr(jax, 'devices', _failing(held))
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  assert jax_backend.why_not() == (
      "JAX cannot start the TPU (Unable to initialize backend 'tpu': ABORTED: The TPU is already "
      'in use by process with pid 4242. Not attempting to load libtpu.so in this process.): wait '
      'for that process to end, or stop it (another vit-train on this VM?)')


@pytest.mark.parametrize('platforms, fix', [
    ('cuda', "install its runtime (pip install -c constraints.txt '.[cuda12]') or unset"),
    ('cpu,tpu', "install its runtime (pip install -c constraints.txt '.[tpu]') or unset"),
    ('rocm', 'unset'),
])
def test_jax_platforms_is_named_with_its_install(monkeypatch, platforms, fix):
  monkeypatch.setattr(jax, 'devices', _failing(AssertionError()))
  monkeypatch.setenv('JAX_PLATFORMS', platforms)
  assert jax_backend.why_not() == (
      f'JAX cannot start the backend JAX_PLATFORMS={platforms} names (its runtime is not '
      f'installed): {fix} JAX_PLATFORMS to run on what this machine has')


def test_exit_is_one_line_with_status_1(monkeypatch):
  monkeypatch.setattr(jax, 'devices', _failing(RuntimeError('Unable to initialize backend')))
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  with pytest.raises(SystemExit) as e:
    jax_backend.exit_if_it_cannot_start('vit-predict')
  assert e.value.code == 'vit-predict: JAX cannot start its backend (Unable to initialize backend)'
