"""mlxcel's options for serving one model from a distributed group (docs/distributed.md)."""

from __future__ import annotations

from mlxcel.cli import options_apply as a
from mlxcel.cli.options_model import SUPPORTED, VALUE, Option, make
from mlxcel.cli.options_native import NATIVE
from mlxcel.config.refusal import StartupRefusal


def _size(path: str):
    def apply(settings, value, spelling) -> None:
        n = a.as_int(value, spelling)
        if n < 1:
            raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected 1 or more ranks)")
        a.assign(settings, path, n)

    return apply


def _timeout(settings, value, spelling) -> None:
    t = a.as_float(value, spelling)
    if not t > 0:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected seconds > 0)")
    a.assign(settings, "distributed.timeout_s", t)


GROUP_OPTIONS: tuple[Option, ...] = (
    make("--tp-size", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="N", apply=_size("distributed.tp_size"),
         help="tensor parallel: split every layer's attention heads and MLP columns over N ranks, each holding 1/N "
              "of the weights and KV (default: 1); rank 0 serves HTTP. Without a launcher's RANK in the environment "
              "this command starts the other ranks itself (docs/distributed.md)"),
    make("--pp-size", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="N", apply=_size("distributed.pp_size"),
         help="pipeline parallel: split the layers into N contiguous stages, one rank each (default: 1); combines "
              "with --tp-size for tp x pp ranks"),
    make("--hostfile", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="FILE",
         apply=a.setter("distributed.hostfile", "path"), path_value=True,
         help="the hosts a --tp-size / --pp-size group starts on, in rank order: MLX's JSON hostfile "
              "([{\"ssh\": host, \"ips\": [...]}]) or one host per line (\"host slots=N\"); other hosts are "
              "reached by ssh (default: every rank on this host)"),
    make("--dist-timeout", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="SECONDS", apply=_timeout,
         help="a distributed group's collective waiting longer than this fails the group: rank 0 answers 503 and "
              "every rank exits (default: 60)"),
    make("--dist-transport", VALUE, section=NATIVE, state=SUPPORTED, native=True,
         mv="{auto,gloo,nccl,ring,mpi,jaccl}",
         apply=lambda s, v, sp: a.assign(s, "distributed.transport",
                                         a.one_of(v, sp, ("auto", "gloo", "nccl", "ring", "mpi", "jaccl"))),
         help="the group's transport: torch's gloo (CPU) or nccl (CUDA), MLX's ring, mpi or jaccl (default: auto, "
              "gloo or nccl on torch by device, ring on MLX)"),
)
