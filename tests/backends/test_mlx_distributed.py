"""The MLX backend's distributed pieces without a group: the ring's hostfile, the follower's
watchdog, what each rank's KV pool holds, and the refusals (by family name, by head count, tensor
with pipeline). Serving across ranks is tested end to end in tests/e2e/test_distributed.py."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("mlx.core")

from mlxcel.backends.distributed import GroupRefused  # noqa: E402
from mlxcel.backends.mlx import distributed, sharding  # noqa: E402
from mlxcel.config.distributed import GroupSpec  # noqa: E402
from mlxcel.engine.backend import KVSpec, LayerKV  # noqa: E402
from mlxcel.models.registry import FAMILIES  # noqa: E402
from tests import fixtures  # noqa: E402
from tests.conftest import fixture_path  # noqa: E402


class _Group:
    """Rank `rank` of `size`, for splits that are refused before any collective runs."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _model(repo: str):
    from mlx_lm.utils import load_model

    return load_model(fixture_path(repo), lazy=True)[0]


def test_ring_hostfile_gives_each_rank_its_host_and_port():
    spec = GroupSpec(tp_size=2, master_addr="127.0.0.1", master_port=5000)
    assert distributed.ring_hostfile(spec) == [["127.0.0.1:5000"], ["127.0.0.1:5001"]]
    two_hosts = GroupSpec(pp_size=2, master_port=5000, hosts=("10.0.0.1", "localhost"))
    assert distributed.ring_hostfile(two_hosts) == [["10.0.0.1:5000"], ["127.0.0.1:5001"]]
    with pytest.raises(GroupRefused, match="names 1 hosts for a group of 2"):
        distributed.ring_hostfile(GroupSpec(tp_size=2, hosts=("10.0.0.1",)))


def test_a_transport_this_mlx_lacks_and_tensor_with_pipeline_are_refused():
    with pytest.raises(GroupRefused, match="nccl"):
        distributed.transport_for(GroupSpec(tp_size=2, transport="nccl"))
    if not distributed.mx.distributed.is_available(backend="mpi"):
        with pytest.raises(GroupRefused, match="no mpi backend; use ring"):
            distributed.transport_for(GroupSpec(tp_size=2, transport="mpi"))
    with pytest.raises(GroupRefused, match="--tp-size 2 with --pp-size 2.*--backend torch"):
        distributed.connect(GroupSpec(tp_size=2, pp_size=2))


def test_the_watchdog_fires_once_for_a_wait_past_its_deadline_and_never_for_a_finished_one():
    fired: list[str] = []
    done = threading.Event()
    dog = distributed.Watchdog(0.2, lambda why: (fired.append(why), done.set()))
    with dog.guard("a quick wait"):
        pass
    with dog.guard("a plan"):
        assert done.wait(5)
    assert len(fired) == 1 and "waiting for a plan" in fired[0]


def test_each_rank_pool_holds_its_share_of_heads_or_its_layers():
    full = KVSpec(tuple(LayerKV("full", 120) for _ in range(4)))
    tp = sharding.ShardInfo("tp", 1, 2, kv_heads=(1, 3))
    assert [layer.bytes_per_token for layer in sharding.local_kv_spec(full, tp).layers] == [40] * 4
    pp = sharding.ShardInfo("pp", 1, 2, layers=range(2, 4))
    assert [layer.bytes_per_token for layer in sharding.local_kv_spec(full, pp).layers] == [0, 0, 120, 120]
    assert sharding.local_kv_spec(full, None) is full


def test_a_family_outside_the_tensor_parallel_layouts_is_refused_by_name():
    model = _model(fixtures.zoo_fixture("gemma"))
    with pytest.raises(GroupRefused, match="gemma is not split by tensor parallel.*--pp-size"):
        sharding.tensor_parallel(model, FAMILIES["gemma"], _Group(2))


def test_more_ranks_than_kv_heads_is_refused_with_the_largest_size_that_fits():
    model = _model(fixtures.QWEN2_TINY)  # 4 query heads over 2 KV heads
    with pytest.raises(GroupRefused, match="2 key/value heads.*--tp-size 2 or less"):
        sharding.tensor_parallel(model, FAMILIES["qwen2"], _Group(4))


def test_smollm2_heads_split_by_whole_kv_groups_and_layers_by_stage():
    model = _model(fixtures.DEFAULT_MODEL)  # 9 query heads, 3 KV heads, 30 layers
    info = sharding.tensor_parallel(model, FAMILIES["llama"], _Group(2, 1))
    attn = model.layers[0].self_attn
    assert (info.split, info.kv_heads, attn.n_heads, attn.n_kv_heads) == ("kv-groups", (1, 3), 3, 1)
    assert attn.q_proj.weight.shape == (3 * 64, 576) and attn.o_proj.weight.shape == (576, 3 * 64)
    assert model.layers[0].mlp.down_proj.weight.shape == (576, 768)
    staged = _model(fixtures.DEFAULT_MODEL)
    info = sharding.pipeline_parallel(staged, FAMILIES["llama"], _Group(2, 1))
    assert info.layers == range(15, 30)
    assert staged.layers[0].self_attn.q_proj.weight.size == 0  # another stage's weights are dropped
    assert staged.layers[14].use_sliding is False  # what the family's stack reads of it stays
    assert staged.layers[15].self_attn.q_proj.weight.shape == (576, 576)


def test_ranks_started_by_mlx_launch_take_their_rank_from_it():
    from mlxcel.cli.distributed import resolve_group
    from mlxcel.config.refusal import StartupRefusal
    from mlxcel.config.settings import ServerSettings

    settings = ServerSettings(distributed=GroupSpec(tp_size=2))
    resolve_group(settings, {"MLX_RANK": "1", "MLX_HOSTFILE": "/tmp/hosts.json"})
    assert (settings.distributed.launch, settings.distributed.rank) == ("mlx", 1)
    with pytest.raises(StartupRefusal, match="MLX_RANK=2 does not fit --tp-size 2"):
        resolve_group(ServerSettings(distributed=GroupSpec(tp_size=2)), {"MLX_RANK": "2"})
