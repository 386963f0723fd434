"""The profiler behind every step's `--profile` and the server's `POST /profile` (step 05's lesson):
`phases` names an engine's phases from outside, `trace` reads a trace file back, `kernels` tells a kernel's
kind from its name, `profiler` puts them around an engine's steps."""
