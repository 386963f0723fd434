"""Step 08's soak, short: mixed traffic (chat, completions, streams, n > 1, stop strings, penalties, logprobs,
aborts) against a real server process; nothing lost, no KV block held after, resident memory back near its warm
value. The 5-minute run is the GPU's (step08_serve/bench/soak.py)."""

from __future__ import annotations

import json
from pathlib import Path

from step08_serve.bench.soak import KINDS, checks, main


def test_a_short_soak_loses_nothing_and_keeps_nothing(tmp_path: Path) -> None:
    output = tmp_path / "soak.json"
    assert main(["--model", "tiny-qwen2", "--device", "cpu", "--duration", "20", "--rate", "4",
                 "--output-len-range", "8,32", "--output", str(output)]) == 0
    evidence = json.loads(output.read_text())
    outcomes = evidence["outcomes"]
    assert sum(outcomes.values()) == evidence["requests"] == 80
    assert {name.rsplit(" ", 1)[0] for name in outcomes} == set(KINDS)  # every kind was sent
    assert all(name.endswith(" aborted") == name.startswith("abort ") for name in outcomes)
    assert evidence["failures"] == []
    assert evidence["checks"]["passed"] and evidence["checks"]["kv_blocks_used_after"] == 0
    assert evidence["samples"] and max(s["kv_blocks_used"] for s in evidence["samples"]) > 0  # it was busy


def test_the_checks_catch_a_loss_a_held_block_and_growth() -> None:
    def result(outcomes: dict[str, int], blocks: float = 0, rss: float = 100.0) -> dict:
        return {"outcomes": outcomes, "rss_mib_after_warmup": 100.0,
                "idle": {"kv_blocks_used": blocks, "requests_running": 0, "rss_mib": rss}}

    assert checks(result({"chat answered": 3}), 3, 0.05)["passed"]
    assert checks(result({"chat answered": 2}), 3, 0.05)["lost_requests"] == 1  # one never ended
    assert not checks(result({"chat answered": 2, "chat failed": 1}), 3, 0.05)["passed"]
    assert not checks(result({"chat answered": 3}, blocks=2), 3, 0.05)["passed"]
    assert not checks(result({"chat answered": 3}, rss=106.0), 3, 0.05)["passed"]
