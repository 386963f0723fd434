"""Benchmarks of this step: decoders against one long prompt, and bursts of long prompts (engine and server)."""
