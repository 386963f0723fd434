"""Every flag of every step's command line either changes what that step's engine does, or is refused there.

A flag that sets a config field the engine never reads would be accepted and silently do nothing (as
`--batched-prefill` once did from step 09 on, where prompts are prefilled in chunks instead). So each step's
engine is built from its own command line and run on a tiny model while its config records which fields it
reads: every field a flag sets must be among them.
"""

from __future__ import annotations

import dataclasses

import pytest

from common.cli import build_parser
from common.engine import EngineConfig
from common.sampling import SamplingParams
from common.steps import STEPS, Step


def step_parser(step: Step):  # noqa: ANN201
    """The parser of the step's run.py: the shared command line plus the step's own flags."""
    parser = build_parser(step.name)
    step.add_arguments(parser)
    return parser


def recording(config: EngineConfig, read: set[str]) -> EngineConfig:
    """`config`, as an instance of a subclass that adds the name of every field read to `read`."""
    names = {f.name for f in dataclasses.fields(config)}

    class RecordingConfig(type(config)):
        def __getattribute__(self, name: str):  # noqa: ANN204
            if name in names:
                read.add(name)
            return super().__getattribute__(name)

    config.__class__ = RecordingConfig
    return config


@pytest.mark.parametrize("step", STEPS, ids=[s.name for s in STEPS])
def test_every_flag_sets_a_field_the_engine_reads(step: Step) -> None:
    engine_class = step.engine_class()
    args = step_parser(step).parse_args(["--model", "tiny-llama", "--device", "cpu"])
    fields = {f.name for f in dataclasses.fields(engine_class.config_class)}
    flag_fields = set(vars(args)) & fields  # a refused flag sets nothing: it is not among them
    read: set[str] = set()
    engine = engine_class.from_config(recording(engine_class.config_class.from_args(args), read))
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    engine.add_request(prompts[0], SamplingParams(max_tokens=3))
    engine.step()
    engine.add_request(prompts[1], SamplingParams(max_tokens=3))  # arrives while the first decodes
    while engine.has_unfinished():
        engine.step()
    unread = sorted(flag_fields - read)
    assert not unread, f"{step.name} accepts flags its engine never reads: {', '.join(unread)}"


@pytest.mark.parametrize("step", [s for s in STEPS if s.name >= "step09"], ids=lambda s: s.name)
@pytest.mark.parametrize("flag", ["--batched-prefill", "--no-batched-prefill"])
def test_prefill_flags_of_steps_06_and_07_are_refused_from_step_09_on(
        step: Step, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        step_parser(step).parse_args([flag])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and f"{flag} does nothing in this step" in message


def test_prefill_flag_still_works_in_step_07() -> None:
    step07 = next(s for s in STEPS if s.name == "step07_preemption")
    assert step_parser(step07).parse_args(["--no-batched-prefill"]).batched_prefill is False


def test_what_a_run_py_writes_out_is_its_engines() -> None:
    """Steps 06, 07 and 09's run.py write out a few names and figures of their engine: importing the engine would
    load torch before --help could answer. They must stay the engine's."""
    from step06_paged_attention import backends
    from step06_paged_attention import run as step06_run
    from step07_preemption import engine as step07_engine
    from step07_preemption import run as step07_run
    from step09_chunked_prefill.engine import CPU_TOKEN_BUDGET, GPU_STEP_FLOPS

    assert step06_run.ATTENTION_BACKENDS == backends.ATTENTION_BACKENDS
    assert step07_run.PREEMPT_MODES == step07_engine.PREEMPT_MODES
    step09 = next(s for s in STEPS if s.name == "step09_chunked_prefill")
    help_text = " ".join(step_parser(step09).format_help().split())  # argparse wraps the lines
    assert f"{CPU_TOKEN_BUDGET} on a CPU; on a GPU about {GPU_STEP_FLOPS / 1e12:g} TFLOP" in help_text
    from step11_speculative_decoding.engine import DEFAULT_DECODE_TOKEN_COST, DEFAULT_STEP_COST, DEFAULT_TOKEN_COST

    step11 = next(s for s in STEPS if s.name == "step11_speculative_decoding")
    help_text = " ".join(step_parser(step11).format_help().split())
    assert f"default {DEFAULT_TOKEN_COST['cpu']:g} on a CPU, {DEFAULT_TOKEN_COST['cuda']:g} on a GPU" in help_text
    assert f"default {DEFAULT_STEP_COST['cpu']:g} on a CPU, {DEFAULT_STEP_COST['cuda']:g} on a GPU" in help_text
    assert "cpu" not in DEFAULT_DECODE_TOKEN_COST  # a CPU's decode token costs its token cost
    assert f"the token cost on a CPU, {DEFAULT_DECODE_TOKEN_COST['cuda']:g} on a GPU" in help_text
