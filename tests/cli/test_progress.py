"""Progress reporting (config/progress.py): plain, rate-limited lines through logging when
standard error is not a terminal, a tqdm bar when it is, nothing when INFO is off; and
`mlxcel convert` writing such lines into a log file, without a carriage return."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest

from mlxcel.config import progress
from mlxcel.config.progress import LineTqdm, Progress, tqdm_class
from tests.conftest import REPO, fixture_path
from tests.fixtures import QWEN2_TINY


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger="mlxcel.progress")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "mlxcel.progress"]


def test_plain_lines_one_per_stage_and_a_last_one(lines):
    with Progress("converting x", total=3, unit="step", stream=io.StringIO(), interval=3600) as bar:
        for stage in ("reading", "casting", "writing"):
            bar.stage(stage)
            bar.update()
    out = lines()
    assert [ln.split(", ")[-1] for ln in out] == ["reading]", "casting]", "writing]", "done]"]
    assert out[0].startswith("converting x:   0% 0/3") and out[-1].startswith("converting x: 100% 3/3")
    assert not any("\r" in ln or "\n" in ln for ln in out)


def test_plain_updates_are_rate_limited(lines):
    with Progress("downloading", total=1000, unit="B", stream=io.StringIO(), interval=3600) as bar:
        for _ in range(100):
            bar.update(10)
    out = lines()
    # the opening 0% says nothing; within the interval the updates add no line; the end does
    assert len(out) == 1 and out[0].startswith("downloading: 100% 1000/1000"), out


def test_a_terminal_gets_a_bar_and_no_log_lines(lines):
    term = Terminal()
    with Progress("loading", total=2, unit="step", stream=term) as bar:
        bar.stage("weights")
        bar.update(2)
    assert "\r" in term.getvalue() and "loading" in term.getvalue()
    assert lines() == []


def test_silent_when_info_is_off(caplog):
    caplog.set_level(logging.WARNING, logger="mlxcel.progress")
    term = Terminal()
    with Progress("loading", total=2, stream=term) as bar:
        bar.update(2)
    assert term.getvalue() == "" and not caplog.records
    assert tqdm_class(term) is progress._Silent


def test_library_bars_follow_the_stream(lines):
    assert tqdm_class(Terminal()) is None  # huggingface_hub draws its own
    cls = tqdm_class(io.StringIO())
    assert cls is LineTqdm
    # as huggingface_hub creates and drives its bars: a name, its own bar format, totals growing
    bar = cls(name="huggingface_hub.snapshot_download", desc="Fetching 2 files", total=0, unit="B",
              unit_scale=True, bar_format="{desc}: {n_fmt} [{elapsed}]", interval=3600)
    bar.total = 2048
    bar.update(1024)
    bar.update(1024)
    bar.close()
    out = lines()
    assert len(out) == 1 and out[0].startswith("Fetching 2 files: 2.05k"), out


def test_convert_writes_plain_progress_into_a_log_file(tmp_path):
    src = fixture_path(QWEN2_TINY)
    log = tmp_path / "convert.log"
    with open(log, "wb") as fh:
        r = subprocess.run([sys.executable, "-m", "mlxcel.cli.main", "convert", str(src), "--out-repo", "t/q", "-q",
                            "--models-dir", str(tmp_path / "store")], cwd=REPO, stdout=subprocess.PIPE, stderr=fh,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    text = log.read_text()
    assert r.returncode == 0, text
    assert "\r" not in text
    steps = [ln for ln in text.splitlines() if ln.startswith("converting qwen2-tiny:")]
    assert steps[0].endswith("reading qwen2 weights]") and steps[-1].startswith("converting qwen2-tiny: 100% 4/4")
    assert steps[-1].endswith("done]")
    assert any("quantizing to 4 bits" in ln for ln in steps)
