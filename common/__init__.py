"""What the steps share: the model, its loading, tokenizer and sampling, the engine interface, and the harness that
runs, measures and profiles any step (the command line, the benchmarks, the profiler, the plots). It imports no
step."""

import os
import sys

# Progress bars (transformers' "Loading weights", the embedded model's one-time conversion, downloads) redraw one
# line with "\r": in a log file or CI every redraw becomes a line of its own. So they are off unless stderr is a
# terminal, or a notebook kernel draws them as widgets. Set here, before tqdm is first imported (it reads TQDM_*
# then); warnings and errors still print.
if not (sys.stderr and sys.stderr.isatty()) and "ipykernel" not in sys.modules:
    os.environ.setdefault("TQDM_DISABLE", "1")
