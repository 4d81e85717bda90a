"""The `kvarn-jax` command lines in README.md and docs/ as users copy them: every one parses (its
flags exist and its values are valid), and every one runs, in page order, on tiny inputs (a tiny
random Llama for --model, a few hundred tokens, two new tokens) appended as overriding flags.

A synopsis line (with [optional] parts) is not a command and is skipped.
"""

import contextlib
import io
import pathlib
import re
import shlex

import pytest

from kvarn_jax.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BASH = re.compile(r"```bash\n(.*?)```", re.S)


def cli_examples(page: pathlib.Path) -> list[list[str]]:
    """argv (without the program name) of every runnable `kvarn-jax` line in a page's bash blocks."""
    out = []
    for block in BASH.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("kvarn-jax ") and "[" not in line:
                argv = shlex.split(line, comments=True)[1:]
                if argv not in out:
                    out.append(argv)
    return out


def _pages_with_examples():
    return [p for p in PAGES if cli_examples(p)]


def test_some_pages_have_examples():
    names = {p.name for p in _pages_with_examples()}
    assert {"README.md", "cli.md"} <= names


@pytest.mark.parametrize("page", _pages_with_examples(), ids=lambda p: p.name)
def test_examples_parse(page):
    parser = build_parser()
    for argv in cli_examples(page):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"{page.name}: `kvarn-jax {shlex.join(argv)}` does not parse: {err.getvalue()}")


def _tiny(argv, model):
    """Flags appended to an example so it runs in seconds (argparse keeps the last value of a flag)."""
    cmd = argv[0]
    small = ["--model", str(model), "--window", "384", "--no-progress"]
    extra = {
        "generate": ["--model", str(model), "--max-new-tokens", "2", "--quiet"],
        "eval": small + ["--tokens", "384", "--greedy-prompts", "1", "--prompt-tokens", "40", "--new-tokens", "3"],
        "report-errors": small + ["--tokens", "384"],
        "tune": small + ["--tokens", "384", "--calib-tokens", "384"],
        "capacity": [],
        "pareto": [],
        "schemes": ["--tokens", "128"] + ([] if "--kv-cache-dtype" in argv else ["--kv-cache-dtype", "fp16,int8"]),
    }[cmd]
    return argv + extra


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from test_eval_support import tiny_model_folder
    return tiny_model_folder(tmp_path_factory.mktemp("readme") / "tiny", num_layers=2, head_dim=64)


@pytest.mark.parametrize("page", _pages_with_examples(), ids=lambda p: p.name)
def test_examples_run_on_tiny_inputs(page, tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # files the examples write land here
    monkeypatch.setenv("KVARN_JAX_CACHE", str(tmp_path / "cache"))
    for argv in cli_examples(page):
        full = _tiny(argv, tiny_model)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(full)
        assert rc == 0, f"{page.name}: `kvarn-jax {shlex.join(argv)}` exited {rc}:\n{err.getvalue()[-2000:]}"
        assert not re.search(r"\bnan\b", out.getvalue()), out.getvalue()
