"""The lessons' drawings of worked examples are what the project's code computes now.

Each drawing's script (scripts/draw_*.py) runs here, and the lesson must show what it prints: the whole drawing where
the script prints the drawing itself, the figures the drawing is made of where it prints a worked example.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def lesson(step: str) -> str:
    return (REPO / step / "README.md").read_text(encoding="utf-8")


def printed(script: str) -> str:
    run = subprocess.run([sys.executable, f"scripts/{script}.py"], cwd=REPO, capture_output=True, text=True, check=True)
    return run.stdout


def missing_lines(drawing: str, text: str) -> list[str]:
    """The drawing's lines (trailing spaces aside) that the lesson does not hold."""
    held = {line.rstrip() for line in text.splitlines()}
    return [line for line in drawing.splitlines() if line.strip() and line.rstrip() not in held]


@pytest.mark.parametrize(("script", "step"), [("draw_sum_order", "step15_batch_invariant"),
                                              ("draw_tensor_parallel", "step04_multi_gpu")])
def test_a_printed_drawing_is_the_lessons(script: str, step: str) -> None:
    missing = missing_lines(printed(script), lesson(step))
    assert missing == [], f"{step}'s drawing differs from `python scripts/{script}.py`; lines it lacks: {missing}"


def test_the_block_keys_are_the_engines() -> None:
    output = printed("draw_block_keys")
    keys = re.findall(r"key ([0-9a-f]{8})", output)
    claimed = re.search(r"B claims \[([\d, ]+)\]: prefill starts at token (\d+)", output)
    assert len(keys) == 6 and claimed is not None, f"the script's output changed shape:\n{output}"
    text = lesson("step10_prefix_caching")
    assert [key for key in keys if key not in text] == [], f"keys the lesson's drawing lacks: {keys}"
    blocks = " and ".join(claimed.group(1).split(", "))
    assert f"B claims blocks {blocks}" in text and f"starts at token {claimed.group(2)}" in text, claimed.group(0)


def test_the_first_preemption_is_the_engines() -> None:
    output = printed("draw_first_preemption")
    victim = re.search(r"victim: request (\d+), (\d+) blocks, (\d+) tokens \((\d+) generated\)", output)
    running = re.search(r"running (\d+) requests, (\d+) blocks held", output)
    assert victim is not None and running is not None, f"the script's output changed shape:\n{output}"
    request, blocks, tokens, generated = victim.groups()
    text = lesson("step07_preemption")
    expected = [f"r{request} {blocks}", f"{int(tokens) - int(generated)} prompt + {generated} generated = {tokens} tokens",
                f"requests 0-{int(running.group(1)) - 1} running", f"{running.group(2)} blocks held"]
    assert [fact for fact in expected if fact not in text] == [], f"the lesson's drawing lacks some of {expected}"


def test_the_check_can_fail() -> None:
    assert missing_lines("a\n  b = 262\n", "a\n  b = 256\n") == ["  b = 262"]
