"""cli_help's start-up filter: JAX's missing-TPU notice goes only where no TPU runtime is
installed (the console-script journeys are in test_install.py)."""
import logging

import pytest

from vit_jax import cli_help

NOTICE = ("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: "
          'cannot open shared object file: No such file or directory')


@pytest.fixture
def jax_records(monkeypatch):
  logger = logging.getLogger('jax._src.xla_bridge')
  monkeypatch.setattr(logger, 'filters', [])
  monkeypatch.setattr(logger, 'propagate', False)
  seen = []
  handler = logging.Handler()
  handler.emit = lambda record: seen.append(record.getMessage())
  logger.addHandler(handler)
  monkeypatch.setattr(logger, 'level', logging.INFO)
  yield logger, seen
  logger.removeHandler(handler)


@pytest.mark.parametrize('tpu_runtime', [False, True])
def test_the_missing_tpu_notice_is_dropped_only_without_a_tpu_runtime(jax_records, monkeypatch,
                                                                      tpu_runtime):
  logger, seen = jax_records
  monkeypatch.setattr(cli_help, '_tpu_runtime_installed', lambda: tpu_runtime)
  cli_help.quiet_the_missing_tpu_notice()
  logger.info(NOTICE)
  logger.info("Unable to initialize backend 'cuda': no GPU")
  expected = [NOTICE] if tpu_runtime else []
  assert seen == expected + ["Unable to initialize backend 'cuda': no GPU"]
