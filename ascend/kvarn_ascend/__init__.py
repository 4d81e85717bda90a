"""kvarn-jax on Ascend NPUs: CANN-backed ops with CPU functions of identical semantics."""
