r"""Cloud TPU VMs: check, create, set up, run vit_jax on every worker, watch, resume, delete.

  vit-tpu preflight --name vit --zone us-central2-b --accelerator_type v4-8 \
      --config=finetune:ViT-B_16,cifar10 --workdir=gs://BUCKET/vit/cifar10 \
      --config.data_dir=gs://BUCKET/tensorflow_datasets
  vit-tpu create --name vit --zone us-central2-b --accelerator_type v4-8 [--spot]
  vit-tpu setup  --name vit --zone us-central2-b
  vit-tpu run    --name vit --zone us-central2-b --accelerator_type v4-8 --config=... --workdir=...
  vit-tpu all    ...  (preflight, create, setup, run)
  vit-tpu logs   --name vit --zone us-central2-b [--worker all] [--follow]
  vit-tpu watch  ...  (as `all`: re-creates a preempted Spot VM until final.npz exists)
  vit-tpu resume ...  (as `all`: once; re-creates the VM only if it was preempted)
  vit-tpu stop   --name vit --zone us-central2-b
  vit-tpu delete --name vit --zone us-central2-b

(python -m vit_jax.launch.tpu_vm is the same.) --dry-run prints the commands (one per line,
shell-quoted; waits, checks and choices as `#` comments) and runs nothing.

Creation goes through a queued resource (`gcloud compute tpus queued-resources`) for v5e,
v5p, v6e and Spot, as Google's docs recommend, and `tpu-vm create` otherwise; --api picks.
A preempted Spot VM cannot be restarted: `resume`/`watch` delete it and create it again,
set it up and start the same command on the same workdir, which resumes from the last
checkpoint. `watch` knows the run is done when WORKDIR/final.npz exists (process 0 writes
it after the last step; a preempted run saves a checkpoint and exits without it).

On every worker, in the home directory: the code in vit_jax/, a venv in vit_jax_venv/ with
the Python that setup.py's python_requires names (the TPU images ship an older one), logs
in vit_jax_logs/ (<log>.log, and <log>.status with the exit status once the run ended).
The run starts in ~/vit_jax, so a --config file must be one of the tree that setup ships
(this repository; with --repo_url, its clone): it is passed by its path there, and a file
from elsewhere is refused before anything is created (packaged names work as they are).
"""
import argparse
import fnmatch
import functools
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from vit_jax import cli_help
from vit_jax import console_scripts
from vit_jax import ctrl_c
from vit_jax import paths
from vit_jax import tfds_build

ACTIONS = ('preflight', 'create', 'setup', 'run', 'logs', 'stop', 'delete', 'all', 'resume',
           'watch')
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# On each worker, relative to the home directory.
CODE_DIR, VENV_DIR, LOG_DIR = 'vit_jax', 'vit_jax_venv', 'vit_jax_logs'
PID_FILE = f'{LOG_DIR}/run.pid'
# What a --log name may hold (a regex character set): no path, no space; vit-sweep's point
# names (base_lr=0.003,warmup_steps=100) are made of these.
LOG_NAME_CHARS = r'\w.=,+-'
# The longest name whose files (<log>.log, <log>.status) a filesystem takes: 255 UTF-8 bytes.
LOG_NAME_BYTES = 255 - len('.status')
# Left by `stop` until the next start: `watch` must not start again a run the user stopped.
STOPPED_FILE = f'{LOG_DIR}/stopped'
# How long `stop` waits for the run to save its checkpoint and exit.
STOP_WAIT_S = 600
# Left out of the tarball of the working tree.
TAR_EXCLUDES = ('.git', '.venv', 'workdirs', '__pycache__', '*.egg-info', '.pytest_cache', 'build',
                'dist', '*.npz')  # Checkpoints: read them from gs:// instead.
# Left out only at the top of the tree: what the README's first-look commands write there.
TAR_EXCLUDES_AT_ROOT = ('shoe.png', 'figures')
# Runtime images per TPU generation (gcloud compute tpus versions list --zone Z).
RUNTIME_VERSIONS = {
    'v2': 'tpu-ubuntu2204-base',
    'v3': 'tpu-ubuntu2204-base',
    'v4': 'tpu-ubuntu2204-base',
    'v5litepod': 'v2-alpha-tpuv5-lite',
    'v5p': 'v2-alpha-tpuv5',
    'v6e': 'v2-alpha-tpuv6e'
}
# Generations whose docs create them through queued resources (Spot too, any generation).
QUEUED_GENERATIONS = ('v5litepod', 'v5p', 'v6e')
# Zones that offer each generation, AS OF 2026-11 (Google Cloud "TPU regions and zones",
# https://cloud.google.com/tpu/docs/regions-zones). Incomplete and changing: only a warning
# comes of it; check the docs (or `gcloud compute tpus accelerator-types list --zone Z`).
TPU_ZONES = {
    'v2': ('us-central1-a', 'us-central1-b', 'us-central1-c', 'us-central1-f', 'europe-west4-a',
           'asia-east1-c'),
    'v3': ('us-central1-a', 'us-central1-b', 'us-central1-f', 'europe-west4-a'),
    'v4': ('us-central2-b',),
    'v5litepod': ('us-central1-a', 'us-south1-a', 'us-west1-c', 'us-west4-a', 'us-east1-c',
                  'us-east5-a', 'us-east5-b', 'us-east5-c', 'europe-west4-b', 'asia-southeast1-b'),
    'v5p': ('us-central1-a', 'us-east5-a', 'us-east5-b', 'us-east5-c', 'us-south1-a',
            'europe-west4-b'),
    'v6e':
        ('us-central1-b', 'us-central2-b', 'us-east1-d', 'us-east4-a', 'us-east4-b', 'us-east5-a',
         'us-east5-b', 'us-east5-c', 'us-west1-c', 'europe-west4-a', 'asia-northeast1-b'),
}
# States (tpu-vm describe: state; queued-resources describe: state.state).
GONE = ('PREEMPTED', 'TERMINATED', 'SUSPENDED', 'FAILED', 'MISSING')  # delete, create again
PENDING = ('CREATING', 'STARTING', 'RESTARTING', 'REPAIRING', 'ACCEPTED', 'PROVISIONING',
           'WAITING_FOR_RESOURCES', 'SUSPENDING', 'DELETING')  # wait
READY = 'READY'


class LaunchError(Exception):
  """A bad argument or a failed command; main prints it as one line."""


def _parse_type(accelerator_type):
  m = re.fullmatch(r'(v\d+[a-z]*)-(\d+)', accelerator_type or '')
  return (m.group(1), int(m.group(2))) if m else (None, None)


_CORE_GENERATIONS = ('v2', 'v3', 'v4', 'v5p')  # sized in TensorCores: 8 per host
_CHIP_GENERATIONS = ('v5litepod', 'v5e', 'v6e')  # in chips: 1, 4 or 8 on one host, then 4 per host

# The slice sizes Cloud TPU offers where they are a short list (v4 and v5p take many
# topologies: any multiple of 8 TensorCores is let through to gcloud).
_SIZES = {
    'v2': (8, 32, 128, 256, 512),
    'v3': (8, 32, 64, 128, 256, 512, 1024, 2048),
    **dict.fromkeys(_CHIP_GENERATIONS, (1, 4, 8, 16, 32, 64, 128, 256)),  # 1x1 .. 16x16
}


def _known_size(generation, n):
  """Whether `n` is a slice size of `generation` (cores for v2-v4/v5p, chips for v5e/v6e)."""
  if generation in _SIZES:
    return n in _SIZES[generation]
  if generation in _CORE_GENERATIONS:
    return n >= 8 and n % 8 == 0
  return False


def _sizes_text(generation):
  if generation in _SIZES:
    unit = 'TensorCores' if generation in _CORE_GENERATIONS else 'chips'
    return f'{", ".join(map(str, _SIZES[generation][:-1]))} or {_SIZES[generation][-1]} {unit}'
  return 'a multiple of 8 TensorCores'


def accelerator_type_flag(text):
  """(--accelerator_type as Cloud TPU names it, warnings): lower case, v5e-N as v5litepod-N.

  LaunchError for one not of the form v<generation>-<size> (tpu-v4, v4), or of a size its
  generation has not (v4-9); a well-formed type of another generation (v9-8) is only
  warned about, since Cloud TPU may have it by now.
  """
  accelerator_type = text.lower()
  generation, n = _parse_type(accelerator_type)
  if generation is None:
    raise LaunchError(f'--accelerator_type {text!r} is not a TPU type: write it as '
                      'v<generation>-<size>, e.g. v4-8 or v5litepod-16 (gcloud compute tpus '
                      'accelerator-types list --zone ZONE)')
  if n == 0:
    raise LaunchError(f'--accelerator_type {text} has no cores: pass a slice size, e.g. '
                      f'{generation}-8')
  if generation in _CORE_GENERATIONS + _CHIP_GENERATIONS and not _known_size(generation, n):
    raise LaunchError(f'--accelerator_type {text}: a {generation} slice has '
                      f'{_sizes_text(generation)}: pick one, e.g. {generation}-8 or '
                      f'{generation}-32')
  warnings = []
  if generation == 'v5e':
    accelerator_type = f'v5litepod-{n}'
    warnings.append(f'v5e-{n} is called {accelerator_type} by Cloud TPU: using '
                    f'--accelerator_type {accelerator_type}')
  return accelerator_type, warnings + [w for w in (type_warning(accelerator_type),) if w]


def zone_flag(text):
  """--zone in lower case; LaunchError for one not of the form <region>-<letter>."""
  zone = text.lower()
  if not re.fullmatch(r'[a-z]+-[a-z]+\d+-[a-z]', zone):
    raise LaunchError(f'--zone {text!r} is not a zone: write it as <region>-<letter>, e.g. '
                      'us-central2-b or europe-west4-a (gcloud compute tpus locations list)')
  return zone


def check_name(name, flag='--name'):
  """LaunchError for a TPU VM name Cloud TPU refuses."""
  if not re.fullmatch(r'[a-z]([-a-z0-9]{0,61}[a-z0-9])?', name):
    raise LaunchError(f'{flag} {name!r}: use lowercase letters, digits and hyphens, starting '
                      'with a letter')


def type_warning(accelerator_type):
  """A line for an accelerator type this tool does not know (None if it does)."""
  generation, n = _parse_type(accelerator_type)
  if generation is not None and _known_size(generation, n):
    return None
  return (f'--accelerator_type {accelerator_type} is not a TPU type this tool knows '
          f'({", ".join(RUNTIME_VERSIONS)}; e.g. v4-8, v5litepod-16): check it with gcloud '
          'compute tpus accelerator-types list --zone ZONE; its devices and hosts are not checked')


def num_hosts(accelerator_type):
  """Workers (hosts) of a slice: v3-8 -> 1, v3-32 -> 4, v4-32 -> 4; None if unknown."""
  generation, n = _parse_type(accelerator_type)
  if generation is None or not _known_size(generation, n):
    return None
  if generation in _CHIP_GENERATIONS:  # Counted in chips: 8 on one host, else 4 per host.
    return 1 if n <= 8 else n // 4
  return max(1, n // 8)  # Counted in TensorCores: 8 per host.


def num_devices(accelerator_type):
  """jax.device_count() on a slice: v3-8 -> 8 (a device per core), v4-8 -> 4 (per chip)."""
  generation, n = _parse_type(accelerator_type)
  if generation is None or not _known_size(generation, n):
    return None
  if generation in ('v2', 'v3', 'v5litepod', 'v5e', 'v6e'):  # One device per core / per chip.
    return n
  if generation in ('v4', 'v5p'):  # Counted in TensorCores, two per chip (megacore device).
    return max(1, n // 2)
  return None


def jax_version(constraints=os.path.join(REPO_ROOT, 'constraints.txt')):
  """The jax pin of constraints.txt (the tested stack), so that jax[tpu] matches the rest."""
  with open(constraints) as f:
    m = re.search(r'^jax==(\S+)$', f.read(), re.MULTILINE)
  if not m:
    raise LaunchError(f'no "jax==X" pin in {constraints}: add it, or pin jax[tpu] by hand')
  return m.group(1)


def in_checkout():
  """True when this module runs from a working tree (not from an installed wheel)."""
  return all(
      os.path.exists(os.path.join(REPO_ROOT, p))
      for p in ('setup.py', 'constraints.txt', 'vit_jax'))


def python_requires():
  """setup.py's python_requires (a checkout), else the installed package's Requires-Python."""
  setup_py = os.path.join(REPO_ROOT, 'setup.py')
  if os.path.isfile(setup_py):
    with open(setup_py) as f:
      m = re.search(r'python_requires\s*=\s*["\']([^"\']+)["\']', f.read())
    if m:
      return m.group(1)
  try:
    return importlib.metadata.metadata('vit_jax').get('Requires-Python') or ''
  except importlib.metadata.PackageNotFoundError:
    return ''


def default_python():
  """'>=3.11' -> 'python3.11': the interpreter the venv on the VM is made with."""
  m = re.search(r'>=\s*3\.(\d+)', python_requires())
  return f'python3.{m.group(1)}' if m else 'python3'


def tarball_path(name):
  """In the user's own cache, not the shared /tmp, where a fixed name could be planted."""
  cache = paths.vit_jax_cache()
  if cache is None:  # it had been ./~/.cache in the current folder
    raise LaunchError('no folder to pack the code in: this user has no home (HOME is not set, '
                      'and no passwd entry): set HOME or XDG_CACHE_HOME')
  return os.path.join(cache, f'{name}.tar.gz')


def _project(args):
  return ['--project', args.project] if getattr(args, 'project', None) else []


def gcloud(verb, args, *rest):
  """gcloud compute tpus tpu-vm VERB NAME --zone Z [--project P] REST..."""
  return (['gcloud', 'compute', 'tpus', 'tpu-vm', verb, args.name, '--zone', args.zone]
          + _project(args) + list(rest))


def queued(verb, args, *rest):
  """gcloud compute tpus queued-resources VERB NAME --zone Z [--project P] REST..."""
  return (['gcloud', 'compute', 'tpus', 'queued-resources', verb, args.name, '--zone', args.zone]
          + _project(args) + list(rest))


def _internal_ip(args):
  return ['--internal-ip'] if getattr(args, 'internal_ips', False) else []


def ssh(args, worker, command):
  return gcloud('ssh', args, f'--worker={worker}', *_internal_ip(args), '--command', command)


def train_argv(config, workdir, overrides=()):
  """The command every worker runs (from the code directory, in the venv)."""
  return ['python3', '-m', 'vit_jax.main', f'--config={config}', f'--workdir={workdir}', *overrides]


def start_script(jobs):
  """Remote shell: runs the (argv, log name) jobs one after another in the background.

  Each job writes ~/vit_jax_logs/<log>.log, then its exit status to <log>.status; a failing
  job does not stop the next. The process group id goes to ~/vit_jax_logs/run.pid (for
  `stop`); a second start while one is running is refused.
  """

  def status(log):
    return f'"$HOME"/{LOG_DIR}/{shlex.quote(log + ".status")}'

  body = '; '.join(f'{shlex.join(argv)} > "$HOME"/{LOG_DIR}/{shlex.quote(log + ".log")} 2>&1; '
                   f'echo $? > {status(log)}' for argv, log in jobs)
  pid = f'"$HOME"/{PID_FILE}'
  return '; '.join([
      'set -e',
      f'cd "$HOME"/{CODE_DIR}',
      f'. "$HOME"/{VENV_DIR}/bin/activate',
      # The installed package, not ./vit_jax (which lacks vit_jax.configs): no cwd on sys.path.
      'export PYTHONSAFEPATH=1',
      f'mkdir -p "$HOME"/{LOG_DIR}',
      f'if [ -f {pid} ] && kill -0 -- -"$(cat {pid})" 2>/dev/null; then echo "$(hostname): a '
      'run is still going: vit-tpu stop ... first" >&2; exit 1; fi',
      f'rm -f "$HOME"/{STOPPED_FILE} ' + ' '.join(status(log) for _, log in jobs),
      f'setsid nohup sh -c {shlex.quote(body)} > /dev/null 2>&1 < /dev/null & echo $! > {pid}',
      'echo "$(hostname): started, logs in ~/' + LOG_DIR + '/: '
      + ' '.join(f'{log}.log' for _, log in jobs) + '"'
  ])


def status_script(log):
  """Remote shell printing one line: `stopped` (by `vit-tpu stop`), `exit N` (the run ended),
  `running`, or `none`."""
  status, pid = f'"$HOME"/{LOG_DIR}/{shlex.quote(log + ".status")}', f'"$HOME"/{PID_FILE}'
  return (f'if [ -f "$HOME"/{STOPPED_FILE} ]; then echo stopped; '
          f'elif [ -f {status} ]; then echo "exit $(cat {status})"; '
          f'elif [ -f {pid} ] && kill -0 -- -"$(cat {pid})" 2>/dev/null; then echo running; '
          'else echo none; fi')


def setup_script(args):
  """Remote shell: fresh code in ~/vit_jax, then the package with jax[tpu] into the venv."""
  if args.repo_url:
    branch = ['--branch', args.branch] if args.branch else []
    fetch = f'rm -rf {CODE_DIR}; ' + shlex.join(
        ['git', 'clone', '--depth', '1', *branch, args.repo_url, CODE_DIR])
  else:
    fetch = (f'rm -rf {CODE_DIR}; mkdir {CODE_DIR}; tar -xzf {CODE_DIR}.tar.gz -C {CODE_DIR}; '
             f'rm {CODE_DIR}.tar.gz')
  py = shlex.quote(args.python or default_python())
  apt = 'sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -qq'
  pip = f'"$HOME"/{VENV_DIR}/bin/python -m pip install -q'
  return '; '.join([
      'set -e',
      fetch,
      # The TPU images ship an older Python than setup.py's python_requires (with its venv).
      f'if ! {py} -c "import ensurepip" 2>/dev/null; then {apt} update; '
      f'{apt} install -y {py} {py}-venv; fi',
      f'{py} -m venv {VENV_DIR}',
      f'{pip} --upgrade pip',
      # constraints.txt pins the tested stack, jax included; jax[tpu] brings libtpu (PyPI).
      f'(cd {CODE_DIR} && {pip} -c constraints.txt ' + shlex.quote('.[tpu]') + ')',
      f'echo "$(hostname): ready, $({VENV_DIR}/bin/python -c "import jax; print(\'jax\', '
      f'jax.__version__)")"'
  ])


# ---------------------------------------------------------------- steps besides commands


class Wait:
  """Polls a describe command until the state is one of `until`; fails on `fail` states."""

  def __init__(self, cmd, until, fail, what, poll):
    self.cmd, self.until, self.fail, self.what, self.poll = cmd, until, fail, what, poll

  def show(self):
    return f'{shlex.join(self.cmd)}  # every {self.poll:g} s until {" or ".join(self.until)}'

  def run(self, runner):
    start, last, polls = time.monotonic(), None, 0
    while True:
      state = runner.state(self.cmd)
      elapsed = int(time.monotonic() - start)
      if state != last or polls % 10 == 0:
        runner.say(f'{self.what}: {state} ({elapsed // 60} min {elapsed % 60} s)')
      if state in self.until:
        return
      if state in self.fail:
        raise LaunchError(f'{self.what} is {state}: `{" ".join(self.cmd[:7])}` shows why; '
                          'delete it and create it again (or try another zone)')
      last, polls = state, polls + 1
      runner.sleep(self.poll)


class Check:
  """A preflight check that needs the network: run it, or (dry run) say what it checks."""

  def __init__(self, what, fn):
    self.what, self.fn = what, fn

  def show(self):
    return f'# preflight: would check that {self.what}'

  def run(self, runner):
    runner.say(f'preflight: {self.fn()}')


class DeleteEither:
  """Deletes the queued resource NAME if there is one, else the TPU VM NAME."""

  def __init__(self, args, yes):
    self.queued = queued('delete', args, '--force', *(['--quiet'] * yes))
    self.node = gcloud('delete', args, *(['--quiet'] * yes))
    self.describe = queued('describe', args, '--format=value(state.state)')

  def show(self):
    return (f'{shlex.join(self.queued)}  # if `queued-resources describe` finds it, else:\n'
            f'{shlex.join(self.node)}')

  def run(self, runner):
    runner.call(self.node if runner.state(self.describe) == 'MISSING' else self.queued)


class Resume:
  """Once: a preempted (or missing) slice is deleted and created again, then set up; the
  run is started again on it (a READY slice: only the run)."""

  def __init__(self, args):
    self.args = args

  def show(self):
    describe = state_commands(self.args)
    lines = [
        f'{shlex.join(describe[0])}  # {"/".join(GONE)}: every line below; {READY}: '
        'only the last'
    ]
    lines += [f'{shlex.join(c)}  # ACTIVE: then' for c in describe[1:]]
    return '\n'.join(lines + [_show(s) for s in recreate_steps(self.args)])

  def run(self, runner):
    state = slice_state(self.args, runner)
    if state == READY:
      runner.say(f'{self.args.name} is {READY}: starting the run again on it')
      runner.execute(run_commands(self.args, preflight=False))
      return
    if state in PENDING:
      runner.say(f'{self.args.name} is {state}: waiting for it, then setting it up')
      runner.execute(
          wait_steps(self.args) + setup_commands(self.args)
          + run_commands(self.args, preflight=False))
      return
    if state not in GONE:
      raise LaunchError(f'{self.args.name} is {state}, which resume does not handle: start or '
                        'delete it with gcloud compute tpus tpu-vm, then resume')
    runner.say(f'{self.args.name} is {state}: a preempted TPU VM cannot be restarted; '
               'deleting it and creating it again')
    runner.execute(recreate_steps(self.args, exists=state != 'MISSING'))


class Watch:
  """Polls until WORKDIR/final.npz exists, resuming after each preemption (at most N)."""

  def __init__(self, args):
    self.args = args

  def show(self):
    a = self.args
    return '\n'.join([
        f'# watch: every {a.poll:g} s until {final_path(a.workdir)} exists, at most '
        f'{a.max_recoveries} recoveries; each poll:',
        *[f'{shlex.join(c)}' for c in state_commands(a)],
        f'{shlex.join(ssh(a, 0, status_script(a.log)))}  # running, or exit N of the run',
        '# missing at the start: created; preempted/missing later: as `vit-tpu resume`; '
        'READY but the run stopped on SIGTERM (exit 143) without final.npz: only the run '
        'again; stopped by `vit-tpu stop`, or another exit status: stop'
    ])

  def run(self, runner):
    a, recoveries, ended, polls = self.args, 0, None, 0
    final = final_path(a.workdir)

    def recover(why, steps):
      nonlocal recoveries
      if recoveries >= a.max_recoveries:
        raise LaunchError(f'{why}, and {recoveries} recoveries are done (--max_recoveries): '
                          f'giving up; `vit-tpu resume` with the same flags goes on')
      recoveries += 1
      runner.say(f'{why}: recovery {recoveries}/{a.max_recoveries}')
      runner.execute(steps)

    while True:
      if path_exists(final):
        runner.say(f'the run finished: {final} ({recoveries} recoveries)')
        return
      state = slice_state(a, runner)
      if state == 'MISSING' and not polls:  # Nothing to recover yet: create it.
        runner.say(f'{a.name} does not exist: creating it')
        runner.execute(recreate_steps(a, exists=False))
      elif state in GONE:
        ended = None
        recover(f'{a.name} is {state}', recreate_steps(a, exists=state != 'MISSING'))
      polls += 1
      if state in GONE:
        continue
      if state == READY:
        status = runner.run_status(ssh(a, 0, status_script(a.log)))
        if status is None:
          runner.say(f'{a.name}: no answer from worker 0 over ssh; asking again')
        elif status == 'running':
          ended = None
          runner.say(f'{a.name}: running')
        elif status == 'stopped':
          raise LaunchError(f'the run on {a.name} was stopped with vit-tpu stop, so watch does '
                            'not start it again: vit-tpu watch (or resume) with the same flags '
                            'goes on from its last checkpoint')
        elif path_exists(final):
          continue
        elif ended != status:  # Ended: wait a poll, a preemption may be on its way.
          ended = status
          runner.say(f'{a.name}: the run ended ({status}) without {final}')
        elif status.startswith('exit') and status not in _RESUMABLE_EXITS:
          raise LaunchError(f'the run on worker 0 ended with {status} and the VM is {READY}, '
                            f'not a preemption: read vit-tpu logs --name {a.name} --zone '
                            f'{a.zone}; fix it, then vit-tpu resume with the same flags')
        else:
          ended = None
          recover(f'{a.name} is {READY} but the run stopped ({status})',
                  run_commands(a, preflight=False))
          continue
      elif state in PENDING:
        runner.say(f'{a.name}: {state}')
      else:
        raise LaunchError(f'{a.name} is {state}, which watch does not handle: start or delete '
                          'it with gcloud compute tpus tpu-vm, then watch again')
      runner.sleep(a.poll)


# A run's statuses that `watch` starts again: 143, vit-train's on SIGTERM (it saved a step);
# 0 without final.npz (a run of a version before 143, or final.npz not yet visible).
_RESUMABLE_EXITS = ('exit 143', 'exit 0')


def _show(step):
  return shlex.join(step) if isinstance(step, list) else step.show()


def final_path(workdir):
  return workdir.rstrip('/') + '/final.npz'


path_exists = paths.exists  # a module attribute: tests replace it

# ---------------------------------------------------------------- choices


def api(args):
  """'queued' or 'node' (the --api flag, else by generation and Spot); None if unknown."""
  if args.api:
    return args.api
  if args.preemptible:
    return 'node'  # Queued resources have no preemptible kind.
  generation, _ = _parse_type(args.accelerator_type)
  if args.spot or generation in QUEUED_GENERATIONS:
    return 'queued'
  return 'node' if generation else None


def runtime_version(args):
  if args.runtime_version:
    return args.runtime_version
  generation = args.accelerator_type.split('-')[0]
  if generation not in RUNTIME_VERSIONS:
    raise LaunchError(f'no default runtime for {args.accelerator_type}: pass --runtime_version '
                      '(gcloud compute tpus versions list --zone ZONE)')
  return RUNTIME_VERSIONS[generation]


def zone_warning(accelerator_type, zone):
  generation, _ = _parse_type(accelerator_type)
  zones = TPU_ZONES.get(generation)
  if zones and zone not in zones:
    return (f'{accelerator_type} in {zone}: {generation} is offered in {", ".join(zones)} '
            '(a table as of 2026-11; check https://cloud.google.com/tpu/docs/regions-zones)')
  return None


# ---------------------------------------------------------------- the actions' steps


def create_commands(args):
  _require(args, 'create', 'accelerator_type')
  if args.spot and args.preemptible:
    raise LaunchError('--spot and --preemptible exclude each other: keep one')
  if api(args) == 'queued':
    if args.preemptible:
      raise LaunchError('queued resources have no --preemptible: use --spot, or --api=node')
    cmd = queued('create', args, '--node-id', args.name, '--accelerator-type',
                 args.accelerator_type, '--runtime-version', runtime_version(args))
  else:
    cmd = gcloud('create', args, '--accelerator-type', args.accelerator_type, '--version',
                 runtime_version(args))
  extra = ['--spot'] * args.spot + ['--preemptible'] * args.preemptible
  return [cmd + extra + ['--internal-ips'] * args.internal_ips] + wait_steps(args)


def wait_steps(args):
  if api(args) == 'queued':
    return [
        Wait(queued('describe', args, '--format=value(state.state)'), ('ACTIVE',),
             ('FAILED', 'SUSPENDED', 'SUSPENDING', 'MISSING'), f'queued resource {args.name}',
             args.poll)
    ]
  return [
      Wait(gcloud('describe', args, '--format=value(state)'), (READY,),
           ('PREEMPTED', 'TERMINATED', 'STOPPED', 'MISSING'), f'TPU VM {args.name}', args.poll)
  ]


def state_commands(args):
  """The describe commands slice_state runs: the queued resource's first (queued API)."""
  node = gcloud('describe', args, '--format=value(state)')
  if api(args) == 'queued':
    return [queued('describe', args, '--format=value(state.state)'), node]
  return [node]


def slice_state(args, runner):
  """READY, a PENDING state, a GONE state (MISSING: no such resource), or another."""
  commands = state_commands(args)
  if len(commands) == 2:
    state = runner.state(commands[0])
    if state != 'ACTIVE':
      return state
  return runner.state(commands[-1])


def delete_commands(args, yes=None):
  yes = args.yes if yes is None else yes
  which = api(args)
  if which is None:
    return [DeleteEither(args, yes)]
  if which == 'queued':  # --force: its TPU VM too.
    return [queued('delete', args, '--force', *(['--quiet'] * yes))]
  return [gcloud('delete', args, *(['--quiet'] * yes))]


def recreate_steps(args, exists=True):
  return ((delete_commands(args, yes=True) if exists else []) + create_commands(args)
          + setup_commands(args) + run_commands(args, preflight=False))


class Cleanup(list):
  """A command that also runs when a step before it failed (the local tarball goes, whether
  its copy to the VM worked or not)."""


def setup_commands(args):
  commands = []
  if not args.repo_url:  # Ship the working tree, uncommitted changes included.
    if not in_checkout():
      raise LaunchError(f'vit_jax is installed from a wheel ({REPO_ROOT} is no working tree '
                        'to copy): pass --repo_url=https://github.com/OWNER/vit_jax.git '
                        '[--branch B]')
    tarball = tarball_path(args.name)
    commands.append(['mkdir', '-p', os.path.dirname(tarball)])
    commands.append([
        'tar', '-czf', tarball, *(f'--exclude={p}' for p in TAR_EXCLUDES),
        *(f'--exclude=./{p}' for p in TAR_EXCLUDES_AT_ROOT), '-C', REPO_ROOT, '.'
    ])
    commands.append([
        'gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', tarball, f'{args.name}:{CODE_DIR}.tar.gz',
        '--zone', args.zone
    ] + _project(args) + ['--worker=all'] + _internal_ip(args))
    commands.append(Cleanup(['rm', '-f', tarball]))
  commands.append(ssh(args, 'all', setup_script(args)))
  return commands


def check_workdir(args):
  """Errors out for a local workdir on several hosts; returns warnings (strings)."""
  hosts = num_hosts(args.accelerator_type)
  warnings = []
  if not args.workdir.startswith('gs://'):
    # The run starts in ~/vit_jax, which every `setup` deletes and ships again; '~' is not
    # expanded (the command is quoted).
    relative = not os.path.isabs(args.workdir)
    if relative or re.match(rf'/(root|home/[^/]+)/{CODE_DIR}(/|$)', args.workdir):
      where = f'is relative, so on the VM it would be in ~/{CODE_DIR}' if relative else (
          f'is in ~/{CODE_DIR}')
      raise LaunchError(f'--workdir {args.workdir} {where}, which vit-tpu setup deletes with '
                        'the code it replaces: use --workdir=gs://BUCKET/... (kept after delete '
                        f'too), or an absolute path outside ~/{CODE_DIR}')
    if hosts and hosts > 1:
      raise LaunchError(f'{args.accelerator_type} has {hosts} hosts, which must share the '
                        f'workdir: use --workdir=gs://BUCKET/...')
    if args.action in ('watch', 'resume'):
      raise LaunchError(f'{args.action} creates the TPU VM again, which loses a workdir on its '
                        'disk: use --workdir=gs://BUCKET/...')
    where = 'a single host' if hosts == 1 else 'the TPU VM (pass --accelerator_type to check)'
    warnings.append(f'--workdir {args.workdir} is on the disk of {where} and goes away with '
                    '`delete`: gs://BUCKET/... keeps it')
  return warnings


def remote_config(spec, repo_url=None):
  """(the --config value for the workers, warnings): what `spec` names from here, as the
  workers resolve it from the code directory (~/vit_jax, a copy of REPO_ROOT or a clone
  of --repo_url).

  A packaged name (quickstart, finetune:...) stays as it is. A config file is run from the
  copy of the working tree that setup ships: a file inside it becomes its path there
  ('configs/my.py:arg'); one outside it, which would not exist on the TPU VM, is a
  LaunchError now, before anything is created.
  """
  path, sep, arg = spec.partition(':')
  local = os.path.expanduser(path)
  if not os.path.isfile(local):
    return spec, []  # A packaged name, or no file (load_config says so where it checks).
  root = os.path.realpath(REPO_ROOT)
  rel = os.path.relpath(os.path.realpath(local), root)
  parts = rel.split(os.sep)
  fix = ('use a packaged config (quickstart, finetune:MODEL,DATASET, ...) with '
         '--config.FIELD=VALUE overrides')
  if not in_checkout():  # An installed wheel: the workers' tree is a clone of --repo_url.
    if repo_url and not os.path.isabs(path):
      return spec, [
          f'--config {path} is read on the TPU VM from the root of the clone of {repo_url}: '
          'it must be there'
      ]
    raise LaunchError(f'--config {spec!r} is a file of this machine, which the TPU VM does not '
                      f'have: commit it to the repository of --repo_url and pass its path from '
                      f'the root of the repository, or {fix}')
  if parts[0] == os.pardir or os.path.isabs(rel):
    raise LaunchError(f'--config {spec!r} is a file outside {root}, the tree that setup ships '
                      f'to the TPU VM: move it under {root} (e.g. to configs/) and pass that '
                      f'path, or {fix}')
  excluded = [p for p in TAR_EXCLUDES if any(fnmatch.fnmatch(part, p) for part in parts)]
  excluded += [p for p in TAR_EXCLUDES_AT_ROOT if parts[0] == p]
  if excluded and not repo_url:
    raise LaunchError(f'--config {spec!r}: setup leaves {excluded[0]} out of the tree it ships '
                      f'to the TPU VM: move the file elsewhere under {root} (e.g. to configs/), '
                      f'or {fix}')
  warnings = []
  if repo_url:
    warnings.append(f'--config {rel} is read from the clone of {repo_url} on the TPU VM: it '
                    'must be committed and pushed there')
  return rel.replace(os.sep, '/') + sep + arg, warnings


def _remote_config(args):
  """remote_config of args.config, its warnings added to args.warnings (once)."""
  spec, warnings = remote_config(args.config, getattr(args, 'repo_url', None))
  args.warnings += [w for w in warnings if w not in args.warnings]
  return spec


def run_commands(args, preflight=True):
  _require(args, args.action, 'config', 'workdir')
  config = _remote_config(args)
  steps = preflight_steps(args) if preflight else []
  job = (train_argv(config, args.workdir, args.overrides), args.log)
  return steps + [ssh(args, 'all', start_script([job]))]


def logs_commands(args):
  log = shlex.quote(f'{LOG_DIR}/{args.log}.log')
  tail = f'tail -n {args.lines}{" -F" if args.follow else ""} {log}'
  if args.worker == 'all':  # Tell the workers apart.
    tail += ' | sed -u "s/^/$(hostname): /"'
  return [ssh(args, args.worker, tail)]


def stop_commands(args):
  """SIGTERM to the run's process group on every worker, then wait for it to save and exit.

  The run pid file stays while the run is still going, so a start in the meantime is refused;
  STOPPED_FILE tells `watch` not to start the run again.
  """
  pid, stopped = f'"$HOME"/{PID_FILE}', f'"$HOME"/{STOPPED_FILE}'
  script = '; '.join([
      f'mkdir -p "$HOME"/{LOG_DIR}', f'date > {stopped}',
      f'if [ -f {pid} ] && kill -0 -- -"$(cat {pid})" 2>/dev/null; then g="$(cat {pid})"; '
      f'kill -- -"$g"; i=0; while kill -0 -- -"$g" 2>/dev/null && [ $i -lt {STOP_WAIT_S} ]; '
      'do sleep 1; i=$((i+1)); done; '
      'if kill -0 -- -"$g" 2>/dev/null; then echo "$(hostname): the run has not exited '
      f'{STOP_WAIT_S} s after SIGTERM: vit-tpu logs says what it is doing; vit-tpu stop again '
      f'waits once more" >&2; exit 1; fi; echo "$(hostname): stopped"; '
      'else echo "$(hostname): not running"; fi', f'rm -f {pid}'
  ])
  return [ssh(args, 'all', script)]


# ---------------------------------------------------------------- preflight


def _one_line(error):
  lines = [l.strip() for l in str(error).strip().splitlines() if l.strip()]
  return lines[0] if lines else type(error).__name__


def load_config(spec, overrides=()):
  """The config of --config with the --config.x=value overrides applied (as vit-train)."""
  from vit_jax import configs  # pylint: disable=g-import-not-at-top
  try:
    return configs.load(spec, overrides)
  except configs.ConfigNotFoundError as e:
    raise LaunchError(str(e)) from None
  except Exception as e:  # pylint: disable=broad-except  (the config's own message)
    raise LaunchError(f'--config {spec!r}: {_one_line(e)}') from None


def validate_for_slice(config, accelerator_type):
  """vit_jax's start-up checks (config_checks) for the slice's devices and hosts; for an
  unknown accelerator type the device checks are left out."""
  from vit_jax import config_checks  # pylint: disable=g-import-not-at-top  (imports JAX)
  devices, hosts = num_devices(accelerator_type), num_hosts(accelerator_type)
  try:
    if devices:
      where = f'{accelerator_type}: {devices} devices on {hosts} host{"s" * (hosts > 1)}'
      config_checks.validate_config(config, devices=devices, hosts=hosts)
    else:
      where = 'devices not checked'
      config_checks.validate_before_devices(config)
  except ValueError as e:
    raise LaunchError(f'preflight ({where}): {_one_line(e)}') from None


def check_tfds(name, data_dir):
  """One line if `name` is prepared in data_dir; LaunchError naming the vit-tfds-build if not."""
  # pylint: disable=g-import-not-at-top  (TensorFlow: slow)
  from vit_jax import tensorflow_quietly  # noqa: F401  (first: its notices on import dropped)
  from vit_jax import data_sources
  # pylint: enable=g-import-not-at-top
  try:
    builder = data_sources.tfds_builder(name, data_dir)
    prepared = data_sources.has_prepared_files(builder)
  except data_sources.DataDirUnreadable as e:  # its line names what to check
    raise LaunchError(str(e)) from None
  except Exception as e:  # pylint: disable=broad-except
    if type(e).__name__ == 'DatasetNotFoundError':
      raise LaunchError(f'config.dataset {name!r} is not a TFDS dataset: check the name '
                        '(tfds.list_builders())') from None
    raise LaunchError(f'cannot read {data_dir}: {_one_line(e)}: check that the bucket exists '
                      'and your credentials (gcloud auth application-default login)') from None
  if not prepared:
    raise LaunchError(f'TFDS dataset {name} is not prepared in {data_dir}: run '
                      f'`{tfds_build.PROGRAM} {name} --data_dir={data_dir}` once, then this again')
  return f'TFDS {name} {builder.info.version} is prepared in {data_dir}'


def check_writable(workdir):
  """Writes and deletes a small object under the workdir; LaunchError if that fails."""
  # pylint: disable=g-import-not-at-top  (slow)
  from vit_jax import tensorflow_quietly  # noqa: F401  (first: its notices on import dropped)
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  probe = f'{workdir.rstrip("/")}/.vit-tpu-probe-{os.getpid()}'
  try:
    tf.io.gfile.makedirs(workdir)
    with tf.io.gfile.GFile(probe, 'w') as f:
      f.write('vit-tpu preflight\n')
    tf.io.gfile.remove(probe)
  except Exception as e:  # pylint: disable=broad-except
    raise LaunchError(f'cannot write to --workdir {workdir}: {_one_line(e)}: check that the '
                      'bucket exists and that you and the TPU VM service account may write '
                      'to it') from None
  return f'--workdir {workdir} is writable'


def preflight_steps(args):
  """Checks everything it can before anything is created.

  Raises LaunchError now for what is wrong in the flags or the config (the config is loaded
  and validated for the slice's device count); appends warnings to args.warnings; returns
  the Check steps that need the network (data prepared, workdir writable).
  """
  _require(args, args.action, 'config', 'workdir')
  _remote_config(args)  # A config file the TPU VM will not have.
  args.warnings += check_workdir(args)
  if args.skip_preflight:
    return []
  config = load_config(args.config, args.overrides)
  if not args.accelerator_type:
    args.warnings.append('no --accelerator_type: the batch sizes are not checked against the '
                         "slice's devices")
  validate_for_slice(config, args.accelerator_type)

  datasets = [(config.dataset, config.data_dir, 'data_dir')]
  if config.fewshot_every_steps:
    datasets += [(entry[0], config.fewshot_data_dir
                  or config.data_dir, 'fewshot_data_dir' if config.fewshot_data_dir else 'data_dir')
                 for entry in config.fewshot_datasets]
  checks = []
  for name, data_dir, field in dict.fromkeys(datasets):
    if name == 'fashion_mnist_local' or name.startswith('folder:'):
      path = name[len('folder:'):] if name.startswith('folder:') else (
          data_dir or '/usr/share/datasets/fashion-mnist')
      if not path.startswith('gs://'):
        args.warnings.append(f'dataset {name} is read from {path} on the TPU VM: it must be '
                             'there on every host')
      continue
    if not data_dir:
      raise LaunchError(
          f'config.dataset {name!r} comes from TFDS and config.{field} is empty, '
          'which on a TPU VM is an empty ~/tensorflow_datasets: pass '
          f'--config.{field}=gs://BUCKET/tensorflow_datasets (prepared with '
          f'`{tfds_build.PROGRAM} {name} --data_dir=gs://BUCKET/tensorflow_datasets`)')
    if data_dir.startswith('gs://'):
      checks.append(
          Check(f'TFDS {name} is prepared in {data_dir}',
                functools.partial(check_tfds, name, data_dir)))
    else:
      args.warnings.append(f'--config.{field}={data_dir} is not checked from here: it must hold '
                           f'a prepared {name} on every host; gs:// is simpler')
  if args.workdir.startswith('gs://'):
    checks.append(
        Check(f'--workdir {args.workdir} is writable (a probe object is written and '
              'deleted)', functools.partial(check_writable, args.workdir)))
  return checks


# ---------------------------------------------------------------- the command line


def build_commands(action, args):
  """The steps of an action: argv lists, and Wait/Check/... objects (dry run: .show())."""
  _require(args, action, 'name', 'zone')
  check_name(args.name)
  if action in ('create', 'all', 'preflight', 'resume', 'watch'):
    _require(args, action, 'accelerator_type')
  if args.accelerator_type:
    warning = zone_warning(args.accelerator_type, args.zone)
    if warning:
      args.warnings.append(warning)
  if action == 'preflight':
    return preflight_steps(args)
  if action in ('all', 'resume', 'watch'):
    steps = run_commands(args)[:-1]  # The preflight: nothing is created for a bad run.
    create_commands(args)  # Its argument errors, before anything runs.
    if action == 'all':
      return steps + create_commands(args) + setup_commands(args) + run_commands(
          args, preflight=False)
    return steps + [Resume(args) if action == 'resume' else Watch(args)]
  return {
      'create': create_commands,
      'setup': setup_commands,
      'run': run_commands,
      'logs': logs_commands,
      'stop': stop_commands,
      'delete': delete_commands
  }[action](args)


def _require(args, action, *fields):
  for field in fields:
    if not getattr(args, field):
      raise LaunchError(f'{action} needs --{field}')


class _Parser(argparse.ArgumentParser):

  def error(self, message):
    if message.endswith('required: action'):  # argparse's words name no action
      raise LaunchError(f'no action given: vit-tpu ACTION ..., ACTION one of {", ".join(ACTIONS)} '
                        '(vit-tpu --help)')
    raise LaunchError(message)


def parser():
  p = _Parser(prog='vit-tpu', description=__doc__.split('\n')[0])
  p.register('action', None, cli_help.StoreOnce)  # a flag given twice is refused
  p.add_argument('action', help=' | '.join(ACTIONS))
  p.add_argument('--name', help='TPU VM name (and queued resource name)')
  p.add_argument('--zone', help='e.g. europe-west4-a, us-central2-b')
  p.add_argument('--project', help='Google Cloud project (default: gcloud config)')
  p.add_argument('--accelerator_type', '--accelerator-type',
                 help='v3-8, v4-32, v5litepod-8 (v5e-8), v5p-8, v6e-8, ...')
  p.add_argument('--runtime_version', '--runtime-version', '--version',
                 help='TPU VM image (default per generation, e.g. tpu-ubuntu2204-base)')
  p.add_argument(
      '--api', choices=('queued', 'node'), help='create through a queued resource '
      '(default for v5e, v5p, v6e and Spot) or tpu-vm create (node)')
  p.add_argument('--spot', action='store_true', help='create a Spot TPU VM')
  p.add_argument('--preemptible', action='store_true', help='create a preemptible TPU VM')
  p.add_argument('--internal_ips', '--internal-ips', action='store_true',
                 help='no external IPs: create with --internal-ips, ssh/scp with --internal-ip')
  p.add_argument('--repo_url', '--repo-url', help='git clone this URL instead of copying '
                 'the local working tree')
  p.add_argument('--branch', help='branch or tag for --repo_url')
  p.add_argument(
      '--python', default=None, help='Python for the venv on the VM (default: '
      "setup.py's python_requires, e.g. python3.11)")
  p.add_argument('--config', help='as for vit-train, e.g. finetune:ViT-B_16,cifar10')
  p.add_argument('--workdir', help='gs://BUCKET/DIR (required on several hosts)')
  p.add_argument('--worker', default=None, help='logs: 0 (default), another index, or all')
  p.add_argument('--log', default='train', help='log name under ~/vit_jax_logs/ (run, logs)')
  p.add_argument('--follow', '-f', action='store_true', help='logs: keep streaming')
  p.add_argument('--lines', type=int, default=100, help='logs: lines to show')
  p.add_argument('--yes', '-y', action='store_true', help='delete without asking')
  p.add_argument('--poll', type=float, default=60.0,
                 help='seconds between state polls (create, resume, watch)')
  p.add_argument('--max_recoveries', '--max-recoveries', type=int, default=20,
                 help='watch: give up after this many re-creations / restarts')
  p.add_argument('--skip_preflight', '--skip-preflight', action='store_true',
                 help='run, all, resume, watch: leave out the config/data/workdir checks')
  p.add_argument('--dry-run', '--dry_run', dest='dry_run', action='store_true',
                 help='print the commands, run nothing')
  return p


def parse_args(argv):
  """Namespace with .overrides: the --config.x=value arguments, passed on to vit_jax.main."""
  args, rest = parser().parse_known_args(argv)
  if args.action not in ACTIONS:  # Before the other flags are checked: it is the first word.
    raise LaunchError(f'unknown action {args.action!r}: use one of {", ".join(ACTIONS)}')
  if not re.fullmatch(f'[{LOG_NAME_CHARS}]+', args.log) or args.log.startswith('.'):
    raise LaunchError(f'--log {args.log!r} is not a log name: use letters, digits, _ and '
                      f'{" ".join(LOG_NAME_CHARS[2:])} (the log is ~/{LOG_DIR}/<name>.log on each '
                      'worker)')
  if len(args.log.encode()) > LOG_NAME_BYTES:
    raise LaunchError(f'--log is {len(args.log.encode())} bytes long: use a name of at most '
                      f'{LOG_NAME_BYTES} (the log is ~/{LOG_DIR}/<name>.log on each worker)')
  for arg in rest:
    if not re.fullmatch(r'--config\.[\w.]+=.*', arg, re.S):
      raise LaunchError(f'unknown argument {arg!r}: config overrides look like '
                        '--config.base_lr=0.01')
  args.overrides = rest
  args.warnings = []
  if args.accelerator_type:
    args.accelerator_type, warnings = accelerator_type_flag(args.accelerator_type)
    args.warnings += warnings
  if args.zone:
    args.zone = zone_flag(args.zone)
  args.worker = args.worker or ('0' if args.action == 'logs' else 'all')
  if args.worker != 'all' and not args.worker.isdigit():
    raise LaunchError(f'--worker {args.worker!r}: use a worker index (0, 1, ...) or all')
  hosts = num_hosts(args.accelerator_type)
  if args.worker != 'all' and hosts and int(args.worker) >= hosts:
    which = 'worker 0' if hosts == 1 else f'workers 0-{hosts - 1}'
    raise LaunchError(f'--worker {args.worker}: {args.accelerator_type} has {hosts} '
                      f'host{"s" * (hosts > 1)}, {which}: use one of them, or all')
  if args.lines < 0:
    raise LaunchError('--lines must be >= 0')
  if not args.poll > 0 or args.max_recoveries < 0:
    raise LaunchError('--poll must be > 0 and --max_recoveries >= 0')
  return args


class Runner:
  """Runs commands (echoing them), reads states, sleeps: what the steps need."""

  def __init__(self, call=subprocess.call, out=None, sleep=time.sleep):
    self._call, self.out, self.sleep = call, out or sys.stdout, sleep

  def say(self, line):
    print(f'vit-tpu: {line}', file=self.out, flush=True)

  def call(self, cmd):
    print(f'+ {shlex.join(cmd)[:300]}', file=self.out, flush=True)
    try:
      rc = self._call(cmd)
    except FileNotFoundError:
      raise _not_found(cmd) from None
    if rc:
      raise LaunchError(f'`{" ".join(cmd[:6])} ...` failed (exit {rc}): see its output above, '
                        f'{_failure_fix(cmd)}')

  def query(self, cmd):
    """(exit code, stdout, stderr) of a command whose output is read, not shown."""
    try:
      p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
      raise _not_found(cmd) from None
    return p.returncode, p.stdout, p.stderr

  def state(self, cmd):
    """The state a describe command prints; MISSING when the resource does not exist."""
    rc, out, err = self.query(cmd)
    if rc:
      if re.search(r'NOT_FOUND|not found', err, re.I):
        return 'MISSING'
      raise LaunchError(f'`{" ".join(cmd[:6])} ...` failed (exit {rc}): '
                        f'{_one_line(err) if err.strip() else "no message"}')
    return (out.strip().splitlines() or ['UNKNOWN'])[-1].strip()

  def run_status(self, cmd):
    """`running`, `stopped`, `exit N` or `none` from status_script over ssh; None if ssh
    failed."""
    rc, out, _ = self.query(cmd)
    found = re.findall(r'^(running|stopped|none|exit -?\d+)$', out, re.M)
    return found[-1] if rc == 0 and found else None

  def execute(self, steps):
    for i, step in enumerate(steps):
      try:
        if isinstance(step, list):
          self.call(step)
        else:
          step.run(self)
      except BaseException:
        for cleanup in [s for s in steps[i + 1:] if isinstance(s, Cleanup)]:
          try:
            self.call(cleanup)
          except LaunchError:
            pass  # the first failure is the one to report
        raise


def _failure_fix(cmd):
  """The advice of a failed command's error line: for a delete, how to see what is left."""
  if cmd[:3] != ['gcloud', 'compute', 'tpus'] or cmd[4:5] != ['delete'] or '--zone' not in cmd:
    return 'fix it and run the action again'
  i = cmd.index('--zone')
  where = cmd[i:i + 2]
  if '--project' in cmd:
    where += cmd[cmd.index('--project'):][:2]
  lists = ' and '.join(f'`{shlex.join(["gcloud", "compute", "tpus", kind, "list", *where])}`'
                       for kind in ('tpu-vm', 'queued-resources'))
  what = 'TPU VM' if cmd[3] == 'tpu-vm' else 'queued resource'
  return (f'fix it and delete again; if it says NOT_FOUND, there is no {what} {cmd[5]} in zone '
          f'{cmd[i + 1]}: {lists} show what is left to delete (and to pay for)')


def _not_found(cmd):
  if cmd[0] != 'gcloud':
    return LaunchError(f'{cmd[0]} not found: install it, or put it on PATH')
  return LaunchError('gcloud not found: install the Google Cloud CLI '
                     '(https://cloud.google.com/sdk/docs/install) and run gcloud auth login')


def execute(commands, dry_run=False, call=subprocess.call, out=None):
  """Prints (dry run) or runs the steps in order; stops at the first failure."""
  out = out or sys.stdout
  if dry_run:
    for step in commands:
      print(_show(step), file=out)
    return
  if call is subprocess.call:  # a missing program is named before any step runs
    for program in dict.fromkeys(step[0] for step in commands if isinstance(step, list)):
      if not shutil.which(program):
        raise _not_found([program])
  Runner(call=call, out=out).execute(commands)


def main(argv=None):
  """The vit-tpu console script; returns 0, or exits with a one-line error."""
  try:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    commands = build_commands(args.action, args)
    for warning in args.warnings:
      print(f'vit-tpu: warning: {warning}', file=sys.stderr)
    execute(commands, args.dry_run)
  except LaunchError as e:
    sys.exit(f'vit-tpu: error: {e}')
  except KeyboardInterrupt:
    ctrl_c.stop_with('vit-tpu: interrupted (Ctrl-C): what was created stays (vit-tpu delete ... '
                     'removes it)')
  return 0


if __name__ == '__main__':
  console_scripts.run_as_main(main, 'vit-tpu')
