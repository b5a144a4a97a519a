"""The b10621 help sections and the row makers the option tables share (options_table.py,
options_table_sampling.py)."""

from __future__ import annotations

from functools import partial

from mlxcel.cli import options_sampling as sa
from mlxcel.cli.options_model import NOT_APPLICABLE, VALUE, Option, make

COMMON, SAMPLING, SPEC, SERVER = "common params", "sampling params", "speculative params", "example-specific params"

C = partial(make, section=COMMON)
S = partial(make, section=SAMPLING)
D = partial(make, section=SPEC)
X = partial(make, section=SERVER)
shown = sa.shown  # a float default as b10621 prints it


def ggml(spellings: str, kind: str = VALUE, *, why: str, inert=None, **kw) -> Option:
    return C(spellings, kind, state=NOT_APPLICABLE, why=why, inert=inert, **kw)


def ggml_draft(spellings: str, kind: str = VALUE, *, why: str, inert=None, **kw) -> Option:
    return D(spellings, kind, state=NOT_APPLICABLE, why=why, inert=inert, **kw)


def removed(new: str) -> str:
    return f"the argument has been removed; use {new}"
