"""Starting a distributed group from the command line (--tp-size / --pp-size).

Two ways in, both ending with one process per rank:
- one command (`mlxcel-server --tp-size 2 ...`): this process is rank 0 and starts the others
  with the same arguments, on this host or, with --hostfile, on the hosts it lists (by ssh);
- a launcher that starts every rank itself (torchrun, mpirun, a scheduler): each process finds
  its rank in torchrun's variables, RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, which are read
  here and nowhere else.

Rank 0 serves HTTP; the others follow it (runtime/group.py). When the group loses a rank, rank
0's requests fail with 503 at once and the process exits EXIT_GRACE_S later with GROUP_FAILED,
ending the ranks it started.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from mlxcel.config.distributed import LAUNCH_ENV, LAUNCH_MLX, LAUNCH_SPAWN, GroupSpec
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import ServerSettings

log = logging.getLogger("mlxcel.group")

GROUP_FAILED = 3  # rank 0's exit status when its group lost a rank
EXIT_GRACE_S = 2.0  # after a failure, time for the 503s to reach their clients before the exit
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def read_hostfile(path: Path) -> list[str]:
    """One entry per rank slot, in order: MLX's JSON hostfile ([{"ssh": host, "ips": [...]}], one
    rank each), or text lines "host [slots=N]" (# comments)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise StartupRefusal(f"--hostfile {path}: {e.strerror or e}") from None
    if text.lstrip().startswith("["):
        try:
            entries = json.loads(text)
            return [str(e["ssh"]) for e in entries]
        except (ValueError, KeyError, TypeError):
            raise StartupRefusal(f"--hostfile {path}: not MLX's hostfile JSON (a list of {{\"ssh\": host}})") from None
    hosts = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = next((w.partition("=")[2] for w in words[1:] if w.startswith("slots=")), "1")
        if not slots.isdigit() or int(slots) < 1:
            raise StartupRefusal(f"--hostfile {path}: bad slots in {line.strip()!r}")
        hosts += [words[0]] * int(slots)
    return hosts


def resolve_group(settings: ServerSettings, environ: Mapping[str, str]) -> None:
    """Settle this process's rank and the group's rendezvous from the flags and the launcher's
    environment; refuse what a group cannot serve."""
    g = settings.distributed
    if not g.active:
        idle = GroupSpec()
        for flag, given in (("--hostfile", g.hostfile is not None), ("--dist-timeout", g.timeout_s != idle.timeout_s),
                            ("--dist-transport", g.transport != idle.transport)):
            if given:
                raise StartupRefusal(f"{flag} configures a distributed group, and this server is one process: add "
                                     "--tp-size N or --pp-size N, or drop it")
        return
    refuse_for_group(settings)
    if g.hostfile is not None:
        hosts = read_hostfile(g.hostfile)
        if len(hosts) < g.world:
            raise StartupRefusal(f"--hostfile {g.hostfile} lists {len(hosts)} rank slot(s); --tp-size {g.tp_size} x "
                                 f"--pp-size {g.pp_size} needs {g.world}")
        g.hosts = tuple(hosts[:g.world])
    if "MLX_RANK" in environ and "RANK" not in environ:  # mlx.launch: MLX reads its hostfile itself
        g.launch, g.rank = LAUNCH_MLX, _env_int(environ, "MLX_RANK")
        if not 0 <= g.rank < g.world:
            raise StartupRefusal(f"mlx.launch's MLX_RANK={g.rank} does not fit --tp-size {g.tp_size} x --pp-size "
                                 f"{g.pp_size} = {g.world} ranks")
        return
    if "RANK" in environ:
        g.launch = LAUNCH_ENV
        g.rank = _env_int(environ, "RANK")
        g.local_rank = _env_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else g.rank
        world = _env_int(environ, "WORLD_SIZE") if "WORLD_SIZE" in environ else g.world
        if world != g.world or not 0 <= g.rank < world:
            raise StartupRefusal(f"the launcher's WORLD_SIZE={world} RANK={g.rank} does not fit --tp-size {g.tp_size} "
                                 f"x --pp-size {g.pp_size} = {g.world} ranks")
        g.launcher_store = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        g.master_addr = environ.get("MASTER_ADDR", g.master_addr)
        g.master_port = _env_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else g.master_port
        return
    g.launch, g.rank = LAUNCH_SPAWN, 0
    remote = [h for h in g.hosts if h not in LOCAL_HOSTS]
    g.master_addr = environ.get("MASTER_ADDR") or (g.hosts[0] if remote else "127.0.0.1")
    g.master_port = _env_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else _free_port(g.master_addr)


def _env_int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise StartupRefusal(f"{name}={environ[name]!r}: expected an integer") from None


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind(("" if addr not in LOCAL_HOSTS else addr, 0))
        return s.getsockname()[1]


def refuse_for_group(settings: ServerSettings) -> None:
    """What one process serves and a group does not (yet): one line naming the flag each."""
    g = settings.distributed
    given = f"--tp-size {g.tp_size} / --pp-size {g.pp_size}"
    checks = [
        (bool(settings.lora.adapters), "--lora / --lora-scaled"),
        (settings.engine.sleep_idle_seconds >= 0, "--sleep-idle-seconds"),
        (bool(settings.spec.draft_model or settings.spec.draft_hf or settings.spec.type), "speculative decoding"),
        (settings.router.models_dir is not None or settings.router.models_preset is not None, "router mode"),
        (settings.workers.embedding or settings.workers.reranking, "--embeddings / --reranking"),
        (settings.backend.torch_compile, "--torch-compile"),
    ]
    for bad, what in checks:
        if bad:
            raise StartupRefusal(f"{what} is not served by a distributed group ({given}); drop one of them")


def refuse_checkpoint_for_group(settings: ServerSettings, path: Path | None) -> None:
    """What the group's checkpoint must be: a generation model without a media tower."""
    from mlxcel.models.vision import is_vision_checkpoint

    g = settings.distributed
    given = f"--tp-size {g.tp_size} / --pp-size {g.pp_size}"
    if path is None:
        raise StartupRefusal(f"a side-worker model (Whisper, Kokoro, --embeddings / --reranking) is not served by a "
                             f"distributed group ({given}); serve it on one process")
    if is_vision_checkpoint(path):
        raise StartupRefusal(f"{path.name} is a vision-language checkpoint, which a distributed group ({given}) does "
                             "not serve (the ranks carry no images); serve it on one process")


def spawn_ranks(settings: ServerSettings, argv: list[str], environ: Mapping[str, str]) -> list[subprocess.Popen]:
    """Rank 0 starting ranks 1..N-1 with its own arguments: here, or by ssh on their --hostfile host."""
    g = settings.distributed
    children = []
    for rank in range(1, g.world):
        host = g.hosts[rank] if g.hosts else "localhost"
        local = sum(1 for h in g.hosts[:rank] if h == host) if g.hosts else rank
        env = {"RANK": str(rank), "WORLD_SIZE": str(g.world), "LOCAL_RANK": str(local),
               "MASTER_ADDR": g.master_addr, "MASTER_PORT": str(g.master_port)}
        cmd = [sys.executable, "-m", "mlxcel.cli.server", *argv]
        if host in LOCAL_HOSTS:
            children.append(subprocess.Popen(cmd, env={**environ, **env}))
        else:  # the same interpreter path and arguments on the other host (docs/distributed.md)
            remote = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd)
            children.append(subprocess.Popen(["ssh", host, f"cd {shlex.quote(os.getcwd())} && {remote}"]))
        log.info("started rank %d of %d on %s (pid %d)", rank, g.world, host, children[-1].pid)
    return children


def failure_exit(children: list[subprocess.Popen]) -> Callable[[str], None]:
    """Rank 0's reaction to a lost rank: requests already get 503; exit shortly after. The ranks it
    started are killed first: a step still blocked in a collective on a silent rank (MLX's have no
    timeout of their own) then fails as their sockets close, so its requests get their 503 too."""
    def fail(reason: str) -> None:
        for c in children:
            c.kill()

        def later() -> None:
            time.sleep(EXIT_GRACE_S)
            log.error("exiting: %s", reason)
            end_ranks(children, 0)
            logging.shutdown()
            os._exit(GROUP_FAILED)

        threading.Thread(target=later, name="mlxcel-group-exit", daemon=True).start()

    return fail


def end_ranks(children: list[subprocess.Popen], wait_s: float) -> None:
    """The ranks this process started: give them `wait_s` to leave on their own, then end them."""
    deadline = time.monotonic() + wait_s
    for c in children:
        try:
            c.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            c.terminate()


def lead(settings: ServerSettings, startup, argv: list[str], environ: Mapping[str, str]):
    """Rank 0: start the other ranks where this command launches them; the startup with the exit
    on failure, and the children to end at exit."""
    children = spawn_ranks(settings, argv, environ) if settings.distributed.launch == LAUNCH_SPAWN else []
    return replace(startup, on_group_failure=failure_exit(children)), children


def follow(settings: ServerSettings, path: Path, startup) -> int:
    """A rank other than 0: its whole life, ending the process: 0 when rank 0 stopped the group, 1 on
    a failure. The exit skips the interpreter's teardown, which took seconds here after a torch
    shard served (nothing is left to flush but the log), so the group's exit stays prompt."""
    code = _follow(settings, path, startup)
    logging.shutdown()
    os._exit(code)


def _follow(settings: ServerSettings, path: Path, startup) -> int:
    from mlxcel.runtime.group import run_follower

    rank = settings.distributed.rank
    try:
        reason = run_follower(settings, path, startup.placement)
    except StartupRefusal:
        raise
    except Exception as e:  # noqa: BLE001 - rank 0 gone, a timeout, a mismatch: said once, then exit
        log.error("rank %d leaves the group: %s", rank, e)
        return 1
    log.info("rank %d stopped: %s", rank, reason)
    return 0
