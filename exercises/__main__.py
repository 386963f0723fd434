"""`python -m exercises list`, `python -m exercises run <id>` and `python -m exercises engine`: see
exercises/README.md."""

from __future__ import annotations

import argparse

from exercises.engine import DEMO_MAX_TOKENS, run_engine
from exercises.registry import EXERCISES, find_exercise
from exercises.runner import list_exercises, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m exercises", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every exercise and its status (solved / not yet / not started)")
    run_parser = commands.add_parser("run", help="check one exercise with the step's tests and dry run")
    run_parser.add_argument("id", choices=[e.id for e in EXERCISES])
    run_parser.add_argument("--project", action="store_true", help="check the project's own code (the solution)")
    run_parser.add_argument("--tests-only", action="store_true", help="the tests without the dry run (faster)")
    engine_parser = commands.add_parser("engine", help="the final engine with every exercise you solved swapped in")
    engine_parser.add_argument("--project", action="store_true", help="swap in every exercise's solution instead")
    engine_parser.add_argument("--prompts", type=int, default=4, help="how many demo prompts (default: all 4)")
    engine_parser.add_argument("--max-tokens", type=int, default=DEMO_MAX_TOKENS,
                               help=f"new tokens per prompt (default {DEMO_MAX_TOKENS})")
    args = parser.parse_args()
    if args.command == "list":
        list_exercises()
        return 0
    if args.command == "engine":
        return 0 if run_engine(project=args.project, prompts=args.prompts, max_tokens=args.max_tokens) else 1
    return 0 if run(find_exercise(args.id), project=args.project, tests_only=args.tests_only) else 1


if __name__ == "__main__":
    raise SystemExit(main())
