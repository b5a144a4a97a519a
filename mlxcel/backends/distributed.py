"""What a distributed group is made of, independent of the backend that runs it.

A group of N ranks serves one model (--tp-size / --pp-size, config/distributed.py GroupSpec).
Rank 0 runs the whole engine (HTTP, scheduler, sampling, prefix cache) over a `GroupBackend`
(backends/group.py), which looks like any other backend to the engine: before each call it
broadcasts a `Plan` (the step's rows, tokens, positions and block tables) to the other ranks,
which rebuild the same rows over a replica of rank 0's block pool and run their part of the same
forward (`follow`). Each backend brings two things (backends/torch/distributed.py,
backends/mlx/distributed.py):

- a `Collective` over its own runtime (torch.distributed, mx.distributed): the group's byte
  broadcast for plans, the tensor-parallel all-reduce, and the pipeline's point-to-point sends;
- a shard loader: this rank's part of the model as a `Backend` whose forward does the rank's
  share (its heads and MLP columns, its layer range) and whose logits are right on rank 0.

The two entry points each backend's module (`mlxcel.backends.<name>.distributed`) defines, which
runtime/group.py calls:

    connect(spec: GroupSpec, device: str) -> Collective
        join the group (blocks until every rank has joined, or the spec's timeout passes);
        `device` is where this rank's shard runs (the backend's device string);
    load_shard(path: Path, spec: GroupSpec, collective: Collective, options: ShardOptions) -> Backend
        this rank's shard. Its `info` describes the whole model (num_layers, vocab, config); its
        `kv_spec` this rank's share of the KV (what its pool holds per token); its forward /
        forward_all / hidden_states return the right result on rank 0 (other ranks' results are
        ignored). A family it cannot shard is refused by name with GroupRefused.

Plans travel as msgpack (msgspec), never pickle: a follower decodes typed structs only.
This module also owns the split arithmetic both backends shard by (`stage_layers`,
`head_split`, `column_split`) and the membership fingerprint ranks compare before serving.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import msgspec
import numpy as np

from mlxcel.config.distributed import GroupSpec
from mlxcel.config.rope import RopeOverrides
from mlxcel.engine.backend import BackendUnavailable, KVCacheTypes

T = TypeVar("T")


@dataclass(frozen=True)
class ShardOptions:
    """How a rank loads its shard: the single-process backend's own options (runtime/load.py)."""

    dtype: str = "auto"
    device: str = "cpu"
    threads: int = -1
    rope: RopeOverrides | None = None
    kv_cache: KVCacheTypes = field(default_factory=KVCacheTypes)
    build_env: Mapping[str, str] | None = None  # where the torch backend builds its CPU kernels
    compile: bool = False

FINGERPRINT_BYTES = 32


class GroupRefused(ValueError):
    """The group cannot serve this model as configured (said why, with what to do)."""


class GroupFailed(BackendUnavailable):
    """A rank died, stopped answering, or disagreed: the group cannot run another step."""


class Collective(Protocol):
    """One rank's view of the group's communication, on the backend's own distributed runtime.
    Every call is collective or paired: all ranks (or the named peer) must make the matching
    call, and a call that waits past the group's timeout raises instead of hanging."""

    rank: int
    size: int

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (other ranks pass None)."""

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data` (all the same length), in rank order, on every rank."""

    def all_sum(self, x: T) -> T:
        """The elementwise sum of `x` over this rank's tensor-parallel group (a backend array)."""

    def send(self, x: T, dst: int) -> None:
        """`x` to rank `dst` (a pipeline activation)."""

    def recv(self, like: T, src: int) -> T:
        """An array shaped and typed like `like` from rank `src`."""

    def barrier(self) -> None: ...

    def close(self) -> None: ...


# -- the step plan: what rank 0 broadcasts before each backend call -----------------------------
class PlanRow(msgspec.Struct, array_like=True, frozen=True):
    """One ForwardRow as a follower rebuilds it: its new tokens, its block tables after rank 0
    reserved room for them, and where its sequence stands."""

    tokens: list[int]
    blocks: list[int]
    sliding: list[int]
    length: int  # tokens stored before this step
    shift: int
    state: int | None
    decode: bool


class BindPlan(msgspec.Struct, tag="bind", frozen=True):
    """The block pool's geometry: each follower builds a replica of it (bind_kv)."""

    num_blocks: int
    block_size: int
    window: int | None
    sliding_blocks: int | None  # the sliding group's pool, where it has one
    sliding_window: int | None


class CopyPlan(msgspec.Struct, tag="copy", frozen=True):
    """Slots rank 0 copied (the prefix cache's partial block, a context shift's kept tokens)."""

    src: list[int]
    dst: list[int]
    group: int
    high: list[int]


class ForwardPlan(msgspec.Struct, tag="forward", frozen=True):
    """One backend call over rows: `mode` "last" (forward), "all" (forward_all) or "hidden".
    `copies`: the slot copies rank 0 made since the last plan, applied first, in order."""

    mode: str
    rows: list[PlanRow]
    high: list[int]  # each block group's high-water block id (storage grows to it)
    copies: list[CopyPlan] = []


class PingPlan(msgspec.Struct, tag="ping", frozen=True):
    """Rank 0 is alive and idle."""


class StopPlan(msgspec.Struct, tag="stop", frozen=True):
    reason: str


Plan = BindPlan | ForwardPlan | PingPlan | StopPlan
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Plan)


def encode_plan(plan: Plan) -> bytes:
    return _encoder.encode(plan)


def decode_plan(data: bytes) -> Plan:
    return _decoder.decode(data)


# -- how a model splits over the group ----------------------------------------------------------
def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """The contiguous layers pipeline stage `stage` owns: as even as the count allows, the
    earlier stages taking the remainder (rank 0 also holds the embeddings and the head, so an
    uneven split would better go the other way, but even stages keep every rank's memory close)."""
    if num_layers < pp_size:
        raise GroupRefused(f"--pp-size {pp_size}: the model has only {num_layers} layers, fewer than the stages")
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def column_split(n: int, tp_size: int, tp_rank: int) -> range:
    """The columns of an n-wide dimension tensor-parallel rank `tp_rank` holds (as even as n allows)."""
    base, extra = divmod(n, tp_size)
    start = tp_rank * base + min(tp_rank, extra)
    return range(start, start + base + (1 if tp_rank < extra else 0))


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one tensor-parallel rank holds: whole key/value heads, each with the
    query heads that read it, so a rank's attention needs nothing from another's."""

    q_heads: range
    kv_heads: range


def head_split(model_type: str, n_heads: int, n_kv_heads: int, tp_size: int, tp_rank: int) -> HeadSplit:
    """Split by key/value head: a rank gets whole KV heads and their query groups. The counts
    need not divide evenly (SmolLM2's 3 KV heads over 2 ranks: 2 and 1), but every rank needs one."""
    if n_kv_heads < tp_size:
        raise GroupRefused(f"--tp-size {tp_size}: {model_type} has {n_kv_heads} key/value heads, fewer than the "
                           f"tensor-parallel ranks (each rank keeps whole KV heads); use --tp-size {n_kv_heads} or "
                           f"less, or --pp-size")
    if n_heads % n_kv_heads:
        raise GroupRefused(f"--tp-size {tp_size}: {model_type} has {n_heads} query heads over {n_kv_heads} key/value "
                           "heads, not whole groups")
    group = n_heads // n_kv_heads
    kv = column_split(n_kv_heads, tp_size, tp_rank)
    return HeadSplit(range(kv.start * group, kv.stop * group), kv)


# -- membership ---------------------------------------------------------------------------------
def fingerprint(path: Path, settings: dict) -> bytes:
    """What every rank must agree on before serving: the checkpoint's config, its weight files'
    names and sizes and their safetensors headers (a revision changes these), and the settings
    that shape the forward. FINGERPRINT_BYTES long."""
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes() if (path / "config.json").is_file() else b"")
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:  # the header: every tensor's name, dtype, shape and offsets
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, 1 << 24)))
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.digest()


def check_membership(collective: Collective, mine: bytes) -> None:
    """Every rank's fingerprint must equal rank 0's; otherwise every rank refuses to serve."""
    prints = collective.all_gather_bytes(mine)
    odd = [r for r, p in enumerate(prints) if p != prints[0]]
    if odd:
        raise GroupFailed(f"rank(s) {', '.join(map(str, odd))} loaded a different checkpoint revision or settings "
                          f"than rank 0 (fingerprint {prints[0][:6].hex()} vs {prints[odd[0]][:6].hex()}); start "
                          "every rank on the same checkpoint and arguments")


def as_index(values: np.ndarray) -> list[int]:
    return [int(v) for v in np.asarray(values).reshape(-1)]
