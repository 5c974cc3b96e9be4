"""cli_help's start-up filter: JAX's missing-TPU notice goes only where no TPU runtime is
installed (the console-script journeys are in test_install.py)."""
import logging

import pytest

from vit_jax import cli_help

NOTICE = ("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: "
          'cannot open shared object file: No such file or directory')
OTHER = "Unable to initialize backend 'cuda': no GPU"


@pytest.mark.parametrize('tpu_runtime', [False, True])
def test_the_missing_tpu_notice_is_dropped_only_without_a_tpu_runtime(monkeypatch, tpu_runtime):
  # The logger's filters are asked directly: other tests may have switched logging off.
  logger = logging.getLogger('jax._src.xla_bridge')
  monkeypatch.setattr(logger, 'filters', [])
  monkeypatch.setattr(cli_help, '_tpu_runtime_installed', lambda: tpu_runtime)
  cli_help.quiet_the_missing_tpu_notice()
  passes = lambda message: bool(
      logger.filter(logging.LogRecord(logger.name, logging.INFO, __file__, 0, message, None, None)))
  assert passes(NOTICE) == tpu_runtime
  assert passes(OTHER)
