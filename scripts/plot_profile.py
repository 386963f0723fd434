"""Plot step 05's evidence: one stacked bar per step, where its decode step's time goes; or one step's timeline.

    .venv/bin/python scripts/plot_profile.py results/gpu/profile-steps.json    # writes the .png next to it
    .venv/bin/python scripts/plot_profile.py --timeline runs/profile/traces/step11_speculative_decoding-cuda.json \
        runs/profile/traces/step12_cuda_graph-cuda.json --output runs/profile/timeline.png

Each bar is a row of the file (`step05_profiling/run.py`), its parts the row's `breakdown_ms`; with --timeline,
one engine step of each trace (`--step`, the fourth by default). The drawing is `common/plots/profile.py`'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.plots.profile import write_plot, write_timeline


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", type=Path, nargs="+", help="an evidence file; with --timeline, traces")
    p.add_argument("--timeline", action="store_true", help="draw one step of each trace given")
    p.add_argument("--step", type=int, default=3, help="with --timeline: which engine step of each trace (from 0)")
    p.add_argument("--output", type=Path, help="default: the (first) file's name with .png")
    args = p.parse_args()
    output = args.output or args.files[0].with_suffix(".png")
    if args.timeline:
        print(f"wrote {write_timeline(args.files, output, args.step)}")
    else:
        print(f"wrote {write_plot(args.files[0], output)}")


if __name__ == "__main__":
    main()
