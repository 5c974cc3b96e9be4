"""A run a sweep started stops with it: vit_jax/parent_death.py. (The sweep killed outright,
its point saving and the sweep run again resuming it: tests/test_sweep.py.)"""
import os
import signal

from vit_jax import parent_death
from tests.conftest import console_script


def test_a_point_whose_sweep_is_already_gone_stops_before_it_starts(tmp_path):
  """A sweep killed between starting its point and the point asking for the kernel's SIGTERM
  would never send it: the point (here vit-train, named a starter that is not its parent)
  stops at once with SIGTERM's one line, before it writes anything. Before, it ran on."""
  p = console_script('vit-train', tmp_path, '--config=quickstart', '--workdir=w',
                     '--config.total_steps=2', timeout=120,
                     **{parent_death.STARTER_PID: str(os.getppid())})
  assert p.returncode == 128 + signal.SIGTERM, p.stderr
  assert p.stderr.splitlines()[-1].startswith('vit-train: preempted (SIGTERM) outside the '
                                              'training steps'), p.stderr
  assert not (tmp_path / 'w').exists()
