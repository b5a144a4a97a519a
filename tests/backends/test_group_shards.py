"""Shards across ranks give the backend's single-process greedy tokens (fp32, on loopback: torch
over gloo, MLX over its ring).

Processes running tests/backends/group_ranks.py take each configuration in turn: tensor parallel
over two ranks, pipeline parallel over two and, on torch, both at once over four (MLX's ring
cannot split a group), on zoo families with different projection layouts (Mistral's
gate/up/down, Starcoder2's biased c_fc/c_proj, which MLX splits by pipeline only; Qwen3's
per-head q/k norms through mlx-lm's own `shard`). Every e2e reference prompt is prefilled in
one step and decoded with the others, so the rows share each step as under continuous
batching. The SmolLM2 real weights are checked through the server (tests/e2e/test_distributed.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, fixture_path, free_port
from tests.e2e.test_torch_smoke import PROMPTS
from tests.fixtures import QWEN3_TINY, zoo_fixture

MISTRAL, STARCODER2 = zoo_fixture("mistral"), zoo_fixture("starcoder2")
CONFIGS = {
    "torch": [f"{MISTRAL}:2:1", f"{MISTRAL}:1:2", f"{STARCODER2}:2:1", f"{STARCODER2}:1:2", f"{MISTRAL}:2:2"],
    "mlx": [f"{MISTRAL}:2:1", f"{MISTRAL}:1:2", f"{STARCODER2}:1:2", f"{QWEN3_TINY}:2:1"],
}
CASES = [(b, c) for b, configs in CONFIGS.items() for c in configs]


def world(config: str) -> int:
    _, tp, pp = config.split(":")
    return int(tp) * int(pp)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """backend -> its configurations' results, each backend's ranks run once for the module."""
    done: dict[str, dict] = {}

    def of(backend: str) -> dict:
        if backend not in done:
            pytest.importorskip("torch" if backend == "torch" else "mlx.core")
            done[backend] = run_ranks(backend, tmp_path_factory)
        return done[backend]

    return of


def run_ranks(backend: str, tmp_path_factory) -> dict:
    for ref in {c.split(":")[0] for c in CONFIGS[backend]}:
        fixture_path(ref)
    configs = [f"{backend}:{c}" for c in CONFIGS[backend]]
    out = tmp_path_factory.mktemp("group") / "results.json"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "tests.backends.group_ranks"]
    procs = [subprocess.Popen([*cmd, str(rank), str(port), str(out), json.dumps(PROMPTS), *configs], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(max(map(world, CONFIGS[backend])))]
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


@pytest.mark.parametrize(("backend", "config"), CASES)
def test_shards_give_the_single_process_greedy_tokens(backend, results, config):
    got = results(backend)[f"{backend}:{config}"]
    assert got["group"] == got["reference"]
    assert len({tuple(t) for t in got["reference"]}) > 1  # the prompts lead apart: a broken shard would show


@pytest.mark.parametrize("backend", list(CONFIGS))
def test_each_rank_holds_its_share(backend, results):
    """Tensor parallel: each rank keeps its KV heads' share of the KV; pipeline: the later stage
    keeps its layers and neither embeddings nor head, so it holds far less than rank 0."""
    tp = results(backend)[f"{backend}:{MISTRAL}:2:1"]["ranks"]
    pp = results(backend)[f"{backend}:{MISTRAL}:1:2"]["ranks"]
    assert tp[0]["kv_bytes_per_token"] == tp[1]["kv_bytes_per_token"] == pp[0]["kv_bytes_per_token"]
    assert pp[0]["kv_bytes_per_token"] == pp[1]["kv_bytes_per_token"]  # one layer each of two
    assert pp[1]["weight_bytes"] < pp[0]["weight_bytes"] / 10
    if f"{MISTRAL}:2:2" in CONFIGS[backend]:
        both = results(backend)[f"{backend}:{MISTRAL}:2:2"]["ranks"]
        assert len(both) == 4 and both[0]["kv_bytes_per_token"] * 2 == tp[0]["kv_bytes_per_token"]


def test_a_family_without_a_sharding_layout_is_refused_by_name():
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from mlxcel.backends.distributed import GroupRefused
    from mlxcel.backends.torch.distributed import shard_tensor_parallel
    from mlxcel.config.distributed import GroupSpec

    config = SimpleNamespace(model_type="phi3", num_attention_heads=4, num_key_value_heads=2)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: config))
    with pytest.raises(GroupRefused, match="does not shard the phi3 family .* serve it with --pp-size"):
        shard_tensor_parallel(model, [], GroupSpec(tp_size=2), collective=None)
