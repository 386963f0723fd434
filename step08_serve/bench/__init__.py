"""Benchmarks and probes of this step: the server under concurrent clients, against the bare engine."""
