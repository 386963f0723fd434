"""Output tokens per second against batch size, one line per system: the plot of `compare.py`'s evidence.

`write_plot` draws one panel per evidence file (`common/bench.py: write_evidence`): every figure drawn is a
figure in the file. The line goes through the run each file reports (the one `median_of` kept of its repeats);
the faint dots are every repeat, from `extra.repeats_tok_per_s`. The title names the device, model, dtype and
commit the evidence records. `compare.py` calls `write_plot` after writing its evidence, `scripts/plot_compare.py`
on any files, and the notebooks draw a file with `plot_evidence`.

With a bandwidth, a dashed grey line adds the weight-read ceiling: a batched decode step reads every weight it
uses at least once (all of them but the embedding table, of which it reads one row per request), so a step takes
at least (weight bytes) / (memory bandwidth), and the output is at most batch x bandwidth / (weight bytes) tokens
per second. The weights are counted from the model's config (`weight_params_per_decode_step`); the bandwidth is
the caller's, a measurement of one device, not anything in the evidence. The bound leaves out every other byte a
step moves (KV cache, activations), which can only lower the true figure, and it is only as high as the bandwidth
given: a kernel that reads faster than the measured copy would raise it. matplotlib (a test extra) is imported
only to draw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.config import EMBEDDED_MODEL, ModelConfig, load_bundled_config, tiny_config, weight_params_per_decode_step

# Bytes per weight for the dtypes the evidence names.
BYTES_PER_PARAM = {"bfloat16": 2, "float16": 2, "float32": 4}

# One colour per system in every plot, so the same step looks the same on the CPU and the GPU.
STYLES: dict[str, dict[str, Any]] = {
    "step01_serial": {"color": "tab:red", "marker": "o"},
    "step02_paged_kv": {"color": "tab:orange", "marker": "s"},
    "step03_vectorized_gather": {"color": "tab:green", "marker": "^"},
    "step06_paged_attention": {"color": "tab:blue", "marker": "v"},
    "step07_preemption": {"color": "tab:purple", "marker": "P"},
    "step12_cuda_graph": {"color": "tab:brown", "marker": "*", "markersize": 10},
    "hf-generate": {"color": "black", "marker": "D", "linestyle": "--"},
    "hf-generate-static": {"color": "tab:gray", "marker": "X", "linestyle": ":"},
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


def model_config_of(model: str) -> ModelConfig:
    """The `ModelConfig` of the model an evidence file names: `random:<config>`, `tiny-<arch>`, the embedded
    model, or a local folder (a Hugging Face id is refused rather than downloaded)."""
    if model.startswith("random:"):
        return load_bundled_config(model.removeprefix("random:"))
    if model.startswith("tiny-"):
        return tiny_config(model.removeprefix("tiny-"))
    if model == EMBEDDED_MODEL or Path(model).expanduser().is_dir():
        from common.loading import read_config, resolve_checkpoint_dir  # loads torch: only for a model's folder

        return read_config(resolve_checkpoint_dir(model))
    raise SystemExit(f"no local config for {model!r}: the ceiling needs random:<config>, tiny-<arch>, "
                     f"{EMBEDDED_MODEL} or a local model folder")


def plot_ceiling(ax, doc: dict[str, Any], bandwidth_tbs: float) -> None:
    """The weight-read ceiling, batch x bandwidth / weight bytes, as a dashed grey line over the file's batches."""
    if doc.get("dtype") not in BYTES_PER_PARAM:
        raise SystemExit(f"no weight size known for dtype {doc.get('dtype')!r}")
    config = model_config_of(doc["model"])
    weight_bytes = weight_params_per_decode_step(config) * BYTES_PER_PARAM[doc["dtype"]]
    steps_per_s = bandwidth_tbs * 1e12 / weight_bytes
    batches = sorted({r["batch"] for r in doc["runs"]})
    for b in batches:
        ax.annotate(f"{b * steps_per_s:,.0f}", (b, b * steps_per_s), xytext=(0, 5), textcoords="offset points",
                    ha="center", fontsize=7, color="0.45")
    ax.plot(batches, [b * steps_per_s for b in batches], color="0.55", linestyle="--", zorder=0,
            label=f"weight-read ceiling, an upper bound:\nbatch x {bandwidth_tbs:g} TB/s (measured copy bandwidth)\n"
                  f"/ {weight_bytes / 1e9:.2f} GB of {doc['dtype']} weights per step")


def plot_evidence(ax, doc: dict[str, Any], log_y: bool = False, ceiling_bandwidth_tbs: float | None = None) -> None:
    """Draw one evidence file on a matplotlib Axes, with the weight-read ceiling if a bandwidth is given."""
    systems = list(dict.fromkeys(r["system"] for r in doc["runs"]))
    batches = sorted({r["batch"] for r in doc["runs"]})
    if ceiling_bandwidth_tbs is not None:
        plot_ceiling(ax, doc, ceiling_bandwidth_tbs)
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
    if ceiling_bandwidth_tbs is None:
        ax.legend(fontsize=8)
    else:  # the ceiling's line crosses the upper left, where the legend would go: put it beside the plot
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    note = workload_note(doc)
    if note:
        ax.annotate(note, (0, 0), xycoords="axes fraction", xytext=(0, -34), textcoords="offset points",
                    fontsize=7, color="0.35", va="top")


def write_plot(files: list[str | Path], output: str | Path, log_y: bool = False,
               ceiling_bandwidth_tbs: float | None = None) -> Path:
    """One panel per evidence file, written to `output` (a PNG); returns its path."""
    from matplotlib.figure import Figure  # no pyplot: no display, and no global backend to change

    docs = [load(f) for f in files]
    if ceiling_bandwidth_tbs is not None and len({doc.get("device") for doc in docs}) > 1:
        raise SystemExit("--ceiling-bandwidth-tbs is one device's bandwidth: plot files from that device only")
    width = 6.4 if ceiling_bandwidth_tbs is None else 9.0  # room for the legend beside each panel
    fig = Figure(figsize=(width * len(docs), 5.0))
    axes = fig.subplots(1, len(docs), squeeze=False)
    for ax, doc in zip(axes[0], docs):
        plot_evidence(ax, doc, log_y=log_y, ceiling_bandwidth_tbs=ceiling_bandwidth_tbs)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    return output
