"""Every subcommand's --help: runs, describes every option, shows every default worth showing; the
eval help estimates the run's length. Parsing errors name the flag."""

import argparse

import pytest

from kvarn_jax.cli import build_parser, main
from kvarn_jax.evaluation.arguments import HelpFormatter


def _subparsers():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_every_subcommand_is_listed():
    assert set(_subparsers()) == {"schemes", "generate", "eval", "report-errors", "capacity", "tune", "pareto"}


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_help_describes_every_option_and_its_default(command, capsys):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: kvarn-jax {command}")
    parser = _subparsers()[command]
    assert parser.description and len(parser.description) > 40
    fmt = HelpFormatter(prog="kvarn-jax")
    for action in parser._actions:
        flag = action.option_strings[-1] if action.option_strings else action.dest
        assert action.help and len(action.help) > 8, f"{command} {flag} has no description"
        assert flag in text if action.option_strings else True
        if action.option_strings and action.default is not None and action.default is not False \
                and action.default is not argparse.SUPPRESS:
            assert "(default: " in fmt._get_help_string(action), f"{command} {flag} does not show its default"
            # and the rendered page shows it (argparse wraps lines, even inside long words)
            assert "".join(str(action.default).split()) in "".join(text.split()), f"{command} {flag}"


def test_eval_help_estimates_the_run_length(capsys):
    assert main(["eval", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Run length" in text and "--tokens 1024 --window 512" in text
    assert "the defaults (6 schemes, 4,096 tokens, 4 prompts x 512 new tokens): about 9 min" in text


def test_eval_estimate_matches_the_measured_runs():
    """Fitted to runs on the project's 2-core machine: 98 s, 218 s and 553 s (within 30%)."""
    from kvarn_jax.evaluation.cli import estimate_eval_seconds
    for args, measured in (((1024, 7, 1, 32), 98), ((2048, 7, 4, 128), 218), ((4096, 7, 4, 512), 553)):
        assert estimate_eval_seconds(*args) == pytest.approx(measured, rel=0.3)
    assert estimate_eval_seconds(4096, 7, 4, 512, params=1.5e9) > 10 * estimate_eval_seconds(4096, 7, 4, 512)


@pytest.mark.parametrize("argv, flag", [
    (["eval", "--tokens", "0"], "--tokens"),
    (["eval", "--window", "x"], "--window"),
    (["eval", "--greedy-prompts", "-1"], "--greedy-prompts"),
    (["tune", "--budget-bits", "nan"], "--budget-bits"),
    (["report-errors", "--outlier-ratio", "0"], "--outlier-ratio"),
    (["capacity", "--gpu-mem", "1GiB", "--preset", "llama3-8b", "--context", "0"], "--context"),
    (["capacity", "--gpu-mem", "1GiB", "--preset", "llama3-8b", "--tail-blocks", "3"], "--tail-blocks"),
    (["schemes", "--head-dim", "-4"], "--head-dim"),
    (["generate", "hi", "--prefill-chunk", "0"], "--prefill-chunk"),
])
def test_parse_errors_name_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    assert f"argument {flag}: " in capsys.readouterr().err
