"""Ctrl-C ends a command with one line and status 130, never a KeyboardInterrupt traceback.

`interrupted` is the line each command prints (`stop_with` where it says more: a sweep's
point, vit-train's step); `held` keeps Ctrl-C out of imports; `deliver_lost_ones` sends
again a Ctrl-C that Python dropped. `terminate_like_ctrl_c` makes SIGTERM and SIGHUP raise
`Stopped`, a KeyboardInterrupt, where vit-sweep and vit-vtab run their points: they wait
for the running one to save, then stop with `what` stopped them and its `status`.
"""
import contextlib
import os
import signal
import sys
import threading
import time

STATUS = 130  # the shell's status for a command stopped by Ctrl-C


def stop_with(line, status=STATUS, abandoned=None, grace_s=10.0):
  """Exits with `status` (130: Ctrl-C's) and `line` as stderr's last line. Threads for which
  `abandoned(thread)` is true get `grace_s` to end, and the process exits without those
  that do not (see _exit)."""
  try:
    sys.stderr.write(line + '\n')
    sys.stderr.flush()
  except OSError:  # a closed terminal (SIGHUP): the status still says what happened
    discard_unwritten(sys.stderr)
  if abandoned is not None:
    _exit(status, [t for t in threading.enumerate() if t.is_alive() and abandoned(t)], grace_s)
  sys.exit(status)


def discard_unwritten(stream):
  """Points `stream` at /dev/null, for a reader that is gone (a closed terminal, a stopped
  pipe): the text left in its buffer would fail again at Python's exit flush, which turns
  the exit status into 120."""
  os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _exit(status, threads, grace_s):
  """sys.exit(status) once `threads` end; where one is still running `grace_s` later,
  os._exit(status). Python's exit waits for every non-daemon thread: a checkpoint save that
  failed before it began had left orbax's threads waiting on it, for minutes, after
  vit-train's last line."""
  deadline = time.monotonic() + grace_s
  for thread in threads:  # Thread's own join: orbax's raises TimeoutError at its timeout
    threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
  if any(thread.is_alive() for thread in threads):
    sys.stdout.flush()
    os._exit(status)  # pylint: disable=protected-access
  sys.exit(status)


class Stopped(KeyboardInterrupt):
  """SIGTERM or SIGHUP, where terminate_like_ctrl_c made it raise."""

  def __init__(self, signum):
    super().__init__(signum)
    self.signum = signum


@contextlib.contextmanager
def terminate_like_ctrl_c():
  """Within the block (in the main thread), SIGTERM and SIGHUP, unless ignored from the start
  (nohup), raise Stopped. The first stops the command; later ones are ignored: one passed
  on to the running command, which its process group also got, arrives as a second."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def raise_stopped(signum, frame):
    del frame
    signal.signal(signum, signal.SIG_IGN)
    raise Stopped(signum)

  with handling((signal.SIGTERM, signal.SIGHUP), raise_stopped):
    yield


@contextlib.contextmanager
def handling(signals, handler):
  """`handler` for each of `signals` within the block, but for one ignored from the start
  (nohup's SIGHUP); the previous handlers are given back as it ends."""
  previous = {}
  for sig in signals:
    if signal.getsignal(sig) != signal.SIG_IGN:
      previous[sig] = signal.signal(sig, handler)
  try:
    yield
  finally:
    for sig, old in previous.items():
      signal.signal(sig, old)


def what(interrupt):
  """The words for what stopped the command: Ctrl-C, SIGTERM or SIGHUP."""
  return {
      signal.SIGTERM: 'stopped (SIGTERM)',
      signal.SIGHUP: 'the terminal closed (SIGHUP)'
  }.get(getattr(interrupt, 'signum', None), 'interrupted (Ctrl-C)')


def status(interrupt):
  """The shell's exit status for the signal that raised `interrupt`: 128 + its number."""
  return 128 + getattr(interrupt, 'signum', signal.SIGINT)


def interrupted(program):
  stop_with(f'{program}: interrupted (Ctrl-C)')


@contextlib.contextmanager
def held(*also):
  """Ctrl-C (and the signals `also`) waits until the block ends, then lands there. For
  imports: a KeyboardInterrupt raised inside a C extension's initialisation (jaxlib's,
  ~0.1 s of `import jax`) crashed the process (SIGSEGV), became an ImportError traceback,
  or was dropped. Threads started inside the block keep the signals blocked, which leaves
  them to the main thread, whose handlers run them anyway."""
  previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *also})
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_delivering = []


def _interrupt_again():
  """SIGINT sent again from another thread, a moment later: sent from here, the handler would
  raise it inside deliver_lost_ones' hook again. On a loaded host it could land while this
  thread still waited for the timer's to start (Timer.start waits for it), and so was raised
  in the hook after all, printed as "Exception ignored" and lost: it is sent again then."""
  while True:
    try:
      threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
      return
    except KeyboardInterrupt:
      continue


def deliver_lost_ones():
  """A KeyboardInterrupt raised in a garbage-collection callback (JAX has one, which runs
  as TensorFlow imports) or in a __del__ is printed by Python as "Exception ignored", and
  the command ran on to its end. From now on such a one sends SIGINT again instead, where
  Python's default handler is in place. Once per process."""
  if _delivering:
    return
  _delivering.append(True)
  shown = sys.unraisablehook

  def hook(unraisable):
    if (isinstance(unraisable.exc_value, KeyboardInterrupt)
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
      _interrupt_again()
    else:
      shown(unraisable)

  sys.unraisablehook = hook
