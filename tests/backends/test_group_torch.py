"""Torch shards across ranks give the single-process backend's greedy tokens (fp32, gloo on loopback).

Four processes (tests/backends/group_ranks.py) run each configuration in turn: tensor parallel over
two ranks, pipeline parallel over two, and both at once over four, on two zoo families with
different projection layouts (Mistral's gate/up/down, Starcoder2's biased c_fc/c_proj). Every
e2e reference prompt is prefilled in one step and decoded with the others, so the rows share
each step as under continuous batching. The SmolLM2 real weights are checked through the server
(tests/e2e/test_distributed.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, fixture_path, free_port
from tests.e2e.test_torch_smoke import PROMPTS
from tests.fixtures import zoo_fixture

MISTRAL, STARCODER2 = zoo_fixture("mistral"), zoo_fixture("starcoder2")
CONFIGS = [f"{MISTRAL}:2:1", f"{MISTRAL}:1:2", f"{STARCODER2}:2:1", f"{STARCODER2}:1:2", f"{MISTRAL}:2:2"]
RANKS = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    for ref in (MISTRAL, STARCODER2):
        fixture_path(ref)
    out = tmp_path_factory.mktemp("group") / "results.json"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "tests.backends.group_ranks"]
    procs = [subprocess.Popen([*cmd, str(rank), str(port), str(out), json.dumps(PROMPTS), *CONFIGS], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(RANKS)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the ranks did not finish")
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


@pytest.mark.parametrize("config", CONFIGS)
def test_shards_give_the_single_process_greedy_tokens(results, config):
    got = results[config]
    assert got["group"] == got["reference"]
    assert len({tuple(t) for t in got["reference"]}) > 1  # the prompts lead apart: a broken shard would show


def test_each_rank_holds_its_share(results):
    """Tensor parallel: each rank keeps its KV heads' share of the KV; pipeline: the later stage
    keeps its layers and neither embeddings nor head, so it holds far less than rank 0."""
    tp = results[f"{MISTRAL}:2:1"]["ranks"]
    pp = results[f"{MISTRAL}:1:2"]["ranks"]
    both = results[f"{MISTRAL}:2:2"]["ranks"]
    assert tp[0]["kv_bytes_per_token"] == tp[1]["kv_bytes_per_token"] == pp[0]["kv_bytes_per_token"]
    assert pp[0]["kv_bytes_per_token"] == pp[1]["kv_bytes_per_token"]  # one layer each of two
    assert pp[1]["weight_bytes"] < pp[0]["weight_bytes"] / 10
    assert len(both) == 4 and both[0]["kv_bytes_per_token"] * 2 == tp[0]["kv_bytes_per_token"]
