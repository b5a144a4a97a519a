"""The torch side of a distributed group: torch.distributed as the Collective, and a rank's shard.

Transport: gloo on the CPU; NCCL for the tensors when the shard sits on CUDA, with a gloo group
beside it for the plans (bytes on the host). Ranks meet at MASTER_ADDR:MASTER_PORT over TCP
(torchrun's conventions, resolved by the CLI into GroupSpec).

Tensor parallel (`--tp-size`): each decoder layer's attention keeps whole key/value heads and the
query heads that read them (q/k/v column-parallel: their output rows sliced), o_proj keeps the
matching input columns (row-parallel), and the MLP's gate/up keep a slice of the intermediate
columns, down_proj the matching input columns; each row-parallel output is summed over the
tensor-parallel group (one all-reduce after attention, one after the MLP), and its bias is kept
on the group's first rank only, so the sum adds it once. The embeddings, norms and LM head are
replicated, so every rank computes the same logits and rank 0 needs nothing sent back. The KV
pool of a rank holds its own heads only. Families are sharded by an explicit table of their
projection names; any other family is refused by name.

Pipeline parallel (`--pp-size`): a stage keeps a contiguous range of decoder layers; the others
are replaced by pass-through layers that hold nothing. The stage's first layer takes its input
from the previous stage (a pre-hook receives it), its last layer's output goes to the next stage,
and the last stage sends the final norm's output to the first stage, whose own final norm output
is replaced by it: rank 0's forward, forward_all and hidden_states then read the whole model's
result unchanged. Only stage 0 keeps the embeddings and the LM head (later stages embed to zeros
and have a one-column head: their results are never read). One step's rows go through the stages
as one batch; stages do not overlap steps (no micro-batches yet).

The full checkpoint is read on every rank before the shard is cut from it, so a rank's peak
memory at load is the whole model's; once serving it holds its shard.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mlxcel.backends.distributed import (Collective, GroupRefused, ShardOptions, column_split, head_split,
                                         stage_layers)
from mlxcel.backends.torch.backend import TorchBackend
from mlxcel.config.distributed import GroupSpec
from mlxcel.engine.backend import KVSpec

log = logging.getLogger("mlxcel.backend.torch")


class TorchCollective:
    """torch.distributed over one process group (gloo, or NCCL for CUDA tensors); `all_sum` is
    over this rank's tensor-parallel group (the ranks of its pipeline stage)."""

    def __init__(self, spec: GroupSpec, device: str = "cpu") -> None:
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        cuda = device.startswith("cuda")
        if cuda:  # NCCL binds a rank to the current device
            torch.cuda.set_device(torch.device(device))
        backend = spec.transport if spec.transport not in ("auto", "") else ("nccl" if cuda else "gloo")
        if backend not in ("gloo", "nccl"):
            raise GroupRefused(f"--dist-transport {backend}: the torch backend's transports are gloo and nccl")
        # the rendezvous: rank 0 serves the store unless the launcher (torchrun's agent) does;
        # mlxcel's keys live under their own prefix in it
        store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world,
                              is_master=spec.rank == 0 and not spec.launcher_store, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore("mlxcel", store), rank=spec.rank,
                                world_size=spec.world, timeout=timeout)
        self.rank, self.size = spec.rank, spec.world
        # the plans are bytes on the host: gloo carries them whatever moves the tensors
        self._host = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        self._tp = None
        for stage in range(spec.pp_size):  # every rank makes every group, in the same order
            ranks = [spec.rank_of(stage, t) for t in range(spec.tp_size)]
            group = dist.new_group(ranks, timeout=timeout) if spec.tp_size > 1 else None
            if stage == spec.stage:
                self._tp = group
        self.tp_size = spec.tp_size

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(n, 0, group=self._host)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None and len(data)
               else torch.empty(int(n.item()), dtype=torch.uint8))
        if int(n.item()):
            dist.broadcast(buf, 0, group=self._host)
        return bytes(buf.numpy()) if data is None else data

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self._host)
        return [bytes(t.numpy()) for t in out]

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self._tp)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        dist.send(x.contiguous(), dst)

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        out = torch.empty_like(like)
        dist.recv(out, src)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self._host)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def connect(spec: GroupSpec, device: str = "cpu") -> TorchCollective:
    return TorchCollective(spec, device)


@dataclass(frozen=True)
class TPLayout:
    """A family's projection names: attention q/k/v (column) and o (row); MLP inputs (column) and
    output (row)."""

    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    mlp_in: tuple[str, ...] = ("gate_proj", "up_proj")
    mlp_out: str = "down_proj"


DENSE = TPLayout()
# families whose attention splits by head with nothing mixing the heads (per-head q/k norms are
# fine, a norm over all heads is not: OLMo 2's), and whose MLP is one dense block
TP_FAMILIES: dict[str, TPLayout] = {
    "llama": DENSE, "mistral": DENSE, "qwen2": DENSE, "qwen3": DENSE, "gemma": DENSE, "gemma2": DENSE,
    "granite": DENSE, "helium": DENSE, "smollm3": DENSE,
    "starcoder2": TPLayout(mlp_in=("c_fc",), mlp_out="c_proj"),
}


def _rows(linear: nn.Linear, keep: slice) -> None:
    """Keep output rows `keep` (column-parallel)."""
    linear.weight = nn.Parameter(linear.weight.data[keep].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[keep].contiguous(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _columns(linear: nn.Linear, keep: slice, bias: bool) -> None:
    """Keep input columns `keep` (row-parallel); the bias only where `bias` (the sum adds it once)."""
    linear.weight = nn.Parameter(linear.weight.data[:, keep].contiguous(), requires_grad=False)
    if linear.bias is not None and not bias:
        linear.bias = None
    linear.in_features = linear.weight.shape[1]


def _summed(collective: Collective):
    def hook(module, args, output):
        return collective.all_sum(output)

    return hook


def shard_tensor_parallel(model, layers, spec: GroupSpec, collective: Collective) -> None:
    config = model.config.get_text_config()
    family = config.model_type
    layout = TP_FAMILIES.get(family)
    if layout is None:
        raise GroupRefused(f"--tp-size {spec.tp_size}: the torch backend does not shard the {family} family "
                           f"(it shards {', '.join(sorted(TP_FAMILIES))}); serve it with --pp-size instead")
    heads = head_split(family, config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads,
                       spec.tp_size, spec.tp_rank)
    first = spec.tp_rank == 0
    for layer in layers:
        if not hasattr(layer, "self_attn"):  # another stage's pass-through layer
            continue
        attn, mlp = layer.self_attn, layer.mlp
        hd = attn.head_dim
        q = slice(heads.q_heads.start * hd, heads.q_heads.stop * hd)
        kv = slice(heads.kv_heads.start * hd, heads.kv_heads.stop * hd)
        _rows(getattr(attn, layout.q), q)
        _rows(getattr(attn, layout.k), kv)
        _rows(getattr(attn, layout.v), kv)
        o = getattr(attn, layout.o)
        _columns(o, q, first)
        o.register_forward_hook(_summed(collective))
        width = getattr(mlp, layout.mlp_in[0]).out_features
        cols = column_split(width, spec.tp_size, spec.tp_rank)
        for name in layout.mlp_in:
            _rows(getattr(mlp, name), slice(cols.start, cols.stop))
        down = getattr(mlp, layout.mlp_out)
        _columns(down, slice(cols.start, cols.stop), first)
        down.register_forward_hook(_summed(collective))


class PassLayer(nn.Module):
    """A decoder layer another pipeline stage owns: the hidden state passes through untouched.
    It keeps the attributes a family's layer loop reads off its layers (the mask it takes)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        if hasattr(layer, "attention_type"):
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class ZeroEmbedding(nn.Module):
    """A later stage's embeddings: its first layer's input comes from the previous stage."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.width, self.dtype = width, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((*ids.shape, self.width), dtype=self.dtype, device=ids.device)


def shard_pipeline(model, base, layers, spec: GroupSpec, collective: Collective) -> range:
    """Cut this rank's stage out of the decoder stack and wire the activations; its layer range."""
    if not all(hasattr(base, name) for name in ("embed_tokens", "norm")):
        raise GroupRefused(f"--pp-size {spec.pp_size}: the torch backend splits decoder stacks with embed_tokens, "
                           f"layers and norm, which {model.config.model_type} does not have")
    own = stage_layers(len(layers), spec.pp_size, spec.stage)
    for i in range(len(layers)):
        if i not in own:
            layers[i] = PassLayer(layers[i])
    last = spec.pp_size - 1
    prev, nxt = spec.rank_of(spec.stage - 1, spec.tp_rank), spec.rank_of(spec.stage + 1, spec.tp_rank)
    head = spec.rank_of(0, spec.tp_rank)
    if spec.stage > 0:
        width = model.config.get_text_config().hidden_size
        base.embed_tokens = ZeroEmbedding(width, next(layers[own.start].parameters()).dtype)
        model.set_output_embeddings(nn.Linear(width, 1, bias=False, dtype=base.embed_tokens.dtype))

        def take(module, args, kwargs):
            if args:
                return (collective.recv(args[0], prev), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": collective.recv(kwargs["hidden_states"], prev)}

        layers[own.start].register_forward_pre_hook(take, with_kwargs=True)
    if spec.stage < last:
        layers[own.stop - 1].register_forward_hook(lambda m, a, out: collective.send(out, nxt))
    if spec.stage == last:
        base.norm.register_forward_hook(lambda m, a, out: collective.send(out, head))
    if spec.stage == 0:
        base.norm.register_forward_hook(lambda m, a, out: collective.recv(out, spec.rank_of(last, spec.tp_rank)))
    return own


class TorchShard(TorchBackend):
    """One rank's shard of a torch model (module docstring): the single-process backend, with the
    weights cut right after they load, before its kernels bind to them."""

    def __init__(self, path: Path, spec: GroupSpec, collective: Collective, options: ShardOptions) -> None:
        self.spec, self.collective = spec, collective
        self.owned = range(0)
        self.kv_share: tuple[int, int] = (1, 1)  # (this rank's KV heads, the model's)
        if options.compile:
            raise GroupRefused("--torch-compile: the distributed shards' collectives run in hooks a compiled graph "
                               "would trace; drop --torch-compile with --tp-size / --pp-size")
        super().__init__(path, dtype=options.dtype, device=options.device, threads=options.threads,
                         rope=options.rope, compile=False, build_env=options.build_env, kv_cache=options.kv_cache)
        if self.recurrent:
            raise GroupRefused(f"{self.info.model_type}: its recurrent layers keep per-sequence state the distributed "
                               "shards do not split; serve it on one process")

    def _load_model(self, path: Path, dtype: torch.dtype, extra: dict):
        model = super()._load_model(path, dtype, extra)
        if self._quantized:
            raise GroupRefused("a quantized checkpoint is not sharded by the torch backend; serve the unquantized "
                               "checkpoint with --tp-size / --pp-size")
        base = self._decoder_stack(model)
        if not hasattr(base, "layers"):
            raise GroupRefused(f"{model.config.model_type}: no decoder layer list to shard")
        layers = base.layers
        self.owned = range(len(layers))
        if self.spec.pp_size > 1:
            self.owned = shard_pipeline(model, base, layers, self.spec, self.collective)
        if self.spec.tp_size > 1:
            config = model.config.get_text_config()
            n_kv = config.num_key_value_heads or config.num_attention_heads
            split = head_split(config.model_type, config.num_attention_heads, n_kv, self.spec.tp_size,
                               self.spec.tp_rank)
            self.kv_share = (len(split.kv_heads), n_kv)
            shard_tensor_parallel(model, layers, self.spec, self.collective)
        return model

    def attach_lora(self, adapters) -> None:
        raise GroupRefused("LoRA adapters are not served across a distributed group (--tp-size / --pp-size); serve "
                           "them on one process")

    @property
    def kv_spec(self) -> KVSpec:
        """This rank's share: its layers, and of those its KV heads."""
        full = super().kv_spec
        mine, heads = self.kv_share
        return KVSpec(tuple(replace(layer, bytes_per_token=layer.bytes_per_token * mine // heads if i in self.owned
                                    else 0) for i, layer in enumerate(full.layers)))


def load_shard(path: Path, spec: GroupSpec, collective: Collective, options: ShardOptions) -> TorchShard:
    return TorchShard(Path(path), spec, collective, options)

