"""The exercises: per step, the heart of the step as a stub for the learner to write (see exercises/README.md).

`EXERCISES` is the one list of them; `python -m exercises` lists and runs them (exercises/runner.py).
"""

from exercises.registry import EXERCISES, Exercise, find_exercise

__all__ = ["EXERCISES", "Exercise", "find_exercise"]
