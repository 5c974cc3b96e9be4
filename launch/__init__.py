"""Launch scripts: Cloud TPU VMs (tpu_vm.py) and learning-rate sweeps (sweep.py)."""
