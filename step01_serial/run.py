"""Step 01: serial decode, one forward per request per step, each request with its own contiguous KV cache.

Examples:
    .venv/bin/python step01_serial/run.py --dry-run
    .venv/bin/python step01_serial/run.py                       # embedded SmolLM2-135M, checked against HF generate()
    .venv/bin/python step01_serial/run.py --bench               # step01 vs HF generate() at batch 1, 4, 8, JSON in runs/
"""

from common.cli import main

if __name__ == "__main__":
    # The step's name picks its engine, SerialEngine, from common/steps.py once the command line is accepted.
    raise SystemExit(main("step01_serial", __doc__))
