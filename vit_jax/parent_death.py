"""A run that vit-sweep or vit-vtab started is stopped when that command dies, however it
dies (kill -9, the kernel's out-of-memory killer): left running, it trained on unwatched,
and the command run again found that run's workdir locked and marked the point failed.

The command passes its pid in the environment (`environment_for_run`); the run, once its
signal handlers are in place, asks the kernel (Linux) for SIGTERM as that process ends
(`stop_with_the_starter`): it then saves a checkpoint and exits, as on a SIGTERM of its own.
This is done in the run, not in a preexec_fn between fork and exec: a preexec_fn makes
Python fork through its at-fork hooks, where JAX, started in the parent, warns of deadlocks.
"""
import ctypes
import os
import signal
import sys

STARTER_PID = 'VIT_JAX_STARTER_PID'  # the pid of the vit-sweep or vit-vtab that started the run
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def environment_for_run(env=None):
  """`env` (default: this process's environment) with this process named as the starter."""
  return {**(os.environ if env is None else env), STARTER_PID: str(os.getpid())}


def stop_with_the_starter():
  """Where a starter is named: SIGTERM to this process as the starter ends, and at once where
  it has already ended (the kernel's request would never come). The setting outlives the
  exec of host_allocator's restart; the variable is removed, so that nothing this run starts
  takes it for its own."""
  starter = os.environ.pop(STARTER_PID, None)
  if starter is None or not sys.platform.startswith('linux'):
    return
  prctl = ctypes.CDLL(None, use_errno=True).prctl
  if prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM)) != 0:
    return  # refused (a sandbox's seccomp): the run goes on as one started by hand
  if starter.isdigit() and os.getppid() != int(starter):
    os.kill(os.getpid(), signal.SIGTERM)
