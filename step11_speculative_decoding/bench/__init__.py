"""Benchmarks of this step: acceptance and speed-up on real text; an oracle proposer of known acceptance."""
