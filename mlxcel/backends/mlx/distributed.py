"""The MLX side of a distributed group: `mx.distributed` as the group's collective.

One process per rank; the group is MLX's own (the ring backend over TCP on Linux and macOS,
MPI or JACCL where the installed MLX has them), never a transport of mlxcel's. MLX reads its
group from its own environment (MLX_RANK, MLX_HOSTFILE: a JSON list, per rank, of "ip:port"
strings, the file `mlx.launch` writes); a group this process spawned itself gets those written
here from the GroupSpec (`ring_environment`), since MLX takes no other way in.

What moves through the group: the engine's step plan from rank 0 as bytes (a length, then the
bytes, each an `all_sum` in which every other rank contributes zeros), the tensor-parallel
all-reduces inside the sharded linears (mlx.nn's ShardedToAllLinear), and pipeline activations
by send/recv (sharding.py).

An MLX collective waits forever for a peer that stops answering (a peer whose process dies
closes its sockets, which the ring backend reports at once as a RuntimeError). `Watchdog` bounds
every wait: a daemon thread (mx.eval releases the GIL while it blocks) that calls the group's
failure handler once an armed wait passes its deadline.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from mlxcel.config.distributed import LAUNCH_SPAWN, GroupSpec

TRANSPORTS = ("ring", "mpi", "jaccl")


@dataclass(frozen=True)
class MLXGroup:
    """A joined group and the GroupSpec it was formed from (what MLXBackend shards by)."""

    spec: GroupSpec
    group: mx.distributed.Group


class GroupFailed(RuntimeError):
    """A peer was lost or stopped answering: the group cannot serve another step."""


def transport_for(spec: GroupSpec) -> str:
    """The mx.distributed backend this group runs on; one this MLX build lacks is refused."""
    name = "ring" if spec.transport == "auto" else spec.transport
    if name not in TRANSPORTS:
        raise GroupFailed(f"--dist-transport {name!r} is not an MLX transport; use one of {', '.join(TRANSPORTS)}")
    if not mx.distributed.is_available(backend=name):
        raise GroupFailed(f"this MLX build has no {name!r} distributed backend; use --dist-transport ring")
    return name


def ring_hostfile(spec: GroupSpec) -> list[list[str]]:
    """Each rank's listening address for MLX's ring: rank i at port master_port + i on its host
    (spec.hosts in rank order; every rank on master_addr when the group is one host)."""
    hosts = spec.hosts or (spec.master_addr,) * spec.world
    if len(hosts) != spec.world:
        raise GroupFailed(f"the hostfile names {len(hosts)} hosts for a group of {spec.world} ranks")
    return [[f"{host}:{spec.master_port + i}"] for i, host in enumerate(hosts)]


def ring_environment(spec: GroupSpec, rank: int) -> dict[str, str]:
    """The variables MLX's ring backend reads for `rank` (a spawner merges them into the child's env)."""
    with tempfile.NamedTemporaryFile("w", prefix="mlxcel-ring-", suffix=".json", delete=False) as f:
        json.dump(ring_hostfile(spec), f)
    return {"MLX_RANK": str(rank), "MLX_HOSTFILE": f.name}


def init_group(spec: GroupSpec, environ: dict | None = None) -> mx.distributed.Group:
    """Join the group (blocks until every rank has). A spawned group's ring variables go into
    `environ` (os.environ where MLX reads them) first; a launcher's (`mlx.launch`, mpirun) are
    already there. The group MLX forms must be the one the spec describes."""
    import os

    backend = transport_for(spec)
    if spec.launch == LAUNCH_SPAWN and backend == "ring":
        (os.environ if environ is None else environ).update(ring_environment(spec, spec.rank))
    group = mx.distributed.init(strict=True, backend=backend)
    if (group.rank(), group.size()) != (spec.rank, spec.world):
        raise GroupFailed(f"MLX formed rank {group.rank()} of {group.size()}, but this process is rank "
                          f"{spec.rank} of {spec.world}: the launcher's MLX_RANK / hostfile disagree with "
                          "--tp-size / --pp-size")
    return group


class Watchdog:
    """Bounds every collective wait: `guard()` arms a deadline `timeout_s` ahead; a wait still
    armed at its deadline calls `on_expire(what)` once, from the watchdog's thread (the engine's
    own thread is still blocked inside MLX). The handler answers 503 and exits the process."""

    def __init__(self, timeout_s: float, on_expire: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self.on_expire = on_expire
        self._lock = threading.Lock()
        self._armed: tuple[float, str] | None = None
        self._fired = False
        self._thread = threading.Thread(target=self._watch, name="mlxcel-dist-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        with self._lock:
            self._armed = (time.monotonic() + self.timeout_s, what)
        try:
            yield
        finally:
            with self._lock:
                self._armed = None

    def _watch(self) -> None:
        tick = min(0.25, self.timeout_s / 4)
        while not self._fired:
            time.sleep(tick)
            with self._lock:
                due = self._armed is not None and time.monotonic() >= self._armed[0]
                what = self._armed[1] if due else ""
            if due:
                self._fired = True
                self.on_expire(f"no answer from the group within {self.timeout_s:g} s ({what})")


class MLXCollective:
    """The group's collective on MLX: byte broadcast from rank 0, sums, point-to-point arrays.
    Every call is one guarded wait; a lost peer raises GroupFailed."""

    def __init__(self, group: mx.distributed.Group, watchdog: Watchdog | None = None) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.watchdog = watchdog
        self.bytes_moved = 0  # payload bytes this rank put into collectives (the docs' per-rank numbers)

    @contextmanager
    def _wait(self, what: str) -> Iterator[None]:
        guard = self.watchdog.guard(what) if self.watchdog is not None else _nothing()
        try:
            with guard:
                yield
        except RuntimeError as e:  # the ring backend's "connection to a peer was lost"
            raise GroupFailed(f"distributed group lost a peer during {what}: {e}") from e

    def _sum(self, x: mx.array, what: str) -> mx.array:
        with self._wait(what):
            out = mx.distributed.all_sum(x, group=self.group)
            mx.eval(out)
        self.bytes_moved += x.nbytes
        return out

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None)."""
        mine = data if self.rank == 0 else b""
        n = int(self._sum(mx.array([len(mine)], dtype=mx.int64), "plan length").item())
        if n == 0:
            return b""
        buf = mx.array(np.frombuffer(mine, dtype=np.uint8)) if self.rank == 0 else mx.zeros((n,), mx.uint8)
        return bytes(np.array(self._sum(buf, "plan broadcast"), copy=False))

    def all_sum(self, x: np.ndarray) -> np.ndarray:
        return np.array(self._sum(mx.array(x), "all_sum"))

    def send(self, x: np.ndarray, dst: int) -> None:
        with self._wait(f"send to rank {dst}"):
            mx.eval(mx.distributed.send(mx.array(x), dst, group=self.group))
        self.bytes_moved += x.nbytes

    def recv(self, shape: tuple[int, ...], dtype: np.dtype, src: int) -> np.ndarray:
        with self._wait(f"recv from rank {src}"):
            out = mx.distributed.recv(shape, _MX_DTYPES[np.dtype(dtype)], src, group=self.group)
            mx.eval(out)
        return np.array(out)

    def barrier(self) -> None:
        self._sum(mx.zeros((1,), mx.int32), "barrier")

    @contextmanager
    def step(self, what: str = "forward step") -> Iterator[None]:
        """Guard a whole forward whose all-reduces / sends run inside the model's graph."""
        with self._wait(what):
            yield


@contextmanager
def _nothing() -> Iterator[None]:
    yield


_MX_DTYPES = {np.dtype(np.float32): mx.float32, np.dtype(np.float16): mx.float16, np.dtype(np.int32): mx.int32,
              np.dtype(np.int64): mx.int64, np.dtype(np.uint8): mx.uint8, np.dtype(np.uint32): mx.uint32}
