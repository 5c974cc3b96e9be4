"""Local and remote (gs://, other URL schemes) paths: one place that tells them apart.

Local paths may be relative or start with '~'; they are made absolute once, at start-up
(orbax refuses relative checkpoint paths). Remote paths go through TensorFlow's gfile,
imported only when one is used.
"""
import os

from vit_jax import errors


def is_remote(path):
  return '://' in str(path)


def resolve(path):
  """An absolute local path ('~' expanded), or a remote path unchanged. A '~' that names no
  home (HOME unset, as in some containers, and no passwd entry) is a ValueError: kept as it
  is, it had made a folder named '~' in the current one, which `rm -rf ~` then removes
  along with the real home."""
  path = str(path)
  if is_remote(path):
    return path
  expanded = os.path.expanduser(path)
  if expanded.startswith('~'):
    home = expanded.split(os.sep)[0]
    raise ValueError(f'{path}: {home!r} names no home folder here (HOME is not set, and this '
                     'user has no home in the passwd file): give the path from /, or set HOME')
  return os.path.abspath(expanded)


def home():
  """This user's home folder, or None where '~' names none (HOME unset, as in some
  containers, and no passwd entry)."""
  folder = os.path.expanduser('~')
  return None if folder == '~' else folder


def vit_jax_cache():
  """This user's cache folder for vit_jax ($XDG_CACHE_HOME/vit_jax, else ~/.cache/vit_jax),
  or None where neither names a folder."""
  root = os.environ.get('XDG_CACHE_HOME') or (home() and os.path.join(home(), '.cache'))
  return os.path.join(root, 'vit_jax') if root else None


def resolve_folder_flag(path, flag='--workdir', example='workdirs/NAME'):
  """resolve() for a folder given on the command line. An empty one (`--workdir=$DIR` with
  DIR unset) is refused: taken as the current directory, it would fill that with the run."""
  if not str(path).strip():
    raise ValueError(f'{flag} is empty (an unset shell variable?): pass a folder, e.g. '
                     f'{flag}={example}')
  try:
    return resolve(path)
  except ValueError as e:
    raise ValueError(f'{flag}={e}') from None


# Not in the path of a folder that holds orbax checkpoints: orbax finds the parts of a save
# by a glob of that path, which escapes nothing, so a '[' there matches no folder, the parts
# are left unmerged and the checkpoint cannot be restored; tensorstore takes a backslash for a
# separator and writes outside the folder.
_NOT_IN_A_CHECKPOINT_PATH = {'[': "'['", '\\': 'a backslash'}


def resolve_run_folder(path, flag='--workdir', example='workdirs/NAME'):
  """resolve_folder_flag() for a folder in which runs save checkpoints."""
  resolved = resolve_folder_flag(path, flag, example)
  if found := [name for c, name in _NOT_IN_A_CHECKPOINT_PATH.items() if c in resolved]:
    where = '' if resolved == str(path) else f' ({resolved})'
    raise ValueError(f'{flag}={path}: orbax cannot save checkpoints under a path holding '
                     f"{' and '.join(found)}{where}: use a {flag} whose path has no '[' or "
                     'backslash')
  return resolved


def _gfile():
  """tf.io.gfile, for remote paths only: TensorFlow is imported on first use, without the
  notices it prints as it loads (vit_jax/tensorflow_quietly.py), which had come before a
  command's one line about a bucket."""
  # pylint: disable=g-import-not-at-top
  from vit_jax import tensorflow_quietly  # noqa: F401
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  return tf.io.gfile


def open_file(path, mode):
  """open() for local files, tf.io.gfile.GFile for remote ones."""
  if is_remote(path):
    return _gfile().GFile(str(path), mode)
  return open(path, mode)


def exists(path):
  if is_remote(path):
    return _gfile().exists(str(path))
  return os.path.exists(path)


def stat(path):
  """os.stat, or tf.io.gfile.stat for a remote path (one metadata request)."""
  if is_remote(path):
    return _gfile().stat(str(path))
  return os.stat(path)


def makedirs(path):
  if is_remote(path):
    _gfile().makedirs(str(path))
  else:
    os.makedirs(path, exist_ok=True)


def make_workdir(path, flag='--workdir'):
  """makedirs(path) for a directory a command writes into; a ValueError of one line that
  names `flag` where it cannot be created (a file in the way, no permission, a read-only
  disk, a bucket this machine cannot write)."""
  try:
    makedirs(path)
  except Exception as e:  # pylint: disable=broad-except  (OSError, or gfile's OpError)
    if not (isinstance(e, OSError) or type(e).__module__.startswith('tensorflow')):
      raise
    if is_remote(path):
      fix = f'{errors.GCS_FIX}, or choose another {flag}'
    else:
      fix = f'choose a writable {flag}'
    blocking, dangling = _file_in_the_way(path), _dangling_link(path)
    if blocking:
      why = f'{blocking} is not a directory'
    elif dangling:  # makedirs says only 'File exists'
      target = os.path.normpath(os.path.join(os.path.dirname(dangling), os.readlink(dangling)))
      why = f'{dangling} is a symbolic link to {target}, which does not exist'
      fix = f'create {target} (mkdir -p) or {fix}'
    else:
      why = errors.storage_why(e)
    raise ValueError(f'cannot create workdir {path}: {why}: {fix}') from None


def _file_in_the_way(path):
  """The first local ancestor of `path` (or `path` itself) that exists and is no directory."""
  return _first_ancestor(path, lambda p: os.path.exists(p) and not os.path.isdir(p))


def _dangling_link(path):
  """The first local ancestor of `path` (or `path` itself) that is a link to nothing."""
  return _first_ancestor(path, lambda p: os.path.islink(p) and not os.path.exists(p))


def _first_ancestor(path, test):
  """The first of the local `path`'s ancestors, from the root down, and `path` itself that
  passes `test`, or None (none does, or `path` is remote)."""
  if is_remote(path):
    return None
  parts = os.path.abspath(path).split(os.sep)
  for i in range(2, len(parts) + 1):
    prefix = os.sep.join(parts[:i])
    if test(prefix):
      return prefix
  return None


def check_not_a_file(path, flag='--workdir'):
  """A ValueError of one line where a local `path` exists and is not a directory (for
  --dry-run, which creates nothing)."""
  blocking = _file_in_the_way(path)
  if blocking:
    raise ValueError(f'{flag} {path}: {blocking} is not a directory: choose another {flag}')
