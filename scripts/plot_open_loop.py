"""Plot open-loop evidence: TTFT and TPOT (p50, p99) and goodput against request rate, one line per file.

    .venv/bin/python scripts/plot_open_loop.py runs/step08_serve/open-loop-cuda-random-qwen2.5-7b.json   # .png beside
    .venv/bin/python scripts/plot_open_loop.py runs/step08_serve/open-loop-ours.json \\
        runs/step08_serve/open-loop-peer.json --output runs/step08_serve/ours-vs-peer.png

Reads the JSON evidence that `step08_serve/bench/bench_open_loop.py` writes: files of the same workload and goodput
targets (this project's server and a peer, say), drawn side by side. The drawing is `common/plots/latency.py`'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.plots.latency import write_plot


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", type=Path, nargs="+", help="bench_open_loop.py evidence files")
    p.add_argument("--output", type=Path, help="PNG to write (default: next to the single input file, with .png)")
    args = p.parse_args(argv)
    if args.output is None:
        if len(args.files) != 1:
            p.error("several input files: give --output")
        args.output = args.files[0].with_suffix(".png")
    print(f"wrote {write_plot(args.files, args.output)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
