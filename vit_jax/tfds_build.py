"""vit-tfds-build: prepares TFDS datasets in a data_dir (downloads them, then writes the
files vit-train reads), as `tfds build NAME --data_dir=DIR` would.

  vit-tfds-build cifar10 [oxford_iiit_pet ...] [--data_dir=DIR] [--manual_dir=DIR]

(python -m vit_jax.tfds_build is the same.) vit-train, vit-evaluate, vit-sweep, vit-vtab and
vit-tpu name this command where a dataset is not prepared. TFDS's own `tfds build` does not
start without apache-beam, which it imports for another of its subcommands but does not
install (tensorflow/datasets#5463); apache-beam's pins conflict with this stack's, so vit_jax
does not install it either.

The datasets are prepared one after another, each as tfds.builder(NAME, data_dir=DIR)
.download_and_prepare() does; one already prepared in DIR is left as it is, and the first
that cannot be prepared stops the command with one line. DIR defaults to TFDS's
(~/tensorflow_datasets) and may be gs://. Datasets whose files TFDS cannot download
(imagenet2012) read them from --manual_dir (default DIR/downloads/manual), as the TFDS
catalog says. A preparation that fails or is cut off (Ctrl-C) leaves nothing of its own in a
local DIR (see _tidied_on_failure); the same command starts that dataset again. Two
commands for one dataset in one local DIR take turns (_one_preparation_at_a_time).
"""
import argparse
import contextlib
import difflib
import errno
import fcntl
import os
import re
import shutil
import socket
import sys

from vit_jax import cli_help
from vit_jax import errors
from vit_jax import paths

PROGRAM = 'vit-tfds-build'
CATALOG = 'https://www.tensorflow.org/datasets/catalog'
# The pip package of a module that TFDS imports to prepare some datasets, where the names
# differ (cv2: VTAB's sun397, kitti and diabetic_retinopathy_detection).
_PACKAGES = {'cv2': 'opencv-python-headless'}


class BuildError(Exception):
  """A dataset that cannot be prepared, or a bad argument; main prints it as one line."""


class _Parser(argparse.ArgumentParser):

  def error(self, message):
    raise BuildError(message)


def parser():
  p = _Parser(prog=PROGRAM, description=__doc__.split('\n')[0])
  p.register('action', None, cli_help.StoreOnce)  # a flag given twice is refused
  p.add_argument(
      'datasets', nargs='+', metavar='NAME',
      help='TFDS dataset names, as vit-train\'s --config.dataset (cifar10, '
      'diabetic_retinopathy_detection/btgraham-300, ...)')
  p.add_argument('--data_dir', '--data-dir', dest='data_dir', default=None,
                 help='where to write them, as --config.data_dir (default: ~/tensorflow_datasets)')
  p.add_argument(
      '--manual_dir', '--manual-dir', dest='manual_dir', default=None,
      help='files downloaded by hand, for the datasets that need them (default: '
      'DATA_DIR/downloads/manual)')
  return p


def _why_not_downloaded(e) -> str:
  """The URL and the cause under requests' 'Max retries exceeded with url ... (Caused by ...)';
  that whole text where there is no such cause."""
  url = getattr(getattr(e, 'request', None), 'url', None)
  cause = getattr(e.args[0], 'reason', None) if e.args else None  # urllib3's MaxRetryError
  return f'{url}: {errors.one_line(cause)}' if url and cause else errors.one_line(e)


# TFDS's folder of one download under way: <file>.tmp.<uuid4 hex>.
_DOWNLOAD_UNDER_WAY = re.compile(r'\.tmp\.[0-9a-f]{32}$')


def _listing(folder):
  return set(os.listdir(folder)) if os.path.isdir(folder) else set()


@contextlib.contextmanager
def _tidied_on_failure(builder):
  """Where preparing `builder`'s dataset in a local data_dir fails or is cut off, removes what
  it left there that was not there before: the folders of downloads under way (TFDS removes
  one only once its file is whole, with what it had received, and a later run starts a new
  one) and the folders made for the dataset, where empty. TFDS removes its incomplete.*."""
  # pylint: disable-next=g-import-not-at-top  (TensorFlow: imported by prepare)
  from vit_jax import data_sources
  root = data_sources.data_dir_root(builder)
  if paths.is_remote(root):
    yield
    return
  downloads = os.path.join(root, 'downloads')
  under_way = os.path.join(downloads, builder.name)  # this dataset's alone: not another's
  dataset = builder.info.full_name.split('/')[:-1]  # name[/config], less the version
  made = [root, downloads, os.path.join(downloads, 'extracted'), under_way]
  made += [os.path.join(root, *dataset[:i]) for i in range(1, len(dataset) + 1)]
  made = [f for f in made if not os.path.isdir(f)]
  before = _listing(under_way)
  try:
    yield
  except BaseException:
    for entry in _listing(under_way) - before:
      if _DOWNLOAD_UNDER_WAY.search(entry):
        shutil.rmtree(os.path.join(under_way, entry), ignore_errors=True)
    _remove_where_empty(made)
    raise


def _remove_where_empty(folders):
  """Removes each of `folders` that is empty, a folder's own before it (one that is not
  empty holds what another put there)."""
  for folder in sorted(folders, key=len, reverse=True):
    with contextlib.suppress(OSError):
      os.rmdir(folder)


_LOCK = 'vit-tfds-build.lock'  # in DIR/downloads/<name>, while one command prepares it
# flock's errors where a filesystem has no locks (a FUSE mount: ENOSYS; NFS without lockd: ENOLCK)
_NO_LOCKS_HERE = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


def _locked(path, name, root, out, made):
  """(fd, waited): `path` opened and flocked, once another holder lets go of it; fd None
  where the filesystem has no locks (see _NO_LOCKS_HERE): prepared unlocked. Adds
  to `made` the folders from `root` to `path` it makes."""
  waited = False
  folders = [root, os.path.join(root, 'downloads'), os.path.dirname(path)]
  while True:
    # Each time: a holder that failed removed the folders it had made.
    made.update(f for f in folders if not os.path.isdir(f))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        if not waited:
          holder = os.read(fd, 200).decode(errors='replace').strip()
          print(
              f'{name}: {holder or "another vit-tfds-build"} is preparing it in {root}: '
              'waiting for it to end', file=out, flush=True)
          waited = True
        fcntl.flock(fd, fcntl.LOCK_EX)
      if os.fstat(fd).st_ino == os.stat(path).st_ino:
        return fd, waited
    except FileNotFoundError:
      pass  # removed by its holder as it ended, after this one opened it: open anew
    except OSError as e:
      os.close(fd)
      if e.errno not in _NO_LOCKS_HERE:
        raise
      with contextlib.suppress(OSError):
        os.unlink(path)
      return None, False
    except BaseException:  # Ctrl-C while waiting
      os.close(fd)
      raise
    os.close(fd)


@contextlib.contextmanager
def _one_preparation_at_a_time(builder, name, out):
  """Holds DIR/downloads/<dataset>/vit-tfds-build.lock (flock: released by the kernel however
  its holder ends) while the dataset is prepared in a local data_dir, waiting for another
  command that holds it; yields whether it waited. Two at once had downloaded and written
  the dataset twice, and the one that finished second had failed ('Cannot rename ...
  Destination ... already exists'); a failing one had removed the other's downloads under
  way. The lock is per dataset, not per config: their configs share its downloads."""
  # pylint: disable-next=g-import-not-at-top  (TensorFlow: imported by prepare)
  from vit_jax import data_sources
  root = data_sources.data_dir_root(builder)
  if paths.is_remote(root):  # object stores have no locks: the user's part
    yield False
    return
  path = os.path.join(root, 'downloads', builder.name, _LOCK)
  made = set()
  try:
    fd, waited = _locked(path, name, root, out, made)
    if fd is None:
      yield False
      return
    os.ftruncate(fd, 0)
    os.write(fd, f'pid {os.getpid()} on {socket.gethostname()}'.encode())
    try:
      yield waited
    finally:
      os.unlink(path)  # before the lock is let go: a waiter on this file then opens anew
      os.close(fd)
      # Its folder too, where empty, whoever made it: a holder that ended as this one took
      # over could not remove it, this one's lock being inside.
      made.add(os.path.dirname(path))
  finally:
    _remove_where_empty(made)  # not empty: TFDS's files are there


def prepare(name, data_dir, manual_dir, out):
  """Prepares dataset `name` in `data_dir` (None: TFDS's default), saying what it did."""
  # pylint: disable=g-import-not-at-top  (TensorFlow: after the arguments are checked)
  from vit_jax import tensorflow_quietly  # noqa: F401  (first: before TensorFlow loads)
  import requests
  import tensorflow_datasets as tfds
  from vit_jax import data_sources
  # pylint: enable=g-import-not-at-top
  try:
    builder = data_sources.tfds_builder(name, data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    close = difflib.get_close_matches(name.split('/')[0], tfds.list_builders(), n=1)
    mean = f' (did you mean {close[0]}?)' if close else ''
    raise BuildError(f'{name}: TFDS has no dataset of that name{mean}: see {CATALOG}') from None
  except data_sources.DataDirUnreadable as e:
    raise BuildError(f'{name}: {e}') from None
  except (ValueError, AssertionError) as e:  # a name TFDS cannot parse, a config it lacks
    raise BuildError(f'{name}: {data_sources.why_tfds_refuses(e)}: see {CATALOG}') from None
  where = builder.data_dir
  try:
    prepared = data_sources.has_prepared_files(builder)
  except data_sources.DataDirUnreadable as e:
    raise BuildError(f'{name}: {e}') from None
  if prepared:
    print(f'{name}: already prepared in {where}, left as it is', file=out, flush=True)
    return
  config = tfds.download.DownloadConfig(manual_dir=manual_dir)
  try:
    with _one_preparation_at_a_time(builder, name, out) as waited, _tidied_on_failure(builder):
      if waited and data_sources.has_prepared_files(builder):
        print(f'{name}: prepared in {where} by the command it waited for, left as it is', file=out,
              flush=True)
        return
      builder.download_and_prepare(download_config=config)
  except requests.exceptions.RequestException as e:
    raise BuildError(f'{name}: cannot download its files ({_why_not_downloaded(e)}): check this '
                     'machine\'s network, or prepare it on a machine that has one and copy '
                     f'{where} to the same path here') from None
  except ImportError as e:  # TFDS's lazy import of what one dataset's preparation needs
    named = re.search(r"No module named '([\w.]+)'", str(e))  # TFDS re-raises it without .name
    module = (e.name or (named[1] if named else '?')).split('.')[0]
    raise BuildError(f'{name}: preparing it needs the Python module {module}, which vit_jax does '
                     f'not install: pip install {_PACKAGES.get(module, module)}, then run this '
                     'command again') from None
  except AssertionError as e:  # TFDS's check of a manual download: what to put where
    raise BuildError(f'{name}: {" ".join(str(e).split())} Then run this command again.') from None
  except OSError as e:
    raise BuildError(f'{name}: cannot prepare it in {where}: {errors.one_line(e)}') from None
  sizes = ', '.join(
      f'{split}: {info.num_examples:,}' for split, info in builder.info.splits.items())
  print(f'{name}: prepared in {where} ({sizes} examples)', file=out, flush=True)


def main(argv=None, out=None):
  """The vit-tfds-build console script."""
  out = out or sys.stdout
  try:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    for name in dict.fromkeys(args.datasets):
      prepare(name, args.data_dir, args.manual_dir, out)
  except BuildError as e:
    sys.exit(f'{PROGRAM}: error: {e}')


if __name__ == '__main__':
  from vit_jax import console_scripts  # pylint: disable=g-import-not-at-top
  console_scripts.run_as_main(main, PROGRAM)
