"""Paged decode attention. `reference.py` is the pure-jnp oracle the Pallas kernels are tested against."""
