"""`make quickstart` installs jemalloc where it can (the Makefile's `jemalloc` target): run
through make as a user's shell runs it, with `id`, `dpkg` and `apt-get` replaced by scripts
that play root or not, installed or not, and an apt-get that works, needs an update first,
or fails. Whatever happens, the target exits 0: jemalloc is optional."""
import os
import re
import subprocess

import pytest

from tests.conftest import ROOT

SHIMS = {
    'id': 'echo "$FAKE_UID"',
    'dpkg': 'exit "$FAKE_DPKG_RC"',  # dpkg -s: 0 installed, 1 not
    # Logs each call; `install` works when FAKE_APT=ok, or after an update when =stale.
    'apt-get': '''echo "$*" >> "$APT_LOG"
case "$FAKE_APT:$1" in
  ok:install) exit 0 ;;
  stale:update) touch "$APT_LOG.updated"; exit 0 ;;
  stale:install) [ -f "$APT_LOG.updated" ] ;;
  *) exit 100 ;;
esac''',
}


def make_jemalloc(tmp_path, uid, installed, apt):
  """(exit status, stdout, the apt-get calls) of `make jemalloc` under the fakes."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  for name, body in SHIMS.items():
    (bin_dir / name).write_text(f'#!/bin/sh\n{body}\n')
    (bin_dir / name).chmod(0o755)
  log = tmp_path / 'apt.log'
  env = dict(os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}', FAKE_UID=str(uid),
             FAKE_DPKG_RC='0' if installed else '1', FAKE_APT=apt, APT_LOG=str(log))
  out = subprocess.run(
      ['make', '-s', '-f', os.path.join(ROOT, 'Makefile'), 'jemalloc'], cwd=tmp_path, env=env,
      capture_output=True, text=True, timeout=60)
  calls = log.read_text().splitlines() if log.exists() else []
  return out.returncode, out.stdout.strip(), calls


def test_root_installs_it_without_an_update_when_the_lists_are_fresh(tmp_path):
  rc, out, calls = make_jemalloc(tmp_path, uid=0, installed=False, apt='ok')
  assert rc == 0
  assert calls == ['install -y -qq libjemalloc2']
  assert out == 'installed libjemalloc2: vit-train runs on jemalloc'


def test_stale_package_lists_are_updated_once_then_it_installs(tmp_path):
  rc, out, calls = make_jemalloc(tmp_path, uid=0, installed=False, apt='stale')
  assert rc == 0
  assert calls == ['install -y -qq libjemalloc2', 'update -qq', 'install -y -qq libjemalloc2']
  assert out.startswith('installed libjemalloc2')


def test_a_failing_apt_get_is_reported_and_the_quickstart_goes_on(tmp_path):
  rc, out, calls = make_jemalloc(tmp_path, uid=0, installed=False, apt='broken')
  assert rc == 0
  assert 'update -qq' in calls
  assert out == ("libjemalloc2 could not be installed (apt-get failed): vit-train runs on the "
                 "C library's malloc")


@pytest.mark.parametrize('uid, installed, expected', [
    (1000, False, 'tip: sudo apt-get install libjemalloc2'),
    (0, True, ''),
    (1000, True, ''),
])
def test_without_root_or_once_installed_apt_get_is_not_run(tmp_path, uid, installed, expected):
  rc, out, calls = make_jemalloc(tmp_path, uid=uid, installed=installed, apt='ok')
  assert rc == 0
  assert calls == []
  assert out.startswith(expected) and bool(out) == bool(expected)


def test_the_quickstart_depends_on_it():
  with open(os.path.join(ROOT, 'Makefile')) as f:
    prerequisites = re.search(r'^quickstart:(.*)$', f.read(), re.MULTILINE).group(1).split()
  assert 'jemalloc' in prerequisites
