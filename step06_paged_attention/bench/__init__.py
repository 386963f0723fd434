"""Benchmarks and probes of this step: the prefill benchmark and the decode and prefill kernels' launch sweeps."""
