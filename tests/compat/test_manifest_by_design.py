"""The command-line half of the by_design option entries, pinned.

--temp/--top-k/--top-p/--min-p: absent, the setting stays unset so the checkpoint's
generation_config.json can supply it; given, the value is used. --parallel -1 resolves to four
slots. (The manifest's by_design entries point here.)
"""

from __future__ import annotations

import importlib

import pytest


def _flags():
    flags = importlib.import_module("mlxcel.cli.flags")
    if not hasattr(flags, "dump_flag_surface"):
        pytest.skip("flag surface absent: mlxcel.cli.flags has no dump_flag_surface yet")
    return flags


@pytest.mark.parametrize("spelling, field, value, expected", [
    ("--temp", "temperature", "0.3", 0.3),
    ("--top-k", "top_k", "7", 7),
    ("--top-p", "top_p", "0.5", 0.5),
    ("--min-p", "min_p", "0.2", 0.2),
])
def test_sampling_default_left_to_checkpoint(spelling, field, value, expected):
    flags = _flags()
    absent = flags.parse_server_args(["-m", "some/model"], {})
    assert getattr(absent.sampling, field) is None
    given = flags.parse_server_args(["-m", "some/model", spelling, value], {})
    assert getattr(given.sampling, field) == pytest.approx(expected)


def test_parallel_auto_is_four_slots():
    flags = _flags()
    assert flags.parse_server_args(["-m", "some/model", "--parallel", "-1"], {}).engine.parallel == 4
    assert flags.parse_server_args(["-m", "some/model", "-np", "2"], {}).engine.parallel == 2
