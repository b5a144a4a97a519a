"""Converting a GGUF file or a HuggingFace checkpoint into an MLX checkpoint in the store.

The output is what an mlx-community snapshot looks like: config.json (with the top-level
rope keys mlx-lm reads), model.safetensors in the requested dtype, optionally affine-quantized
with a `"quantization": {"group_size", "bits"}` block, and the source's tokenizer files. A GGUF's
quantized tensors keep their bits (store/gguf_quant.py): per-module entries in that block name
the ones packed in another form than its default, as mlx-lm writes mixed precision. It is
built in a staging directory under the store root and renamed into `<root>/<owner>/<name>` in
one step, so a half-written conversion never shows up as a model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from mlxcel.config.progress import Progress
from mlxcel.models.checkpoint_config import ConfigRefused, mlx_overrides, normalize_config
from mlxcel.models.registry import family_for, mlx_module
from mlxcel.store.repo_id import parse_repo_id

log = logging.getLogger("mlxcel.store")

DTYPES = ("bfloat16", "float16", "float32")
Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)

# Files that describe weights or the architecture; everything else in a checkpoint directory
# (tokenizer, chat template, generation config, license) is copied verbatim.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
_NOT_COPIED_NAMES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


class ConversionError(ValueError):
    """The source or the options cannot produce a checkpoint; the message says why."""


def checked_config(raw: dict) -> dict:
    """The normalised config (models/checkpoint_config.py) a conversion writes; one whose
    family needs a RoPE base it does not state is refused rather than written with a default."""
    try:
        mlx_overrides(raw)  # refuses what mlx-lm could not build as written
    except ConfigRefused as e:
        raise ConversionError(str(e)) from None
    config = normalize_config(raw)
    if "rope_theta" not in config and config.get("model_type") in ("llama", "qwen2", "qwen3"):
        raise ConversionError("config.json has no rope_theta (top-level or in rope_parameters)")
    return config


def _check_options(dtype: str, quantize: bool, q_bits: int, q_group_size: int) -> None:
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if quantize and q_bits not in Q_BITS:
        raise ConversionError(f"--q-bits {q_bits} is not supported; use 4 or 8")
    if quantize and q_group_size not in Q_GROUP_SIZES:
        raise ConversionError(f"--q-group-size {q_group_size} is not one of 32, 64, 128")


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in _NOT_COPIED_NAMES and not f.name.endswith(_NOT_COPIED_SUFFIXES):
            shutil.copy2(f, dst / f.name)


def hf_to_mlx(
    src: Path,
    out: Path,
    *,
    dtype: str = "bfloat16",
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    progress: Progress | None = None,
    packed_source: bool = False,
) -> dict:
    """Write an MLX checkpoint for the HF checkpoint directory `src` into `out`; return its config.
    `progress` advances one step per stage (n_stages(quantize) of them). `packed_source`: `src`
    is a GGUF's conversion whose quantized weights are already in MLX's affine layout; they are
    kept as they are, scales and biases in the dtype that holds them exactly."""
    _check_options(dtype, quantize, q_bits, q_group_size)
    if not (src / "config.json").is_file():
        raise ConversionError(f"{src} is not a checkpoint directory: it has no config.json")
    raw = json.loads((src / "config.json").read_text())
    if (raw.get("quantization") and not packed_source) or raw.get("quantization_config"):
        raise ConversionError(f"{src} is already quantized; convert from an unquantized checkpoint")
    family_for(raw)  # refuses an unsupported model_type with the supported list
    config = checked_config(raw)
    step = _stepper(progress)
    step(f"reading {raw.get('model_type')} weights")  # before the imports: they alone take seconds
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    def classes(config: dict):
        module = mlx_module(config)
        return module.Model, module.ModelArgs

    if packed_source and not _keep_what_mlx_takes(src, config):
        packed_source = False
        config.pop("quantization", None)
    # built from the keys in the forms mlx-lm reads (EXAONE 4's layer pattern as a string)
    model, config = load_model(src, lazy=True, model_config={**config, **mlx_overrides(raw)},
                               get_model_classes=classes)
    step(f"casting to {dtype}")
    target = getattr(mx, dtype)
    model.update(tree_map_with_path(
        lambda path, v: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and not _packed_param(path) else v,
        model.parameters()))
    config["torch_dtype"] = dtype
    config.pop("dtype", None)
    if packed_source:
        config["quantization"] = _per_layer_quantization(model, config["quantization"])
    if quantize:
        step(f"quantizing to {q_bits} bits")
        model, config = quantize_model(model, config, q_group_size, q_bits)
    step("computing and writing the weights")  # MLX is lazy: the work above happens here
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model, donate_model=True)
    _copy_side_files(src, out)
    save_config(config, out / "config.json")
    return config


def _keep_what_mlx_takes(src: Path, config: dict) -> bool:
    """Dequantize, in the staged GGUF conversion `src`, each packed weight the mlx-lm model cannot
    take packed (its `sanitize` reshapes or renames it away from a quantizable layer, as Granite
    MoE's fused experts); say which. Returns whether any stays packed."""
    import mlx.core as mx

    files = sorted(src.glob("*.safetensors"))
    weights = {k: v for f in files for k, v in mx.load(str(f)).items()}
    stems = {k.removesuffix(".scales") for k in weights if k.endswith(".scales")}
    module = mlx_module(config)
    model = module.Model(module.ModelArgs.from_dict(config))
    sanitized = model.sanitize(dict(weights)) if hasattr(model, "sanitize") else weights
    modules = dict(model.named_modules())
    refused = set()
    for stem in (k.removesuffix(".scales") for k in sanitized if k.endswith(".scales")):
        m, w, s = modules.get(stem), sanitized.get(f"{stem}.weight"), sanitized[f"{stem}.scales"]
        dense = getattr(m, "weight", None)
        fits = (hasattr(m, "to_quantized") and w is not None and dense is not None
                and w.shape[:-1] == dense.shape[:-1] == s.shape[:-1]
                and dense.shape[-1] == 32 * s.shape[-1] and (w.shape[-1] * 32) % dense.shape[-1] == 0)
        if not fits:
            refused.add(stem)
    if not refused:
        return True
    # a refused name the sanitizer made up has no source tensor to dequantize: dequantize them all
    undo = refused if refused <= stems else stems
    for stem in sorted(undo):
        w, s, b = weights.pop(f"{stem}.weight"), weights.pop(f"{stem}.scales"), weights.pop(f"{stem}.biases")
        weights[f"{stem}.weight"] = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32,
                                                  bits=w.shape[-1] * 32 // (32 * s.shape[-1]))
    shown = ", ".join(sorted(undo)[:4]) + (f", ... ({len(undo) - 4} more)" if len(undo) > 4 else "")
    log.warning("GGUF: dequantized %d packed tensor(s): mlx-lm's %s model does not load them as quantized "
                "layers (%s)", len(undo), config.get("model_type"), shown)
    mx.eval(list(weights.values()))  # read in full before the file they come from is replaced
    for f in files:
        f.unlink()
    mx.save_safetensors(str(src / "model.safetensors"), weights, metadata={"format": "pt"})
    return undo != stems


def _packed_param(path: str) -> bool:
    # an affine-quantized module's scales and biases (a plain bias is `bias`)
    return path.endswith((".scales", ".biases"))


def _per_layer_quantization(model, default: dict) -> dict:
    """The `quantization` block as mlx-lm writes it for mixed precision: the default form, and an
    entry for each quantized module packed in another one."""
    out = {"group_size": default["group_size"], "bits": default["bits"], "mode": "affine"}
    for path, module in model.named_modules():
        bits, group = getattr(module, "bits", None), getattr(module, "group_size", None)
        if bits is not None and (bits, group) != (out["bits"], out["group_size"]):
            out[path] = {"group_size": group, "bits": bits, "mode": "affine"}
    default = {k: v for k, v in out.items() if not isinstance(v, dict)}
    return {**default, **{k: out[k] for k in sorted(out) if k not in default}}


def n_stages(quantize: bool, gguf: bool = False) -> int:
    return 3 + int(quantize) + int(gguf)


def _stepper(progress: Progress | None):
    started = False

    def step(text: str) -> None:
        nonlocal started
        if progress is None:
            return
        if started:
            progress.update()
        started = True
        progress.stage(text)

    return step


def convert(
    src: Path,
    root: Path,
    repo_id: str,
    *,
    dtype: str = "bfloat16",
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    force: bool = False,
    dequantize: bool = False,
) -> Path:
    """Convert `src` (a .gguf file or an HF checkpoint dir) into `<root>/<repo_id>`; return that path.
    A GGUF's quantized tensors stay packed where MLX's affine format holds them exactly, unless
    `dequantize` or `quantize` (a requantization) asks for dense weights first."""
    from mlxcel.store.gguf_source import gguf_to_hf

    owner, name = parse_repo_id(repo_id)
    src = Path(src).expanduser()
    if not src.exists():
        raise ConversionError(f"{src} does not exist")
    is_gguf = src.is_file() and src.suffix.lower() == ".gguf"
    if not is_gguf and not src.is_dir():
        raise ConversionError(f"{src} is neither a .gguf file nor a checkpoint directory")
    _check_options(dtype, quantize, q_bits, q_group_size)
    target = root / owner / name
    if target.exists() and not force:
        raise ConversionError(f"{target} already exists; remove it first (mlxcel rm {owner}/{name}) or pass --force")
    staging_root = root / ".staging"
    staging_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=staging_root))
    try:
        with Progress(f"converting {src.name}", total=n_stages(quantize, is_gguf), unit="step") as bar:
            hf_dir = src
            if is_gguf:
                hf_dir = staging / "hf"
                bar.stage("reading the GGUF file")
                # quantized tensors stay as the file has them unless a requantization was asked for
                config = gguf_to_hf(src, hf_dir, keep_quantized=not (quantize or dequantize))
                bar.update()
            built = staging / "mlx"
            hf_to_mlx(hf_dir, built, dtype=dtype, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size,
                      progress=bar, packed_source=is_gguf and "quantization" in config)
            bar.update()
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(built, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging_root.rmdir()  # only when no other conversion is using it
        except OSError:
            pass
    return target
