"""argparse pieces every `kvarn-jax` subcommand uses: a help formatter that prints each flag's
default, value types whose errors name the flag (argparse prefixes "argument --flag:"), and checks
of paths that run before anything slow (a model load, a conversion) starts."""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to every option that has a default worth printing (not None, not a
    False switch: their help says what happens without them) unless its help already says it (long
    lists, written with spaces so they wrap); keeps the epilog's line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or "%(default)" in text \
                or "(default: " in text or not action.option_strings:
            return text
        return super()._get_help_string(action)


def parser_kwargs(description: str, epilog: str | None = None) -> dict:
    """Keyword arguments for `add_parser`/`ArgumentParser`: the formatter, description and epilog."""
    return {"description": textwrap.fill(description, 100), "epilog": epilog, "formatter_class": HelpFormatter}


def _typed(convert, test, what):
    def parse(text):
        try:
            value = convert(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


positive_int = _typed(int, lambda v: v >= 1, "an integer >= 1")
nonneg_int = _typed(int, lambda v: v >= 0, "an integer >= 0")
nonneg_float = _typed(float, lambda v: v >= 0 and v != float("inf"), "a finite number >= 0")
positive_float = _typed(float, lambda v: 0 < v < float("inf"), "a finite number > 0")
probability = _typed(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
block_size = _typed(int, lambda v: 1 <= v <= 1024, "an integer from 1 to 1024")


def existing_file(path, flag: str) -> None:
    """ValueError naming `flag` unless `path` is an existing, readable file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{flag} {str(path)!r} does not exist")
    if not p.is_file():
        raise ValueError(f"{flag} {str(path)!r} is not a file")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{flag} {str(path)!r} is not readable")


def writable_path(path, flag: str) -> None:
    """ValueError naming `flag` unless a file can be written at `path` (its folder exists, is writable)."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder; give a file name")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: the folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {str(path)!r}: the folder {str(folder)!r} is not writable")


def check_model(model, flag: str = "--model") -> None:
    """ValueError naming `flag` unless `model` is None (the default model) or a .gguf file or a
    Hugging Face folder with config.json."""
    if model is not None:
        from kvarn_jax.models.checkpoints import check_model_path
        check_model_path(model, flag)


def check_plot_backend(plot) -> None:
    """--plot needs matplotlib: say so before the run, not after it."""
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install matplotlib (or pip install 'kvarn-jax[eval]')") \
                from None


def parse_scheme(text: str, flag: str):
    """kvarn_jax.parse(text), its ValueError reworded to name the CLI flag instead of the Python argument."""
    import kvarn_jax as kj

    try:
        return kj.parse(text.strip())
    except ValueError as e:
        msg = str(e)
        raise ValueError(flag + msg[len("kv_cache_dtype"):] if msg.startswith("kv_cache_dtype ")
                         else f"{flag}: {msg}") from None


def list_default(text: str) -> str:
    """'a,b,c' -> '(default: a, b, c)': a comma list that wraps between items in --help."""
    return f"(default: {', '.join(text.split(','))})"
