"""Evaluation text shipped with the package.

`persuasion.txt` is chapters 1-17 of Jane Austen's *Persuasion* (1818; public domain), the first
294,234 characters of the plain-text edition in Debian's r-cran-janeaustenr, unchanged, so character
offsets (e.g. "from character 5,000", the evaluation's default start) mean the same as in the full book.
"""

from __future__ import annotations

from importlib import resources

TEXTS = ("persuasion",)


def load_text(name: str = "persuasion") -> str:
    """The shipped text `name` (one of TEXTS) as a str."""
    if name not in TEXTS:
        raise ValueError(f"name must be one of {list(TEXTS)}, got {name!r}")
    return resources.files(__package__).joinpath(f"{name}.txt").read_text(encoding="utf-8")
