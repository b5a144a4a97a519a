"""The MLX side of a distributed group: `mx.distributed` as the group's Collective, and the
shard loader (the two entry points backends/distributed.py names).

One process per rank; the group is MLX's own (the ring backend over TCP on Linux and macOS, MPI
or JACCL where the installed MLX build has them), never a transport of mlxcel's. MLX reads its
group from its own environment (MLX_RANK, and MLX_HOSTFILE: a JSON list, per rank, of "ip:port"
strings, the file `mlx.launch` writes); for a group mlxcel spawned itself those are written here
from the GroupSpec (`ring_environment`), since MLX takes its group no other way. MLX's ring
cannot split a group, so the MLX backend runs tensor or pipeline parallel, not both at once.

What moves through the group: rank 0's step plans as bytes (a length, then the bytes, each an
all_sum to which every other rank adds zeros), the tensor-parallel all-reduces inside mlx.nn's
sharded linears, and pipeline activations by send/recv (sharding.py).

An MLX collective has no timeout: a peer whose process dies closes its sockets, which the ring
reports at once (a RuntimeError, raised here as GroupFailed), but a peer that stops answering
leaves the wait blocked inside MLX. On rank 0 the GroupBackend's watchdog fails the group
(backends/group.py); a follower's waits are bounded by `Watchdog` (mx.eval releases the GIL, so
its thread runs while the wait blocks), which ends the follower's process, since nothing can
unblock the wait.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from mlxcel.backends.distributed import GroupFailed, GroupRefused, ShardOptions
from mlxcel.config.distributed import LAUNCH_MLX, GroupSpec

log = logging.getLogger("mlxcel.backend.mlx")

TRANSPORTS = ("ring", "mpi", "jaccl")
EXIT_GROUP_LOST = 75  # a follower whose group stopped answering (EX_TEMPFAIL: start the group again)


@dataclass(frozen=True)
class MLXGroup:
    """A joined group and the GroupSpec it was formed from (what MLXBackend shards by)."""

    spec: GroupSpec
    group: mx.distributed.Group
    watchdog: Watchdog | None = None  # a follower's: bounds its forwards' waits too


def transport_for(spec: GroupSpec) -> str:
    """The mx.distributed backend this group runs on; one this MLX build lacks is refused."""
    name = "ring" if spec.transport in ("auto", "") else spec.transport
    if name not in TRANSPORTS:
        raise GroupRefused(f"--dist-transport {name}: the MLX backend's transports are {', '.join(TRANSPORTS)}")
    if not mx.distributed.is_available(backend=name):
        raise GroupRefused(f"--dist-transport {name}: this MLX build has no {name} backend; use ring")
    return name


def ring_hostfile(spec: GroupSpec) -> list[list[str]]:
    """Each rank's listening address for MLX's ring: rank i at port master_port + i on its host
    (spec.hosts in rank order; every rank on master_addr when the group is one host). The ring
    takes IP addresses: a host name is resolved here."""
    hosts = spec.hosts or (spec.master_addr,) * spec.world
    if len(hosts) != spec.world:
        raise GroupRefused(f"the hostfile names {len(hosts)} hosts for a group of {spec.world} ranks")
    try:
        return [[f"{socket.gethostbyname(host)}:{spec.master_port + i}"] for i, host in enumerate(hosts)]
    except OSError as e:
        raise GroupRefused(f"a hostfile host does not resolve to an address ({e}); give IP addresses") from None


def ring_environment(spec: GroupSpec, rank: int) -> dict[str, str]:
    """The variables MLX's ring backend reads for `rank` (its hostfile written to a temp file)."""
    with tempfile.NamedTemporaryFile("w", prefix="mlxcel-ring-", suffix=".json", delete=False) as f:
        json.dump(ring_hostfile(spec), f)
    return {"MLX_RANK": str(rank), "MLX_HOSTFILE": f.name}


def connect(spec: GroupSpec, device: str = "cpu") -> MLXCollective:
    """Join the group; blocks until every rank has, or fails after the spec's timeout. The ring's
    variables are written for MLX to read from the spec (ranks mlxcel started, or a torchrun-style
    launcher's); `mlx.launch` (spec.launch "mlx") has already set them. The group MLX forms must
    be the one the spec describes. `device` is the rank's MLX device, which the ring does not
    depend on."""
    if spec.tp_size > 1 and spec.pp_size > 1:
        raise GroupRefused(f"--tp-size {spec.tp_size} with --pp-size {spec.pp_size}: MLX's ring cannot split a "
                           "group into stages, so the MLX backend runs one of them; use --backend torch for both")
    backend = transport_for(spec)
    written = ring_environment(spec, spec.rank) if backend == "ring" and spec.launch != LAUNCH_MLX else {}
    os.environ.update(written)  # for MLX, which reads its group from there itself
    joined: list[mx.distributed.Group] = []
    waiter = threading.Thread(target=lambda: joined.append(mx.distributed.init(strict=True, backend=backend)),
                              name="mlxcel-dist-join", daemon=True)
    waiter.start()
    waiter.join(spec.timeout_s)
    if "MLX_HOSTFILE" in written:  # read once, at init: neither the file nor the variables outlive it
        Path(written["MLX_HOSTFILE"]).unlink(missing_ok=True)
    for name in written:
        os.environ.pop(name, None)
    if not joined:
        raise GroupFailed(f"the distributed group did not form within {spec.timeout_s:g} s (rank {spec.rank} of "
                          f"{spec.world} over {backend}): start every rank, and check the hostfile's addresses")
    group = joined[0]
    if (group.rank(), group.size()) != (spec.rank, spec.world):
        raise GroupRefused(f"MLX formed rank {group.rank()} of {group.size()}, but this process is rank {spec.rank} "
                           f"of {spec.world}: the launcher's MLX_RANK / hostfile disagree with --tp-size / --pp-size")
    # rank 0's waits are bounded by its GroupBackend; a follower's by this
    watchdog = Watchdog(spec.timeout_s, _leave) if spec.rank != 0 else None
    return MLXCollective(group, watchdog)


def load_shard(path: Path, spec: GroupSpec, collective: MLXCollective, options: ShardOptions):
    """This rank's MLXBackend: the checkpoint read lazily and split (sharding.py) before its
    weights are materialized, so a rank holds only its own share."""
    from mlxcel.backends.mlx.backend import MLXBackend

    if options.device not in ("cpu", "metal", "auto"):
        raise GroupRefused(f"--device {options.device}: the MLX backend runs on cpu or metal")
    return MLXBackend(path, dtype=options.dtype, rope=options.rope, threads=options.threads,
                      kv_cache=options.kv_cache, group=MLXGroup(spec, collective.group, collective.watchdog))


def _leave(reason: str) -> None:
    log.error("%s; this rank exits", reason)
    logging.shutdown()
    os._exit(EXIT_GROUP_LOST)


class Watchdog:
    """Bounds a follower's waits: `guard()` arms a deadline; a wait still armed at it calls
    `on_expire(why)` once, from the watchdog's own thread (the waiting thread is blocked inside
    MLX, which offers no way to cancel it)."""

    def __init__(self, timeout_s: float, on_expire: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self.on_expire = on_expire
        self._lock = threading.Lock()
        self._armed: tuple[float, str] | None = None
        self._fired = False
        self._thread = threading.Thread(target=self._watch, name="mlxcel-dist-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str, scale: float = 1.0) -> Iterator[None]:
        """Arm for `scale` x the timeout (a forward step gets rank 0's own bound: twice)."""
        with self._lock:
            self._armed = (time.monotonic() + scale * self.timeout_s, what)
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
                armed = self._armed
            if armed is not None and time.monotonic() >= armed[0]:
                self._fired = True
                self.on_expire(f"no answer from the distributed group in time (timeout {self.timeout_s:g} s, "
                               f"waiting for {armed[1]})")


class MLXCollective:
    """The group's Collective on mx.distributed (backends/distributed.py's protocol): every call
    evaluates at once; a lost peer raises GroupFailed."""

    def __init__(self, group: mx.distributed.Group, watchdog: Watchdog | None = None) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.watchdog = watchdog
        self.bytes_moved = 0  # payload bytes this rank put into collectives (docs/distributed.md)

    @contextmanager
    def _wait(self, what: str) -> Iterator[None]:
        try:
            with self.watchdog.guard(what) if self.watchdog is not None else nullcontext():
                yield
        except RuntimeError as e:  # the ring's "connection to a peer was lost"
            raise GroupFailed(f"the distributed group lost a peer during {what}: {e}") from e

    def _eval(self, out: mx.array, what: str, sent: int) -> mx.array:
        with self._wait(what):
            mx.eval(out)
        self.bytes_moved += sent
        return out

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        mine = data if self.rank == 0 and data is not None else b""
        n = mx.distributed.all_sum(mx.array([len(mine)], dtype=mx.int64), group=self.group)
        n = int(self._eval(n, "a plan's length", 8).item())
        if n == 0:
            return b""
        buf = mx.array(np.frombuffer(mine, dtype=np.uint8)) if self.rank == 0 else mx.zeros((n,), mx.uint8)
        got = self._eval(mx.distributed.all_sum(buf, group=self.group), "a plan", n)
        return mine if self.rank == 0 else bytes(np.array(got, copy=False))

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        mine = mx.array(np.frombuffer(data, dtype=np.uint8)) if data else mx.zeros((0,), mx.uint8)
        got = np.array(self._eval(mx.distributed.all_gather(mine, group=self.group), "all_gather", len(data)))
        return [bytes(part) for part in np.split(got, self.size)]

    def all_sum(self, x: mx.array) -> mx.array:
        return self._eval(mx.distributed.all_sum(x, group=self.group), "all_sum", x.nbytes)

    def send(self, x: mx.array, dst: int) -> None:
        self._eval(mx.distributed.send(x, dst, group=self.group), f"a send to rank {dst}", x.nbytes)

    def recv(self, like: mx.array, src: int) -> mx.array:
        return self._eval(mx.distributed.recv_like(like, src, group=self.group), f"a receive from rank {src}", 0)

    def barrier(self) -> None:
        self.all_sum(mx.zeros((1,), mx.int32))

    def close(self) -> None:
        """MLX keeps its group for the process's life (it has no call to leave one)."""
