"""Loading a model as a distributed group (--tp-size / --pp-size): rank 0's backend, and the
life of every other rank.

Every rank runs the same steps in the same order: join the group over the chosen backend's
runtime (`connect`), load its shard (`load_shard`), then agree with the others on the checkpoint
and settings (backends/group.join, which refuses a mismatch on every rank). Rank 0 then wraps its
shard in a GroupBackend the engine drives; every other rank follows rank 0's plans until told to
stop or until rank 0 is gone (backends/group.follow). Which runtime: the backend's own module,
mlxcel.backends.torch.distributed or mlxcel.backends.mlx.distributed (backends/distributed.py
names the two functions each provides).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from mlxcel.backends import select
from mlxcel.backends.distributed import Collective, GroupRefused, ShardOptions, fingerprint
from mlxcel.backends.group import GroupBackend, follow, join
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import ServerSettings
from mlxcel.engine.backend import Backend, KVCacheTypes

log = logging.getLogger("mlxcel.group")


def rank_device(device: str, local_rank: int, count: int) -> str:
    """A rank's own CUDA device: the host's ranks take its GPUs in turn (one each where there are
    enough); any other device is every rank's."""
    if not device.startswith("cuda") or count < 1:
        return device
    return f"cuda:{local_rank % count}"


def shard_options(settings: ServerSettings, choice: select.Choice, cuda_count: int = 0) -> ShardOptions:
    b = settings.backend
    device = rank_device(choice.device, settings.distributed.local_rank, cuda_count)
    return ShardOptions(dtype=b.dtype, device=device, threads=b.threads, rope=b.rope,
                        kv_cache=KVCacheTypes(settings.kv.cache_type_k, settings.kv.cache_type_v),
                        build_env=b.build_env, compile=b.torch_compile)


def group_fingerprint(settings: ServerSettings, path: Path, choice: select.Choice) -> bytes:
    """What the ranks compare: the checkpoint (backends/distributed.fingerprint) and every setting
    that shapes a rank's forward."""
    b, g = settings.backend, settings.distributed
    shaping = {"backend": choice.backend, "device_kind": choice.device.partition(":")[0], "dtype": b.dtype,
               "kv": [settings.kv.cache_type_k, settings.kv.cache_type_v], "rope": repr(b.rope),
               "tp": g.tp_size, "pp": g.pp_size}
    return fingerprint(Path(path), shaping)


def _shard(settings: ServerSettings, path: Path, choice: select.Choice) -> tuple[Collective, Backend]:
    spec = settings.distributed
    options = shard_options(settings, choice)
    if choice.backend == "torch":
        from mlxcel.backends.torch import distributed as runtime

        options = shard_options(settings, choice, runtime.cuda_count())
    else:
        try:
            from mlxcel.backends.mlx import distributed as runtime
        except ImportError:
            raise StartupRefusal("--tp-size / --pp-size: the MLX backend's distributed shards are not available in "
                                 "this build; use --backend torch") from None
    try:
        collective = runtime.connect(spec, options.device)
    except GroupRefused as e:
        raise StartupRefusal(str(e)) from None
    try:
        return collective, runtime.load_shard(path, spec, collective, options)
    except GroupRefused as e:
        collective.close()
        raise StartupRefusal(str(e)) from None


def load_group_backend(settings: ServerSettings, path: Path, choice: select.Choice,
                       on_failure: Callable[[str], None]) -> GroupBackend:
    """Rank 0: its shard behind a GroupBackend, once every rank has joined and agreed. A group
    that cannot form (a refusal, a rank missing or disagreeing) ends the process like a lost rank:
    the other ranks cannot serve without rank 0."""
    spec = settings.distributed
    try:
        collective, local = _shard(settings, path, choice)
        sizes = join(local, collective, group_fingerprint(settings, path, choice))
    except (Exception, StartupRefusal) as e:  # a refusal (a SystemExit) would only end the load thread
        on_failure(f"the distributed group did not form: {getattr(e, 'message', None) or e}")
        raise
    log.info("distributed group ready: %d ranks (tp %d x pp %d) over %s; weights per rank: %s", spec.world,
             spec.tp_size, spec.pp_size, choice.backend, ", ".join(f"{s.weight_bytes / 2**20:.1f} MiB" for s in sizes))
    return GroupBackend(local, collective, spec, sizes, on_failure)


def run_follower(settings: ServerSettings, path: Path, choice: select.Choice) -> str:
    """A rank other than 0: load, join, follow rank 0's plans; the reason it stopped."""
    collective, local = _shard(settings, path, choice)
    try:
        join(local, collective, group_fingerprint(settings, path, choice))
        log.info("rank %d of %d serving its shard", settings.distributed.rank, settings.distributed.world)
        return follow(local, collective)
    finally:
        collective.close()
