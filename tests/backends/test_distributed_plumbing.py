"""The backend-agnostic parts of a distributed group, without processes: plans, splits,
membership, the follower's replica pool, and how the CLI settles a rank."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.backends.distributed import (BindPlan, CopyPlan, ForwardPlan, GroupFailed, GroupRefused, PingPlan,
                                         PlanRow, StopPlan, check_membership, column_split, decode_plan, encode_plan,
                                         head_split, stage_layers)
from mlxcel.backends.group import ReplicaAllocator, _rows
from mlxcel.cli.distributed import read_hostfile, refuse_for_group, resolve_group
from mlxcel.cli.flags import parse_server_args
from mlxcel.config.refusal import StartupRefusal
from mlxcel.engine.kv_block_pool import BlockAllocator, SequenceKV


@pytest.mark.parametrize("plan", [
    BindPlan(64, 16, None, 64, 24),
    ForwardPlan("last", [PlanRow([5, 6], [2, 3], [], 17, 0, None, True)], [3]),
    ForwardPlan("all", [PlanRow([5], [2], [4], 0, 0, None, False)], [2, 4], [CopyPlan([32, 33], [48, 49], 1, [3, 4])]),
    PingPlan(),
    StopPlan("bye"),
])
def test_plans_round_trip_as_msgpack(plan):
    assert decode_plan(encode_plan(plan)) == plan


def test_a_plan_that_is_not_one_is_refused():
    with pytest.raises(Exception):
        decode_plan(b"\x93\x01\x02\x03")


def test_layers_split_into_contiguous_stages_covering_all():
    stages = [stage_layers(30, 4, s) for s in range(4)]
    assert [len(r) for r in stages] == [8, 8, 7, 7]
    assert [i for r in stages for i in r] == list(range(30))
    with pytest.raises(GroupRefused, match="only 2 layers"):
        stage_layers(2, 4, 0)


def test_heads_split_by_whole_kv_groups():
    # SmolLM2: 9 query heads over 3 KV heads, two ranks: 2 KV heads (6 q) and 1 (3 q)
    a, b = head_split("llama", 9, 3, 2, 0), head_split("llama", 9, 3, 2, 1)
    assert (a.kv_heads, a.q_heads, b.kv_heads, b.q_heads) == (range(0, 2), range(0, 6), range(2, 3), range(6, 9))
    with pytest.raises(GroupRefused, match="llama has 3 key/value heads, fewer than the tensor-parallel ranks"):
        head_split("llama", 9, 3, 4, 0)
    assert [len(column_split(1536, 4, r)) for r in range(4)] == [384] * 4


class _Gather:
    def __init__(self, prints):
        self.prints = prints

    def all_gather_bytes(self, data):
        return self.prints


def test_membership_names_the_rank_that_differs():
    check_membership(_Gather([b"a" * 32] * 3), b"a" * 32)
    with pytest.raises(GroupFailed, match=r"rank\(s\) 2 loaded a different checkpoint revision or settings"):
        check_membership(_Gather([b"a" * 32, b"a" * 32, b"b" * 32]), b"a" * 32)


def test_a_follower_rebuilds_rank_0s_rows_over_its_replica_pool():
    pool = BlockAllocator(16, 4)
    seq = SequenceKV(pool)
    seq.reserve(6)
    seq.tokens.extend(range(6))
    seq.reserve(3)  # rank 0 reserves before the plan travels
    replica = ReplicaAllocator(16, 4)
    plan = ForwardPlan("last", [PlanRow([7, 8, 9], list(seq.blocks), [], 6, 0, None, False)], [pool.high_water()])
    (row,) = _rows(replica, plan)
    row.cache.reserve(3)  # the backend's own reserve finds the table complete
    assert row.cache.blocks == seq.blocks and row.cache.position == 6
    assert np.array_equal(row.cache.slots(6, 9), seq.slots(6, 9))
    with pytest.raises(RuntimeError, match="hands out no blocks"):
        replica.allocate()


def test_hostfiles_in_mlx_json_and_text_forms(tmp_path):
    mlx = tmp_path / "hosts.json"
    mlx.write_text('[{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]')
    text = tmp_path / "hosts.txt"
    text.write_text("# the group\nnode1 slots=2\nnode2\n")
    assert read_hostfile(mlx) == ["mac1", "mac2"]
    assert read_hostfile(text) == ["node1", "node1", "node2"]
    text.write_text("node1 slots=none\n")
    with pytest.raises(StartupRefusal, match="bad slots"):
        read_hostfile(text)


def settings(*argv: str):
    return parse_server_args(["-m", "x", *argv], {})


def test_a_launchers_environment_sets_the_rank():
    s = settings("--tp-size", "2", "--pp-size", "2")
    resolve_group(s, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                      "MASTER_PORT": "29511"})
    g = s.distributed
    assert (g.launch, g.rank, g.local_rank, g.stage, g.tp_rank, g.master_addr, g.master_port) == (
        "env", 3, 1, 1, 1, "10.0.0.1", 29511)
    with pytest.raises(StartupRefusal, match="WORLD_SIZE=8 RANK=0 does not fit --tp-size 2 x --pp-size 2"):
        resolve_group(settings("--tp-size", "2", "--pp-size", "2"), {"RANK": "0", "WORLD_SIZE": "8"})


def test_one_command_makes_this_process_rank_0_on_a_free_port():
    s = settings("--pp-size", "2")
    resolve_group(s, {})
    assert (s.distributed.launch, s.distributed.rank, s.distributed.master_addr) == ("spawn", 0, "127.0.0.1")
    assert s.distributed.master_port > 0


@pytest.mark.parametrize("argv, flag", [
    (["--sleep-idle-seconds", "5"], "--sleep-idle-seconds"),
    (["--torch-compile"], "--torch-compile"),
    (["--spec-type", "ngram-simple"], "speculative decoding"),
])
def test_what_a_group_does_not_serve_is_refused_by_name(argv, flag):
    with pytest.raises(StartupRefusal, match=f"{flag} is not served by a distributed group"):
        refuse_for_group(settings("--tp-size", "2", *argv))


def test_sizes_below_one_are_refused():
    with pytest.raises(SystemExit):
        settings("--tp-size", "0")


@pytest.mark.parametrize("argv, flag", [
    (["--hostfile", "hosts.txt"], "--hostfile"), (["--dist-timeout", "5"], "--dist-timeout"),
    (["--dist-transport", "gloo"], "--dist-transport")])
def test_group_options_without_a_group_are_refused(argv, flag):
    with pytest.raises(StartupRefusal, match=f"{flag} configures a distributed group.*--tp-size N"):
        resolve_group(settings(*argv), {})


def test_side_worker_and_vision_checkpoints_are_refused_for_a_group():
    from pathlib import Path

    from mlxcel.cli.distributed import refuse_checkpoint_for_group
    from tests.conftest import fixture_path
    from tests.fixtures import DEFAULT_MODEL, QWEN2_VL_TINY

    s = settings("--tp-size", "2")
    with pytest.raises(StartupRefusal, match="side-worker model .* is not served by a distributed group"):
        refuse_checkpoint_for_group(s, None)
    with pytest.raises(StartupRefusal, match="is a vision-language checkpoint"):
        refuse_checkpoint_for_group(s, Path(fixture_path(QWEN2_VL_TINY)))
    refuse_checkpoint_for_group(s, Path(fixture_path(DEFAULT_MODEL)))  # a text model passes
