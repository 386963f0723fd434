"""Benchmarks and probes of this step: a decode step's parts with and without overlap, and the host's work per step."""
