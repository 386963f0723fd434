"""The one list of exercises: for each, the stub the learner writes, the project's code it replaces, and the
step's real tests and dry run that check it.

Adding an exercise is a stub module `exNN_<name>.py` here and one `Exercise(...)` line below.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Exercise:
    id: str  # what the learner types: `make exercise EX=02-slot-mapping`
    stub_module: str  # exercises.<stub_module> holds the learner's function, named like the target's attribute
    target: str  # "module:Class.attribute": the project's code (and solution) that the learner's function replaces
    tests: tuple[str, ...]  # pytest arguments that select the step's real tests of this code (fast ones)
    step: str  # the step whose dry run runs with the learner's code in place
    lesson: str  # the lesson that teaches it, for the hints

    @property
    def target_owner(self) -> type:
        module, _, path = self.target.partition(":")
        owner_name, _, _ = path.rpartition(".")
        return getattr(importlib.import_module(module), owner_name)

    @property
    def attribute(self) -> str:
        return self.target.rpartition(".")[2]

    @property
    def stub_path(self) -> Path:
        return Path(__file__).parent / f"{self.stub_module}.py"

    def learner_function(self) -> Callable[..., Any]:
        """The learner's function, imported afresh so that an edit since the last import counts."""
        module = importlib.reload(importlib.import_module(f"exercises.{self.stub_module}"))
        return getattr(module, self.attribute)

    def solution(self) -> Callable[..., Any]:
        """The project's own code: the exercise's solution."""
        return vars(self.target_owner)[self.attribute]

    def is_untouched(self) -> bool:
        """Whether the learner's function is still the stub: a docstring, then `raise NotImplementedError`."""
        tree = ast.parse(inspect.getsource(self.learner_function()))
        body = tree.body[0].body  # type: ignore[attr-defined]
        return (len(body) == 2 and isinstance(body[0], ast.Expr) and isinstance(body[1], ast.Raise)
                and "NotImplementedError" in ast.unparse(body[1]))


EXERCISES = [
    Exercise(
        id="01-contiguous-attend",
        stub_module="ex01_contiguous_attend",
        target="step01_serial.kv_cache:ContiguousForward.attend",
        tests=("tests/test_step01_serial.py", "-k", "staggered_arrivals and llama or contiguous_reservation"),
        step="step01_serial",
        lesson="step01_serial/README.md",
    ),
    Exercise(
        id="02-slot-mapping",
        stub_module="ex02_slot_mapping",
        target="step02_paged_kv.kv_cache:PagedKVCache.slot",
        tests=("tests/test_step02_step03_paged_kv.py", "-k", "translation_is_printed"),
        step="step02_paged_kv",
        lesson="step02_paged_kv/README.md",
    ),
]


def find_exercise(exercise_id: str) -> Exercise:
    for exercise in EXERCISES:
        if exercise.id == exercise_id:
            return exercise
    raise KeyError(f"no exercise {exercise_id!r}; the exercises are: {', '.join(e.id for e in EXERCISES)}")
