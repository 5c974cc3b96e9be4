"""ctrl_c.stop_with's exit where threads are left running (vit-train's last line after a
failed save); its Ctrl-C and signal journeys are in test_console_scripts.py and
test_faults.py."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from vit_jax import ctrl_c

# A thread that waits for ever, as orbax's did after a save that failed before it began
# ('save'), or one that waits until Python's exit stops it, as orbax's metadata store does
# ('stopped at exit').
_CHILD = '''
import atexit, threading, sys
from vit_jax import ctrl_c
atexit.register(lambda: print('atexit ran', flush=True))
if sys.argv[1] == 'save':
  threading.Thread(target=threading.Event().wait, name='save').start()
else:
  stop = threading.Event()
  threading._register_atexit(stop.set)
  threading.Thread(target=stop.wait, name='stopped at exit').start()
ctrl_c.stop_with('vit-train: the last line', 1, abandoned=lambda t: t.name == 'save', grace_s=30)
'''


@pytest.mark.parametrize('thread, seconds, atexit', [('save', (30, 90), ''),
                                                     ('stopped at exit', (0, 20), 'atexit ran\n')])
def test_only_a_thread_left_waiting_is_abandoned(thread, seconds, atexit):
  """A save's thread still waiting after the grace period does not keep the process; any
  other thread, and the atexit handlers, get Python's own exit (a SIGTERM's exit had waited
  the whole grace period for orbax's metadata thread)."""
  start = time.monotonic()
  out = subprocess.run([sys.executable, '-c', _CHILD, thread], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
  assert (out.returncode, out.stderr.splitlines()[-1:]) == (1, ['vit-train: the last line'])
  assert out.stdout == atexit
  assert seconds[0] <= time.monotonic() - start < seconds[1]


def test_a_resent_ctrl_c_that_lands_as_its_timer_starts_is_sent_again(monkeypatch):
  """A Ctrl-C raised in a __del__ is sent again from a timer thread. Under load (Python 3.13,
  two test suites at once) it landed while Timer.start still waited for that thread, was raised
  inside the unraisable hook and lost: vit-evaluate then ran on and exited 0."""
  started = []

  class Timer:  # sends nothing: its first start is interrupted as that one was

    def __init__(self, *args):
      self.args = args

    def start(self):
      started.append(self.args)
      if len(started) == 1:
        raise KeyboardInterrupt

  monkeypatch.setattr(ctrl_c.threading, 'Timer', Timer)
  ctrl_c._interrupt_again()  # pylint: disable=protected-access
  assert [args[1:] for args in started] == [(os.kill, (os.getpid(), signal.SIGINT))] * 2
