"""The distributed group one server process belongs to (--tp-size / --pp-size), as plain data.

The CLI builds a GroupSpec from the flags and from the launcher's environment (torchrun's
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE, or the ranks `mlxcel-server --tp-size N` spawns
itself); nothing below the CLI reads the environment. Ranks are numbered stage-major: rank =
stage * tp_size + tp_rank, so rank 0 is the first pipeline stage's first tensor shard, and it
is the rank that serves HTTP (backends/group.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

LAUNCH_SPAWN = "spawn"  # one command: rank 0 starts the other ranks on this host
LAUNCH_ENV = "env"  # each rank started by a launcher (torchrun, mlxcel launch, mpirun) with its rank in the env
LAUNCH_MLX = "mlx"  # each rank started by `mlx.launch`, whose MLX_RANK / MLX_HOSTFILE MLX reads itself


@dataclass(slots=True)
class GroupSpec:
    tp_size: int = 1  # --tp-size: ranks each holding 1/tp of every layer's heads and MLP columns
    pp_size: int = 1  # --pp-size: pipeline stages, each holding a contiguous range of layers
    rank: int = 0
    local_rank: int = 0  # this rank's index among the ranks on its host (its GPU there)
    master_addr: str = "127.0.0.1"  # where rank 0 listens for the group's rendezvous
    master_port: int = 29500
    hostfile: Path | None = None  # --hostfile as given (the CLI reads it into `hosts`)
    hosts: tuple[str, ...] = field(default_factory=tuple)  # one per rank, in rank order (empty: this host)
    launch: str = LAUNCH_SPAWN
    # the launcher already serves the rendezvous store at master_addr:master_port (torchrun's
    # agent), so rank 0 joins it rather than opening its own there
    launcher_store: bool = False
    timeout_s: float = 60.0  # --dist-timeout: a collective waiting longer fails the group
    # what a rank's shard is told about its peers' transport (mlx: ring | mpi | jaccl; torch: gloo | nccl)
    transport: str = "auto"

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def heartbeat_s(self) -> float:
        """How often an idle rank 0 pings the group, so a follower's wait never reaches the timeout
        and a dead rank is found while no request runs."""
        return max(self.timeout_s / 4, 0.25)

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank

    def describe(self) -> dict:
        """The group as /props reports it."""
        return {"tp_size": self.tp_size, "pp_size": self.pp_size, "world_size": self.world, "rank": self.rank,
                "launch": self.launch, "master": f"{self.master_addr}:{self.master_port}",
                "hosts": list(self.hosts), "timeout_s": self.timeout_s}
