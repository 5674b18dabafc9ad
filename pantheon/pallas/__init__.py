"""Pallas kernels, each beside its plain-jnp reference."""
