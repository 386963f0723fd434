"""Benchmarks and probes of this step: throughput under a generous and a tight KV budget, recompute against swap."""
