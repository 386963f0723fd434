"""Benchmarks and probes of this step: shared prefixes and multi-turn chat, caching on against off."""
