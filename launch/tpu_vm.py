r"""Cloud TPU VMs: create, set up, run vit_jax on every worker, read logs, delete.

  python -m launch.tpu_vm create --name vit --zone europe-west4-a --accelerator_type v3-8
  python -m launch.tpu_vm setup  --name vit --zone europe-west4-a
  python -m launch.tpu_vm run    --name vit --zone europe-west4-a --accelerator_type v3-8 \
      --config=configs/finetune.py:ViT-B_16,cifar10 --workdir=gs://BUCKET/vit/cifar10 \
      --config.data_dir=gs://BUCKET/tfds
  python -m launch.tpu_vm logs   --name vit --zone europe-west4-a [--worker all] [--follow]
  python -m launch.tpu_vm stop   --name vit --zone europe-west4-a
  python -m launch.tpu_vm delete --name vit --zone europe-west4-a
  python -m launch.tpu_vm all    ...  (create, setup, run)

--dry-run prints the commands (one per line, shell-quoted) and runs nothing.
On every worker, in the home directory: the code in vit_jax/, a Python >= 3.11 venv in
vit_jax_venv/ (jax 0.10 needs 3.11; the TPU images ship 3.10), logs in vit_jax_logs/.
A run starts the same command on all workers in the background (setsid nohup), so the ssh
returns; jax.distributed.initialize() finds the other workers on a TPU VM slice.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile

ACTIONS = ('create', 'setup', 'run', 'logs', 'stop', 'delete', 'all')
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBTPU_URL = 'https://storage.googleapis.com/jax-releases/libtpu_releases.html'
# On each worker, relative to the home directory.
CODE_DIR, VENV_DIR, LOG_DIR = 'vit_jax', 'vit_jax_venv', 'vit_jax_logs'
PID_FILE = f'{LOG_DIR}/run.pid'
# Left out of the tarball of the working tree.
TAR_EXCLUDES = ('.git', '.venv', 'workdirs', '__pycache__', '*.egg-info', '.pytest_cache',
                '*.npz')  # Checkpoints: read them from gs:// instead.
# Runtime images per TPU generation (gcloud compute tpus versions list --zone Z).
RUNTIME_VERSIONS = {'v2': 'tpu-ubuntu2204-base', 'v3': 'tpu-ubuntu2204-base',
                    'v4': 'tpu-ubuntu2204-base', 'v5litepod': 'v2-alpha-tpuv5-lite',
                    'v5p': 'v2-alpha-tpuv5', 'v6e': 'v2-alpha-tpuv6e'}


class LaunchError(Exception):
  """A bad argument or a failed command; main prints it as one line."""


def num_hosts(accelerator_type):
  """Workers (hosts) of a slice: v3-8 -> 1, v3-32 -> 4, v4-32 -> 4; None if unknown."""
  m = re.fullmatch(r'(v\d+[a-z]*)-(\d+)', accelerator_type or '')
  if not m:
    return None
  generation, n = m.group(1), int(m.group(2))
  if generation in ('v5litepod', 'v5e', 'v6e'):  # Counted in chips: 8 on one host, else 4 per host.
    return 1 if n <= 8 else n // 4
  return max(1, n // 8)  # Counted in TensorCores: 8 per host.


def jax_version(constraints=os.path.join(REPO_ROOT, 'constraints.txt')):
  """The jax pin of constraints.txt (the tested stack), so that jax[tpu] matches the rest."""
  with open(constraints) as f:
    m = re.search(r'^jax==(\S+)$', f.read(), re.MULTILINE)
  if not m:
    raise LaunchError(f'no "jax==X" pin in {constraints}: add it, or pin jax[tpu] by hand')
  return m.group(1)


def tarball_path(name):
  return os.path.join(tempfile.gettempdir(), f'vit_jax-{name}.tar.gz')


def gcloud(verb, args, *rest):
  """gcloud compute tpus tpu-vm VERB NAME --zone Z [--project P] REST..."""
  cmd = ['gcloud', 'compute', 'tpus', 'tpu-vm', verb, args.name, '--zone', args.zone]
  if args.project:
    cmd += ['--project', args.project]
  return cmd + list(rest)


def ssh(args, worker, command):
  return gcloud('ssh', args, f'--worker={worker}', '--command', command)


def train_argv(config, workdir, overrides=()):
  """The command every worker runs (from the code directory, in the venv)."""
  return ['python3', '-m', 'vit_jax.main', f'--config={config}', f'--workdir={workdir}',
          *overrides]


def start_script(jobs):
  """Remote shell: runs the (argv, log name) jobs one after another in the background.

  Each job writes ~/vit_jax_logs/<log>.log; a failing job does not stop the next. The
  process group id goes to ~/vit_jax_logs/run.pid (for `stop`); a second start while one
  is running is refused.
  """
  body = '; '.join(f'{shlex.join(argv)} > "$HOME"/{LOG_DIR}/{shlex.quote(log + ".log")} 2>&1'
                   for argv, log in jobs)
  pid = f'"$HOME"/{PID_FILE}'
  return '; '.join([
      'set -e', f'cd "$HOME"/{CODE_DIR}', f'. "$HOME"/{VENV_DIR}/bin/activate',
      f'mkdir -p "$HOME"/{LOG_DIR}',
      f'if [ -f {pid} ] && kill -0 -- -"$(cat {pid})" 2>/dev/null; then echo "$(hostname): a '
      'run is still going: python -m launch.tpu_vm stop ... first" >&2; exit 1; fi',
      f'setsid nohup sh -c {shlex.quote(body)} > /dev/null 2>&1 < /dev/null & echo $! > {pid}',
      'echo "$(hostname): started, logs in ~/' + LOG_DIR + '/: ' +
      ' '.join(f'{log}.log' for _, log in jobs) + '"'])


def setup_script(args):
  """Remote shell: fresh code in ~/vit_jax, then the package and jax[tpu] into the venv."""
  if args.repo_url:
    branch = ['--branch', args.branch] if args.branch else []
    fetch = f'rm -rf {CODE_DIR}; ' + shlex.join(
        ['git', 'clone', '--depth', '1', *branch, args.repo_url, CODE_DIR])
  else:
    fetch = (f'rm -rf {CODE_DIR}; mkdir {CODE_DIR}; tar -xzf {CODE_DIR}.tar.gz -C {CODE_DIR}; '
             f'rm {CODE_DIR}.tar.gz')
  py = shlex.quote(args.python)
  apt = 'sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -qq'
  pip = f'{VENV_DIR}/bin/python -m pip install -q'
  return '; '.join([
      'set -e', fetch,
      # The TPU images have Python 3.10; jax 0.10 needs >= 3.11 (with its venv module).
      f'if ! {py} -c "import ensurepip" 2>/dev/null; then {apt} update; '
      f'{apt} install -y {py} {py}-venv; fi',
      f'{py} -m venv {VENV_DIR}',
      f'{pip} --upgrade pip',
      f'{pip} -e ./{CODE_DIR} ' + shlex.quote(f'jax[tpu]=={jax_version()}') + f' -f {LIBTPU_URL}',
      f'echo "$(hostname): ready, $({VENV_DIR}/bin/python -c "import jax; print(\'jax\', '
      f'jax.__version__)")"'])


def create_commands(args):
  _require(args, 'create', 'accelerator_type')
  if args.spot and args.preemptible:
    raise LaunchError('--spot and --preemptible exclude each other: keep one')
  cmd = gcloud('create', args, '--accelerator-type', args.accelerator_type,
               '--version', runtime_version(args))
  return [cmd + ['--spot'] * args.spot + ['--preemptible'] * args.preemptible]


def runtime_version(args):
  if args.runtime_version:
    return args.runtime_version
  generation = args.accelerator_type.split('-')[0]
  if generation not in RUNTIME_VERSIONS:
    raise LaunchError(f'no default runtime for {args.accelerator_type}: pass --runtime_version '
                      '(gcloud compute tpus versions list --zone ZONE)')
  return RUNTIME_VERSIONS[generation]


def setup_commands(args):
  commands = []
  if not args.repo_url:  # Ship the working tree, uncommitted changes included.
    tarball = tarball_path(args.name)
    commands.append(['tar', '-czf', tarball, *(f'--exclude={p}' for p in TAR_EXCLUDES),
                     '-C', REPO_ROOT, '.'])
    commands.append(['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', tarball,
                     f'{args.name}:{CODE_DIR}.tar.gz', '--zone', args.zone]
                    + (['--project', args.project] if args.project else []) + ['--worker=all'])
  commands.append(ssh(args, 'all', setup_script(args)))
  return commands


def check_workdir(args):
  """Errors out for a local workdir on several hosts; returns warnings (strings)."""
  hosts = num_hosts(args.accelerator_type)
  warnings = []
  if not args.workdir.startswith('gs://'):
    if hosts and hosts > 1:
      raise LaunchError(f'{args.accelerator_type} has {hosts} hosts, which must share the '
                        f'workdir: use --workdir=gs://BUCKET/...')
    where = 'a single host' if hosts == 1 else 'the TPU VM (pass --accelerator_type to check)'
    warnings.append(f'--workdir {args.workdir} is on the disk of {where} and goes away with '
                    '`delete`: gs://BUCKET/... keeps it')
  data_dir = [o.split('=', 1)[1] for o in args.overrides if o.startswith('--config.data_dir=')]
  if data_dir and data_dir[-1] and not data_dir[-1].startswith('gs://') and (hosts or 0) > 1:
    warnings.append(f'--config.data_dir={data_dir[-1]} must exist on every host: gs:// is simpler')
  return warnings


def run_commands(args):
  _require(args, 'run', 'config', 'workdir')
  args.warnings = check_workdir(args)
  job = (train_argv(args.config, args.workdir, args.overrides), args.log)
  return [ssh(args, 'all', start_script([job]))]


def logs_commands(args):
  log = shlex.quote(f'{LOG_DIR}/{args.log}.log')
  tail = f'tail -n {args.lines}{" -F" if args.follow else ""} {log}'
  if args.worker == 'all':  # Tell the workers apart.
    tail += ' | sed -u "s/^/$(hostname): /"'
  return [ssh(args, args.worker, tail)]


def stop_commands(args):
  script = (f'if [ -f {PID_FILE} ]; then kill -- -"$(cat {PID_FILE})" 2>/dev/null && '
            f'echo "$(hostname): stopped" || echo "$(hostname): not running"; rm -f {PID_FILE}; '
            'else echo "$(hostname): not running"; fi')
  return [ssh(args, 'all', script)]


def delete_commands(args):
  return [gcloud('delete', args, *(['--quiet'] if args.yes else []))]


def build_commands(action, args):
  """The commands of an action, each an argv list; `all` is create + setup + run."""
  if action not in ACTIONS:
    raise LaunchError(f'unknown action {action!r}: use one of {", ".join(ACTIONS)}')
  _require(args, action, 'name', 'zone')
  if not re.fullmatch(r'[a-z]([-a-z0-9]{0,61}[a-z0-9])?', args.name):
    raise LaunchError(f'--name {args.name!r}: use lowercase letters, digits and hyphens, '
                      'starting with a letter')
  if action == 'all':
    run = run_commands(args)  # Checked first: nothing is created for a run that cannot start.
    return create_commands(args) + setup_commands(args) + run
  return {'create': create_commands, 'setup': setup_commands, 'run': run_commands,
          'logs': logs_commands, 'stop': stop_commands, 'delete': delete_commands}[action](args)


def _require(args, action, *fields):
  for field in fields:
    if not getattr(args, field):
      raise LaunchError(f'{action} needs --{field}')


class _Parser(argparse.ArgumentParser):

  def error(self, message):
    raise LaunchError(message)


def parser():
  p = _Parser(prog='python -m launch.tpu_vm', description=__doc__.split('\n')[0])
  p.add_argument('action', help=' | '.join(ACTIONS))
  p.add_argument('--name', help='TPU VM name')
  p.add_argument('--zone', help='e.g. europe-west4-a, us-central2-b')
  p.add_argument('--project', help='Google Cloud project (default: gcloud config)')
  p.add_argument('--accelerator_type', '--accelerator-type', help='v3-8, v3-256, v4-32, ...')
  p.add_argument('--runtime_version', '--runtime-version', '--version',
                 help='TPU VM image (default per generation, e.g. tpu-ubuntu2204-base)')
  p.add_argument('--spot', action='store_true', help='create a Spot TPU VM')
  p.add_argument('--preemptible', action='store_true', help='create a preemptible TPU VM')
  p.add_argument('--repo_url', '--repo-url', help='git clone this URL instead of copying '
                 'the local working tree')
  p.add_argument('--branch', help='branch or tag for --repo_url')
  p.add_argument('--python', default='python3.11', help='Python >= 3.11 for the venv on the VM')
  p.add_argument('--config', help='as for vit_jax.main, e.g. configs/finetune.py:ViT-B_16,cifar10')
  p.add_argument('--workdir', help='gs://BUCKET/DIR (required on several hosts)')
  p.add_argument('--worker', default=None, help='logs: 0 (default), another index, or all')
  p.add_argument('--log', default='train', help='log name under ~/vit_jax_logs/ (run, logs)')
  p.add_argument('--follow', '-f', action='store_true', help='logs: keep streaming')
  p.add_argument('--lines', type=int, default=100, help='logs: lines to show')
  p.add_argument('--yes', '-y', action='store_true', help='delete without asking')
  p.add_argument('--dry-run', '--dry_run', dest='dry_run', action='store_true',
                 help='print the commands, run nothing')
  return p


def parse_args(argv):
  """Namespace with .overrides: the --config.x=value arguments, passed on to vit_jax.main."""
  args, rest = parser().parse_known_args(argv)
  for arg in rest:
    if not re.fullmatch(r'--config\.[\w.]+=.*', arg, re.S):
      raise LaunchError(f'unknown argument {arg!r}: config overrides look like '
                        '--config.base_lr=0.01')
  args.overrides = rest
  args.worker = args.worker or ('0' if args.action == 'logs' else 'all')
  if args.worker != 'all' and not args.worker.isdigit():
    raise LaunchError(f'--worker {args.worker!r}: use a worker index (0, 1, ...) or all')
  if args.lines < 0:
    raise LaunchError('--lines must be >= 0')
  return args


def execute(commands, dry_run=False, call=subprocess.call, out=None):
  """Prints (dry run) or runs the commands in order; stops at the first failure."""
  out = out or sys.stdout
  for cmd in commands:
    if dry_run:
      print(shlex.join(cmd), file=out)
      continue
    print(f'+ {shlex.join(cmd)[:300]}', file=out, flush=True)
    try:
      rc = call(cmd)
    except FileNotFoundError:
      raise LaunchError(f'{cmd[0]} not found: install the Google Cloud CLI '
                        '(https://cloud.google.com/sdk/docs/install) and run gcloud auth login'
                        ) from None
    if rc:
      raise LaunchError(f'`{" ".join(cmd[:6])} ...` failed (exit {rc}): see its output above, '
                        'fix it and run the action again')


def main(argv=None):
  try:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    commands = build_commands(args.action, args)
    for warning in getattr(args, 'warnings', []):
      print(f'tpu_vm: warning: {warning}', file=sys.stderr)
    execute(commands, args.dry_run)
  except LaunchError as e:
    sys.exit(f'tpu_vm: error: {e}')


if __name__ == '__main__':
  main()
