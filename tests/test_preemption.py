"""Preemption-safe exact resume: SIGKILL at any moment, SIGTERM with a saved step (exit 143).

A run killed three times (with SIGKILL, checkpoints written every step so kills land
mid-save too) and stopped once by SIGTERM must end with parameters bit-identical to
the same run left alone.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np

from tests.conftest import own_compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL = 14

IDX_SIZES = (48, 16)  # (train, test) sizes of the idx_dir fixture


def _start(workdir, idx_dir):
  """A run in workdir; the runs of one test share a compilation cache next to it."""
  args = [
      sys.executable,
      '-m',
      'vit_jax.main',
      '--config=configs/quickstart.py',
      f'--workdir={workdir}',
      f'--config.data_dir={idx_dir}',
      f'--config.total_steps={TOTAL}',
      '--config.warmup_steps=2',
      '--config.batch_size=16',
      '--config.eval_batch_size=16',
      '--config.log_every_steps=1',
      '--config.eval_every_steps=0',
      '--config.checkpoint_every_steps=1',
      '--config.keep_checkpoints=2',
      '--config.model.num_layers=1',
      '--config.model.dropout_rate=0.1',
      # Inception crop + flip: augmentation randomness must resume exactly too.
      '--config.pp.train_crop=inception',
      '--config.pp.flip=True'
  ]
  env = own_compilation_cache(
      dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2'),
      os.path.join(os.path.dirname(workdir), 'jax_cache'))
  return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def _wait_for(workdir, text, proc, timeout=180):
  log = os.path.join(workdir, 'train.INFO')
  deadline = time.time() + timeout
  while time.time() < deadline:
    if os.path.exists(log) and text in open(log).read():
      return
    if proc.poll() is not None:
      raise AssertionError(f'run ended before {text!r}: {proc.stderr.read()[-2000:]}')
    time.sleep(0.05)
  proc.kill()
  raise AssertionError(f'{text!r} never appeared in {log}')


def _finish(proc, status=0):
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == status, err[-3000:]
  return err


def test_killed_three_times_and_preempted_once_equals_uninterrupted(idx_dir, tmp_path):
  straight = str(tmp_path / 'straight')
  _finish(_start(straight, idx_dir))

  workdir = str(tmp_path / 'interrupted')
  os.makedirs(workdir)
  for text in ('step 2/', 'step 6/', 'step 9/'):  # each run resumes, then dies on a kill
    proc = _start(workdir, idx_dir)
    _wait_for(workdir, text, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  proc = _start(workdir, idx_dir)
  _wait_for(workdir, 'step 11/', proc)
  proc.send_signal(signal.SIGTERM)
  # The shell's status for SIGTERM: it had exited 0, so `vit-train ... && next` ran `next`
  # on a run that had not finished.
  err = _finish(proc, status=143)
  last = err.strip().splitlines()[-1]
  assert last.startswith('vit-train: preempted (SIGTERM) at step '), last
  assert last.endswith('run the same command to resume'), last
  stopped_at = int(last.split(' at step ')[1].split(':')[0])
  assert str(stopped_at) in os.listdir(os.path.join(workdir, 'checkpoints'))

  err = _finish(_start(workdir, idx_dir))
  assert f'Resuming from the checkpoint of step {stopped_at}' in err
  log = open(os.path.join(workdir, 'train.INFO')).read()
  assert f'step {TOTAL}/{TOTAL}' in log

  with np.load(os.path.join(straight, 'final.npz')) as a, \
       np.load(os.path.join(workdir, 'final.npz')) as b:
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)  # bit-identical
