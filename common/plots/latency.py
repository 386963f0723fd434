"""Latency and goodput against request rate: the plot of step08_serve/bench/bench_open_loop.py's evidence.

Three panels over the offered request rate (Poisson arrivals; `inf`, every request at once, is drawn at the right
end): time to first token and time per output token, each at the median (solid) and the 99th percentile (dashed),
on a log scale, since the tail grows many times over once requests queue; and goodput, the completed requests per
second that met both latency targets, beside the offered rate (dotted grey) that a server keeping up would reach.
One colour per evidence file, named by its label: this project's server and a peer side by side, when both ran the
same workload. `bench_open_loop.py` calls `write_plot` after writing its evidence, `scripts/plot_open_loop.py` on
any files. matplotlib (a test extra) is imported only to draw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if not doc.get("runs") or "goodput" not in doc:
        raise SystemExit(f"{path}: no open-loop runs in this file (expected bench_open_loop.py evidence)")
    return doc


def describe(doc: dict[str, Any]) -> str:
    """Which server and machine a file speaks for, for the figure's title."""
    commit = str(doc.get("git_commit", "unknown"))[:10] + (" (uncommitted changes)" if doc.get("git_dirty") else "")
    where = doc.get("base_url") if doc.get("server") == "external" else doc.get("step")
    early = "" if doc["workload"].get("ignore_eos", True) else ", without ignore_eos"
    return f"{doc['label']}: {doc['model']} ({where}{early}), {doc['dtype']}, {doc['device']}, commit {commit}"


def workload_note(doc: dict[str, Any]) -> str:
    w = doc["workload"]
    return (f"{w['num_requests']} requests per rate, Poisson arrivals (seed {w['seed']}); prompts of "
            f"{w['prompt_len']['min']}-{w['prompt_len']['max']} tokens, {w['output_len']['min']}-"
            f"{w['output_len']['max']} new tokens, uniform")


def write_plot(files: list[str | Path], output: str | Path) -> Path:
    """TTFT, TPOT and goodput against request rate, one line per evidence file, written to `output` (a PNG)."""
    from matplotlib.figure import Figure  # no pyplot: no display, and no global backend to change
    from matplotlib.ticker import LogFormatter

    docs = [load(f) for f in files]
    if len({json.dumps(doc["goodput"], sort_keys=True) for doc in docs}) > 1:
        raise SystemExit("these files have different goodput targets: their goodput does not compare")
    # The rates may differ from file to file; what each request asked for may not. Whether `ignore_eos` was sent
    # may: a peer that refuses the field is asked the same lengths, and `describe` says it may have ended early.
    if len({json.dumps({k: v for k, v in doc["workload"].items() if k not in ("request_rates", "ignore_eos")},
                       sort_keys=True) for doc in docs}) > 1:
        raise SystemExit("these files ran different workloads (lengths, seed, tokenizer): "
                         "their latencies do not compare")
    finite = sorted({r["request_rate"] for doc in docs for r in doc["runs"] if r["request_rate"] != "inf"})
    inf_at = 2 * finite[-1] if finite else 1.0  # one step right of the largest rate on the log axis

    def x_of(run: dict[str, Any]) -> float:
        return inf_at if run["request_rate"] == "inf" else run["request_rate"]

    fig = Figure(figsize=(17, 5.6))
    ttft_ax, tpot_ax, goodput_ax = fig.subplots(1, 3)
    for i, doc in enumerate(docs):
        color = f"C{i}"
        for ax, metric in ((ttft_ax, "ttft_ms"), (tpot_ax, "tpot_ms")):
            for quantile, linestyle in (("p50", "-"), ("p99", "--")):
                points = [(x_of(r), r[metric][quantile]) for r in doc["runs"] if r[metric]]  # None: none completed
                ax.plot([x for x, _ in points], [y for _, y in points], color=color, linestyle=linestyle,
                        marker="o", label=f"{doc['label']} {quantile}")
        goodput_ax.plot([x_of(r) for r in doc["runs"]], [r["goodput_req_per_s"] for r in doc["runs"]], color=color,
                        marker="o", label=doc["label"])
    if finite:
        goodput_ax.plot(finite, finite, color="0.6", linestyle=":", label="offered rate")
    targets = docs[0]["goodput"]
    ticks = finite + ([inf_at] if any(x_of(r) == inf_at for doc in docs for r in doc["runs"]) else [])
    for ax, ylabel, title in (
        (ttft_ax, "ms", "time to first token (p50 solid, p99 dashed)"),
        (tpot_ax, "ms", "time per output token (p50 solid, p99 dashed)"),
        (goodput_ax, "requests / s",
         f"goodput: TTFT <= {targets['ttft_ms']:g} ms and TPOT <= {targets['tpot_ms']:g} ms"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{x:g}" if x != inf_at else "inf" for x in ticks])
        ax.minorticks_off()
        ax.set_xlabel("offered request rate (requests / s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in (ttft_ax, tpot_ax):
        ax.set_yscale("log")
        # Plain numbers (30, 200) on the log axis, not 3 x 10^1: each axis often spans less than two decades.
        ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    goodput_ax.set_ylim(bottom=0)
    fig.suptitle("\n".join([*map(describe, docs), workload_note(docs[0])]), fontsize=9)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    return output
