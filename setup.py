"""vit_jax: Vision Transformers (ViT, BiT ResNets, hybrids) in JAX/Flax.

The wheel holds one top-level package, `vit_jax`; the repository's configs/ and launch/
folders ship inside it as `vit_jax.configs` and `vit_jax.launch`, so nothing but
`vit_jax` lands in site-packages. Dependencies are ranges; constraints.txt pins the exact
stack that is tested.
"""
import setuptools

INSTALL_REQUIRES = [
    "jax>=0.10.2,<0.11",
    "jaxlib>=0.10.2,<0.11",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "ml_collections>=1.1.0",
    "numpy>=2.4,<3",
    "scipy>=1.17",
    "tensorflow-cpu>=2.21,<3",  # tf.data and gfile only: JAX owns the accelerators
    # tensorflow-cpu 2.21 no longer pulls in tensorboard; the event files are written with it.
    "tensorboard>=2.21",
    "tensorflow-datasets>=4.9.10",
    # tensorflow-datasets 4.9.10 looks up each dataset's source through importlib_resources on
    # every Python but requires it only before 3.9: without it no dataset could be prepared.
    "importlib_resources>=6",
    "pillow>=11",
    "matplotlib>=3.9",
]

EXTRAS_REQUIRE = {
    # Accelerators: the same jax version with its TPU / CUDA 12 plugin.
    "tpu": ["jax[tpu]>=0.10.2,<0.11"],
    "cuda12": ["jax[cuda12]>=0.10.2,<0.11"],
    # filelock: JAX locks its compilation cache with it, which the test run shares between
    # processes (tests/conftest.py).
    "test": [
        "pytest>=9", "pytest-xdist>=3.8", "nbclient>=0.11", "nbformat>=5.10", "ipykernel>=7",
        "ruff>=0.17", "yapf>=0.43", "filelock>=3.12"
    ],
    # benchmarks/vs_pytorch.py, against the PyTorch its figures were measured with. 2.13's
    # CPU build resolves here; an open range resolved to 2.14.1+cu130 and ~3 GB of CUDA wheels.
    "bench": ["torch>=2.13,<2.14"],
}

# Each imports its command's module with Ctrl-C already one line (vit_jax/console_scripts.py).
CONSOLE_SCRIPTS = [
    "vit-train = vit_jax.console_scripts:train",
    "vit-evaluate = vit_jax.console_scripts:evaluate",
    "vit-inspect = vit_jax.console_scripts:inspect",
    "vit-predict = vit_jax.console_scripts:predict",
    "vit-sweep = vit_jax.console_scripts:sweep",
    "vit-vtab = vit_jax.console_scripts:vtab",
    "vit-tpu = vit_jax.console_scripts:tpu",
    "vit-tfds-build = vit_jax.console_scripts:tfds_build",
]

setuptools.setup(
    name="vit_jax",
    version="0.2.0",
    description="Vision Transformers exactly as the ViT paper, in JAX/Flax.",
    packages=["vit_jax", "vit_jax.models", "vit_jax.configs", "vit_jax.launch"],
    package_dir={
        "vit_jax.configs": "configs",
        "vit_jax.launch": "launch"
    },
    # At least 3.11: jax 0.10, numpy 2.4 and scipy 1.17 need it. Below 3.14: tensorflow-cpu
    # (2.21, the newest) has no wheels for 3.14, where pip ended in "No matching distribution".
    python_requires=">=3.11,<3.14",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
)
