"""vit_jax: Vision Transformers (ViT, BiT ResNets, hybrids) in JAX/Flax."""
import setuptools

# The stack known to resolve and run together (see ../shared/ENV.md).
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "clu==0.0.12",
    "ml_collections==1.1.0",
    "numpy==2.4.6",
    "scipy==1.17.1",
    "tensorflow-cpu==2.21.0",
    # tensorflow-cpu 2.21 no longer pulls in tensorboard; clu's writers import it.
    "tensorboard==2.21.0",
    "tensorflow-datasets==4.9.10",
    "einops==0.8.2",
    "pillow==13.0.0",
    "matplotlib==3.11.2",
]

EXTRAS_REQUIRE = {
    "test": ["pytest==9.2.0", "nbclient==0.11.0", "ipykernel==7.4.0"],
}

setuptools.setup(
    name="vit_jax",
    version="0.1.0",
    description="Vision Transformers exactly as the ViT paper, in JAX/Flax.",
    packages=setuptools.find_packages(include=["vit_jax", "vit_jax.*"]),
    python_requires=">=3.11",  # jax 0.10, numpy 2.4 and scipy 1.17 need it
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
