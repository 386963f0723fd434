"""Probes of this step: where a replayed decode step's GPU time goes; the skinny multiply against cuBLAS."""
