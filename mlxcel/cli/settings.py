"""The resolved server configuration: built once from argv and the environment.

This is the one place configuration lands; nothing below the CLI reads `os.environ`.
Fields carry mlxcel's own names; the b10621 flag surface (flags.py) fills them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ServerSettings:
    # model source
    model: str | None = None
    model_store_root: Path | None = None
    default_org: str = "mlx-community"
    offline: bool = False
    hf_token: str | None = None
    alias: list[str] = field(default_factory=list)
    # serving
    host: str = "127.0.0.1"
    port: int = 8080
    ctx_size: int = 0  # 0 = the model's own context length
    n_predict: int = -1  # -1 = until the context is full
    parallel: int = 4
    batch_size: int = 512
    dtype: str = "auto"
    backend: str = "mlx"
    warmup: bool = True
    # sampling defaults (None = the checkpoint's generation_config.json, else the b10621 default)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int = -1
    # process
    api_keys: list[str] = field(default_factory=list)
    timeout: int = 3600
    verbose: bool = False
    # native llama-server endpoints (b10621: --metrics, --slots/--no-slots, --props, --spm-infill,
    # --slot-save-path)
    metrics: bool = False
    slots: bool = True
    props: bool = False
    spm_infill: bool = False
    slot_save_path: Path | None = None
