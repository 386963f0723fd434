"""Step 03: step 02 with one vectorized gather and one scatter per layer instead of Python loops.

Examples:
    .venv/bin/python step03_vectorized_gather/run.py --dry-run
    .venv/bin/python step03_vectorized_gather/run.py                 # embedded model, checked against HF generate()
    .venv/bin/python step03_vectorized_gather/run.py --bench --batch-sizes 1,4,8
"""

from common.cli import main
from step02_paged_kv.run import add_arguments  # step 02's flags are this step's too

if __name__ == "__main__":
    raise SystemExit(main("step03_vectorized_gather", __doc__, add_arguments=add_arguments))
