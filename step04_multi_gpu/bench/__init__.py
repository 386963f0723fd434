"""Benchmarks and probes of this step: one process against N tensor-parallel ranks, one engine against N replicas."""
