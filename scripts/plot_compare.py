"""Plot cross-step comparison evidence: output tokens per second against batch size, one line per system.

    python scripts/plot_compare.py results/compare/cuda-random-qwen2.5-7b.json --output results/compare/cuda-random-qwen2.5-7b.png
    python scripts/plot_compare.py results/compare/*.json --output compare.png     # one panel per file

Reads the JSON evidence that `compare.py` writes (`common/bench.py: write_evidence`): every figure drawn is
a figure in the file. The line goes through the run each file reports (the one `median_of` kept of its
repeats); the faint dots are every repeat, from `extra.repeats_tok_per_s`. The title names the device, model, dtype and
commit the evidence records.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# One colour per system in every plot, so the same step looks the same on the CPU and the GPU.
STYLES: dict[str, dict[str, Any]] = {
    "step01_serial": {"color": "tab:red", "marker": "o"},
    "step02_paged_kv": {"color": "tab:orange", "marker": "s"},
    "step03_vectorized_gather": {"color": "tab:green", "marker": "^"},
    "hf-generate": {"color": "black", "marker": "D", "linestyle": "--"},
}


def load(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if not doc.get("runs"):
        raise SystemExit(f"{path}: no runs in this file (expected compare.py evidence)")
    return doc


def title_of(doc: dict[str, Any]) -> str:
    commit = str(doc.get("git_commit", "unknown"))[:10]
    if doc.get("git_dirty"):
        commit += " (uncommitted changes)"
    return f"{doc.get('model', '?')}, {doc.get('dtype', '?')}\n{doc.get('device', '?')}\ncommit {commit}"


def workload_note(doc: dict[str, Any]) -> str:
    """What every request did, and which run each point is, from the file's own workload and settings."""
    parts = []
    workloads = doc.get("workloads") or []
    if workloads:
        prompt = {w["prompt_tokens"]["min"] for w in workloads} | {w["prompt_tokens"]["max"] for w in workloads}
        output = {w["output_tokens"]["min"] for w in workloads} | {w["output_tokens"]["max"] for w in workloads}
        fmt = lambda s: str(min(s)) if len(s) == 1 else f"{min(s)}-{max(s)}"  # noqa: E731
        parts.append(f"{fmt(prompt)}-token prompts, {fmt(output)} new tokens, all arriving at once")
    repeats = doc.get("repeats")
    if repeats and repeats > 1:
        # common/bench.py median_of keeps run len // 2 of the runs sorted by speed: the faster of two.
        kept = "the faster of 2 runs" if repeats == 2 else (
            f"the median of {repeats} runs" if repeats % 2 else f"the upper median of {repeats} runs")
        parts.append(f"line: {kept}, dots: every run")
    return "; ".join(parts)


def plot_evidence(ax, doc: dict[str, Any], log_y: bool = False) -> None:
    """Draw one evidence file on a matplotlib Axes."""
    systems = list(dict.fromkeys(r["system"] for r in doc["runs"]))
    batches = sorted({r["batch"] for r in doc["runs"]})
    for system in systems:
        runs = sorted((r for r in doc["runs"] if r["system"] == system), key=lambda r: r["batch"])
        style = STYLES.get(system, {"marker": "o"})
        line = ax.plot([r["batch"] for r in runs], [r["output_tok_per_s"] for r in runs], label=system, **style)[0]
        for r in runs:
            repeats = r.get("extra", {}).get("repeats_tok_per_s") or []
            if len(repeats) > 1:
                ax.scatter([r["batch"]] * len(repeats), repeats, color=line.get_color(), alpha=0.4, s=14, zorder=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title_of(doc), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    note = workload_note(doc)
    if note:
        ax.annotate(note, (0, 0), xycoords="axes fraction", xytext=(0, -34), textcoords="offset points",
                    fontsize=7, color="0.35", va="top")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="compare evidence JSON files (results/compare/*.json)")
    p.add_argument("--output", type=Path, help="PNG to write (default: the single input file with .png)")
    p.add_argument("--log-y", action="store_true", help="log-scale throughput axis too")
    args = p.parse_args()
    if args.output is None:
        if len(args.files) != 1:
            p.error("several input files: give --output")
        args.output = Path(args.files[0]).with_suffix(".png")

    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    docs = [load(f) for f in args.files]
    fig, axes = plt.subplots(1, len(docs), figsize=(6.4 * len(docs), 5.0), squeeze=False)
    for ax, doc in zip(axes[0], docs):
        plot_evidence(ax, doc, log_y=args.log_y)
    fig.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
