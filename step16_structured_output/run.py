"""Step 16: structured output. A request's output held to a JSON schema, any JSON object, a regular expression or
a list of choices, by masking every token its grammar does not allow; without a format, step 15 as it is.

Examples:
    .venv/bin/python step16_structured_output/run.py --dry-run      # tiny models, parity with HF (on CPU)
    .venv/bin/python step08_serve/run.py --step step16_structured_output   # response_format through the server
"""

from common.cli import main
from step15_batch_invariant.run import add_arguments

if __name__ == "__main__":
    raise SystemExit(main("step16_structured_output", __doc__, add_arguments=add_arguments))
