"""A stand-in for `gcloud compute tpus ...` in tests: state in the JSON file $FAKE_GCLOUD_STATE.

tests/test_launch.py puts an executable `gcloud` that runs this file first on PATH, so
vit_jax.launch.tpu_vm's waiting and recovery logic runs against scripted states:

  nodes / queued:   name -> {"states": [...]}: describe prints states[0] and drops it while
                    more than one is left (so ["CREATING", "READY"] is CREATING once, then
                    READY for ever); a name not there is NOT_FOUND (exit 1).
  create_states:    {"node": [...], "queued": [...]}: the states a created resource plays.
                    A queued resource creates its TPU VM (state READY) when created.
  run_status:       what the status script over ssh prints, one entry per poll (the last
                    sticks): "running", "exit N", "none", "preempt" (prints running, then
                    the TPU VM becomes PREEMPTED and its queued resource SUSPENDED), "done"
                    (creates the file $FAKE_GCLOUD_FINAL, prints exit 0).
  on_start:         a list; each start of vit_jax.main over ssh pops the first entry, a dict
                    merged into the state (e.g. {"run_status": ["running", "done"]}).
  calls:            every argv received (appended).
"""
import json
import os
import sys


def main(argv):
  path = os.environ['FAKE_GCLOUD_STATE']
  with open(path) as f:
    state = json.load(f)
  state.setdefault('calls', []).append(argv)
  rc = run(state, argv)
  with open(path, 'w') as f:
    json.dump(state, f, indent=1)
  return rc


def _flag(argv, name):
  for i, arg in enumerate(argv):
    if arg == name and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith(name + '='):
      return arg.split('=', 1)[1]
  return None


def _describe(table, name):
  if name not in table:
    print(f'ERROR: (gcloud.compute.tpus) NOT_FOUND: Resource {name} was not found', file=sys.stderr)
    return 1
  states = table[name]['states']
  print(states[0])
  if len(states) > 1:
    states.pop(0)
  return 0


def _exists(table, name, what):
  if name in table:
    print(f'ERROR: (gcloud.compute.tpus) ALREADY_EXISTS: {what} {name} exists', file=sys.stderr)
    return True
  return False


def run(state, argv):
  if argv[:3] != ['compute', 'tpus', 'tpu-vm'
                 ] and argv[:3] != ['compute', 'tpus', 'queued-resources']:
    print(f'fake gcloud: unsupported {argv}', file=sys.stderr)
    return 2
  kind, verb, name = argv[2], argv[3], argv[4]
  nodes, queued = state.setdefault('nodes', {}), state.setdefault('queued', {})
  created = state.get('create_states', {})
  if kind == 'queued-resources':
    if verb == 'create':
      if _exists(queued, name, 'queued resource'):
        return 1
      queued[name] = {'states': list(created.get('queued', ['ACTIVE']))}
      nodes[_flag(argv, '--node-id')] = {'states': ['READY']}
      return 0
    if verb == 'describe':
      return _describe(queued, name)
    if verb == 'delete':
      if name not in queued:
        return _describe(queued, name)
      if '--force' not in argv and name in nodes:
        print('ERROR: the queued resource has a node: use --force', file=sys.stderr)
        return 1
      del queued[name]
      nodes.pop(name, None)
      return 0
  else:
    if verb == 'create':
      if _exists(nodes, name, 'node'):
        return 1
      nodes[name] = {'states': list(created.get('node', ['READY']))}
      return 0
    if verb == 'describe':
      return _describe(nodes, name)
    if verb == 'delete':
      if name not in nodes:
        return _describe(nodes, name)
      del nodes[name]
      return 0
    if verb == 'scp':
      return 0
    if verb == 'ssh':
      if name not in nodes or nodes[name]['states'][0] != 'READY':
        print('ERROR: (gcloud.compute.tpus.tpu-vm.ssh) the TPU VM is not READY', file=sys.stderr)
        return 1
      command = _flag(argv, '--command') or ''
      if 'vit_jax.main' in command:
        state['starts'] = state.get('starts', 0) + 1
        if state.get('on_start'):
          state.update(state['on_start'].pop(0))
        print('t1v-n-0: started')
      elif 'echo running' in command:  # tpu_vm.status_script
        statuses = state.setdefault('run_status', ['running'])
        status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
        if status == 'preempt':
          nodes[name]['states'] = ['PREEMPTED']
          if name in queued:
            queued[name]['states'] = ['SUSPENDED']
          status = 'running'
        elif status == 'done':
          with open(os.environ['FAKE_GCLOUD_FINAL'], 'w') as f:
            f.write('final')
          status = 'exit 0'
        print(status)
      return 0
  print(f'fake gcloud: unsupported {argv}', file=sys.stderr)
  return 2


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
