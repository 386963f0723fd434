"""Plot cross-step comparison evidence: output tokens per second against batch size, one line per system.

    .venv/bin/python scripts/plot_compare.py runs/compare/cpu-smollm2-135m-instruct.json        # writes the .png next to it
    .venv/bin/python scripts/plot_compare.py results/gpu/decode-*.json --output runs/compare.png   # one panel per file
    .venv/bin/python scripts/plot_compare.py results/gpu/decode-batch1-8.json --ceiling-bandwidth-tbs 4.2 --log-y \\
        --output runs/compare/decode-batch1-8-ceiling.png

Reads the JSON evidence that `compare.py` writes (`common/bench.py: write_evidence`): compare.py's own under
runs/compare/ (ignored by git), or the committed evidence under results/gpu/ and results/cpu/: give that an
--output outside results/, or the committed plot next to it is replaced. The drawing, and what the line, the dots
and the weight-read ceiling (--ceiling-bandwidth-tbs) show, is `common/plots/throughput.py`'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.plots.throughput import write_plot


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+",
                   help="compare evidence JSON files (runs/compare/*.json, or the committed results/gpu/decode-*.json)")
    p.add_argument("--output", type=Path, help="PNG to write (default: next to the single input file, with .png)")
    p.add_argument("--log-y", action="store_true", help="log-scale throughput axis too")
    p.add_argument("--ceiling-bandwidth-tbs", type=float, metavar="TB/S",
                   help="draw the weight-read ceiling for this memory bandwidth in TB/s (10^12 bytes/s). "
                        "For the project's NVIDIA H200 runs use 4.2: the device-to-device copy bandwidth "
                        "measured on the project's H200 machine, counting bytes read plus written, as recorded "
                        "in the project's environment notes (they give about 4.3 TB/s, 8.6 GB in 2.0 ms: 4.2 "
                        "draws the ceiling about 2%% lower)")
    args = p.parse_args()
    if args.output is None:
        if len(args.files) != 1:
            p.error("several input files: give --output")
        args.output = Path(args.files[0]).with_suffix(".png")
    if args.ceiling_bandwidth_tbs is not None and args.ceiling_bandwidth_tbs <= 0:
        p.error("--ceiling-bandwidth-tbs must be positive")
    print(f"wrote {write_plot(args.files, args.output, args.log_y, args.ceiling_bandwidth_tbs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
