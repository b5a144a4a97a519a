"""How an honoured b10621 option lands in `ServerSettings`.

Each function takes (settings, value, spelling): `value` is the raw text (or a bool for flags
and --x/--no-x pairs), `spelling` is what the user wrote, for the diagnostic. Bad values stop
startup with one line naming the option and the value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxcel.config.refusal import StartupRefusal
from mlxcel.engine.backend import KV_CACHE_TYPES, KV_CACHE_TYPES_REFUSED, kv_mode_refusal

# --- converters ----------------------------------------------------------------------------


def as_int(value: str, spelling: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected an integer)") from None


def as_float(value: str, spelling: str) -> float:
    try:
        return float(str(value).strip())
    except ValueError:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected a number)") from None


def one_of(value: str, spelling: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected one of: {', '.join(allowed)})")
    return value


def field_path(path: str) -> str:
    """Check a "section.field" path against ServerSettings' sections (a typo in the option table
    fails at import, not when the flag is first given)."""
    from dataclasses import fields, is_dataclass

    from mlxcel.config.settings import ServerSettings

    section, _, name = path.partition(".")
    sections = {f.name: f.default_factory for f in fields(ServerSettings) if is_dataclass(f.default_factory)}
    if section not in sections or name not in {f.name for f in fields(sections[section])}:
        raise ValueError(f"no settings field {path!r}")
    return path


def assign(settings: Any, path: str, value: Any) -> None:
    """The one place an option addresses a settings field by name: `path` is "section.field"."""
    section, name = path.split(".")
    setattr(getattr(settings, section), name, value)


def setter(path: str, conv: str = "str"):
    """An apply function storing the converted value at `path` ("section.field")."""
    field_path(path)

    def apply(settings: Any, value: Any, spelling: str) -> None:
        if conv == "int":
            value = as_int(value, spelling)
        elif conv == "float":
            value = as_float(value, spelling)
        elif conv == "path":
            value = Path(value).expanduser()
        assign(settings, path, value)

    return apply


def flag_to(path: str):
    """Flags and pairs: the bool itself is the setting."""
    field_path(path)

    def apply(settings: Any, value: Any, _spelling: str) -> None:
        assign(settings, path, bool(value))

    return apply


def stored(path: str, convert):
    """An apply function storing `convert(value, spelling)` at `path`."""
    field_path(path)

    def apply(settings: Any, value: Any, spelling: str) -> None:
        assign(settings, path, convert(value, spelling))

    return apply


# --- option-specific -----------------------------------------------------------------------


def apply_device(settings: Any, value: str, spelling: str) -> None:
    """One device, in mlxcel's names or llama.cpp's (CPU, CUDA<N>, MTL0/Metal, none = CPU only)."""
    import re

    from mlxcel.backends.select import DEVICE_FORMS, BackendRefused, check_device

    text = str(value).strip()
    if "," in text:
        raise StartupRefusal(f"{spelling} {value}: mlxcel runs the whole model on one device and does not split it "
                             f"across several; name one ({DEVICE_FORMS})")
    cuda = re.fullmatch(r"CUDA(\d+)", text)
    llama_names = {"none": "cpu", "CPU": "cpu", "MTL0": "metal", "Metal": "metal"}
    text = f"cuda:{cuda.group(1)}" if cuda else llama_names.get(text, text)
    try:
        settings.backend.device = check_device(text)
    except BackendRefused:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected one of: {DEVICE_FORMS})") from None


def apply_alias(settings: Any, value: str, _spelling: str) -> None:
    # b10621 keeps aliases in a std::set and serves the first: sorted, de-duplicated.
    settings.source.alias = sorted({a.strip() for a in value.split(",") if a.strip()})


def apply_tags(settings: Any, values: list[str], _spelling: str) -> None:
    # b10621 inserts each tag into a std::set: every --tags adds to it, sorted, de-duplicated.
    settings.source.tags = sorted({t.strip() for v in values for t in v.split(",") if t.strip()})


def apply_models_max(settings: Any, value: str, spelling: str) -> None:
    n = as_int(value, spelling)
    if n < 0:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected 0 for unlimited or a positive count)")
    settings.router.models_max = n


def apply_hf_repo(settings: Any, value: str, spelling: str) -> None:
    repo = value.strip()
    if ":" in repo:
        base, quant = repo.rsplit(":", 1)
        raise StartupRefusal(
            f"{spelling} {value}: the ':{quant}' suffix selects a GGUF quantization; mlxcel loads a whole "
            f"MLX checkpoint, so name an MLX repository instead (e.g. {spelling} {base} for an MLX repo)"
        )
    settings.source.hf_repo = repo


def apply_model_url(_settings: Any, value: str, spelling: str) -> None:
    hint = ""
    marker = "huggingface.co/"
    if marker in value:
        parts = value.split(marker, 1)[1].split("/")
        if len(parts) >= 2 and parts[0] and parts[1]:
            hint = f"; for this URL use --hf-repo {parts[0]}/{parts[1]} (an MLX repository)"
    raise StartupRefusal(
        f"{spelling} {value}: mlxcel resolves models by repository id or checkpoint directory, not by URL{hint}"
    )


def apply_seed(settings: Any, value: str, spelling: str) -> None:
    # b10621 folds the seed into uint32; -1 (and 0xFFFFFFFF) means "random".
    s = as_int(value, spelling) & 0xFFFFFFFF
    settings.sampling.seed = -1 if s == 0xFFFFFFFF else s


def apply_parallel(settings: Any, value: str, spelling: str) -> None:
    n = as_int(value, spelling)
    if n == -1:
        n = 4  # b10621's auto resolves to 4 slots
    if n < 1:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected -1 for auto, or N >= 1)")
    settings.engine.parallel = n


def apply_threads_batch(settings: Any, value: str, spelling: str) -> None:
    """-tb: --threads already sets one thread count for prompt processing and generation alike,
    so a value is accepted when it asks for that: <= 0 (b10621's "same as --threads") or
    --threads' own value (the table applies -t first)."""
    n = as_int(value, spelling)
    if n > 0 and n != settings.backend.threads:
        raise StartupRefusal(f"{spelling} {value}: mlxcel's --threads sets one thread count for prompt processing "
                             f"and generation alike; pass -t {n} with it (or -tb alone only as <= 0)")


def apply_api_key(settings: Any, value: str, _spelling: str) -> None:
    keys = [k.strip() for k in value.split(",") if k.strip()]
    settings.server.api_keys.extend(k for k in keys if k not in settings.server.api_keys)
    settings.logging.secrets.extend(keys)


def apply_api_key_file(settings: Any, value: str, spelling: str) -> None:
    path = Path(value).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise StartupRefusal(f"{spelling} {value}: cannot read the API key file ({e.strerror or e})") from None
    for line in text.splitlines():
        key = line.strip()
        if key and not key.startswith("#") and key not in settings.server.api_keys:
            settings.server.api_keys.append(key)
            settings.logging.secrets.append(key)


def apply_hf_token(settings: Any, value: str, _spelling: str) -> None:
    settings.source.hf_token = value
    if value:
        settings.logging.secrets.append(value)


def apply_host(settings: Any, value: str, _spelling: str) -> None:
    settings.server.host = value
    settings.server.unix_socket = value if value.endswith(".sock") else None


def apply_port(settings: Any, value: str, spelling: str) -> None:
    port = as_int(value, spelling)
    if not 0 <= port <= 65535:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected 0..65535; 0 = any free port)")
    settings.server.port = port


def apply_static_path(settings: Any, value: str, spelling: str) -> None:
    """--path: a directory served at / in place of the built-in page ('' keeps the page)."""
    if value and not Path(value).is_dir():
        raise StartupRefusal(f"{spelling} {value!r}: not a directory")
    settings.server.static_path = value


def apply_api_prefix(settings: Any, value: str, spelling: str) -> None:
    """Taken verbatim, as b10621 does (it concatenates prefix and route). A value that cannot
    match a request path is still accepted there, so it is accepted here with a warning."""
    settings.server.api_prefix = value
    if value and (not value.startswith("/") or value.endswith("/")):
        settings.notices.append(f"{spelling} {value!r}: routes are served at {value}<route>, e.g. {value}/health; "
                                f"a prefix normally starts with '/' and has no trailing '/'")


def apply_timeout(settings: Any, value: str, spelling: str) -> None:
    t = as_int(value, spelling)
    if t < 0:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected seconds >= 0)")
    settings.server.timeout = t


def apply_ctx_size(settings: Any, value: str, spelling: str) -> None:
    n = as_int(value, spelling)
    if n < 0:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected 0 for the model's own, or N > 0)")
    settings.engine.ctx_size = n


def apply_log_colors(settings: Any, value: str, spelling: str) -> None:
    settings.logging.colors = one_of(value, spelling, ("on", "off", "auto"))


def apply_verbosity(settings: Any, value: str, spelling: str) -> None:
    settings.logging.verbosity = as_int(value, spelling)


def apply_verbose(settings: Any, value: Any, _spelling: str) -> None:
    settings.logging.verbose = bool(value)


def apply_cache_ram(settings: Any, value: str, spelling: str) -> None:
    n = as_int(value, spelling)
    if n < -1:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected MiB, -1 = no limit, 0 = disable)")
    settings.kv.cache_ram_mib = n


def apply_positive_int(path: str):
    field_path(path)

    def apply(settings: Any, value: str, spelling: str) -> None:
        n = as_int(value, spelling)
        if n < 1:
            raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected N >= 1)")
        assign(settings, path, n)

    return apply


# b10621's GGML KV types: none is mlxcel's storage except f16 (the same on both sides)
GGML_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def cache_type(path: str, modes: tuple[str, ...] = KV_CACHE_TYPES):
    """-ctk / -ctv: one of mlxcel's KV storage modes (`modes`); b10621's other GGML names are
    refused, naming the modes that exist."""
    field_path(path)

    def apply(settings: Any, value: str, spelling: str) -> None:
        if value in KV_CACHE_TYPES_REFUSED and modes == KV_CACHE_TYPES:
            raise StartupRefusal(f"{spelling} {kv_mode_refusal(value)}")
        one_of(value, spelling, tuple(dict.fromkeys(KV_CACHE_TYPES + GGML_CACHE_TYPES)))
        have = ", ".join(modes)
        if value in KV_CACHE_TYPES and value not in modes:
            raise StartupRefusal(f"{spelling} {value}: this cache holds no {value} storage; the modes are {have}")
        if value in ("f32", "bf16"):
            raise StartupRefusal(
                f"{spelling} {value}: mlxcel's KV cache stores f16 (the compute dtype) or its own quantized modes "
                f"and has no {value} storage to select; the modes are {have}"
            )
        if value not in modes:
            raise StartupRefusal(
                f"{spelling} {value}: {value} is a GGML block quantizer with no equivalent in mlxcel's KV "
                f"cache (a similar name is not the same numerics); the modes are {have}"
            )
        assign(settings, path, value)

    return apply


def apply_gpu_layers(settings: Any, value: str, spelling: str) -> None:
    if value in ("auto", "all"):
        settings.backend.gpu_layers = value
        return
    n = as_int(value, spelling)
    if n < 0:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected N >= 0, 'auto' or 'all')")
    settings.backend.gpu_layers = str(n)


def check_gpu_layers(settings: Any, num_hidden_layers: int) -> None:
    """Called once the checkpoint is known: a partial offload cannot be honoured.

    mlxcel runs every layer on the MLX device, so N >= the layer count (a full offload) is
    inert; anything smaller asks for CPU layers that do not exist here.
    """
    v = settings.backend.gpu_layers
    if v is None or v in ("auto", "all") or int(v) >= num_hidden_layers:
        return
    raise StartupRefusal(
        f"--gpu-layers {v}: the checkpoint has {num_hidden_layers} layers and mlxcel runs all of them on the "
        f"MLX device; a partial offload cannot be honoured (drop the option or pass --gpu-layers all)"
    )


# --- side workers (embedding / reranking) ----------------------------------------------------

POOLING_NONE = ("mlxcel cannot return one vector per token: every embedding family pools inside its own "
                "forward pass, so no unpooled hidden state reaches the server; use mean, cls or last")


def apply_pooling(settings: Any, value: str, spelling: str) -> None:
    """mean/cls/last pick a kernel; rank is b10621's spelling of the reranking path; none is refused."""
    value = str(value).strip()
    if value == "none":
        raise StartupRefusal(f"{spelling} none: {POOLING_NONE}")
    if value == "rank":
        settings.workers.reranking = True
        return
    settings.workers.pooling = one_of(value, spelling, ("none", "mean", "cls", "last", "rank"))


def apply_embd_normalize(settings: Any, value: str, spelling: str) -> None:
    settings.workers.embd_normalize = as_int(value, spelling)
# --- grammar defaults (--grammar, --grammar-file, --json-schema, --json-schema-file) ----


def read_text(value: str, spelling: str) -> str:
    try:
        return Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StartupRefusal(f"{spelling}: failed to open file '{value}': {e}") from None


def apply_grammar(from_file: bool):
    """GBNF is only parsed once the model's vocabulary is known (token terminals need it):
    a malformed grammar is logged at load and refuses each request that would use it."""

    def apply(settings: Any, value: str, spelling: str) -> None:
        text = read_text(value, spelling) if from_file else value
        settings.sampling.grammar = ("gbnf", text) if text else None

    return apply


def apply_json_schema(from_file: bool):
    """A schema is compiled here, before the model loads: a malformed one stops startup."""

    def apply(settings: Any, value: str, spelling: str) -> None:
        from mlxcel.engine.grammar import GrammarError, check_json_schema_text

        text = read_text(value, spelling) if from_file else value
        try:
            check_json_schema_text(text)
        except GrammarError as e:
            raise StartupRefusal(f"{spelling}: invalid JSON schema: {e}") from None
        settings.sampling.grammar = ("json_schema", text)

    return apply
# --- chat surface --------------------------------------------------------------------------

REASONING_FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")


def apply_reasoning_format(settings: Any, value: str, spelling: str) -> None:
    settings.chat.reasoning_format = one_of(value, spelling, REASONING_FORMATS)


def apply_chat_template_kwargs(settings: Any, value: str, spelling: str) -> None:
    import json

    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected a JSON object)")
    # the dedicated --reasoning* flags may already have set their keys; they win (logged)
    for key, v in parsed.items():
        if key in settings.chat.template_kwargs:  # set by --reasoning* earlier
            settings.notices.append(f"{spelling}: '{key}' is also set by a dedicated flag, which wins")
            continue
        settings.chat.template_kwargs[key] = v


def apply_reasoning(settings: Any, value: str, spelling: str) -> None:
    value = one_of(value, spelling, ("on", "off", "auto"))
    if value != "auto":
        settings.chat.template_kwargs["enable_thinking"] = value == "on"


def apply_reasoning_effort(settings: Any, value: str, spelling: str) -> None:
    if value != "default":
        settings.chat.template_kwargs["reasoning_effort"] = value


def apply_reasoning_budget(settings: Any, value: str, spelling: str) -> None:
    n = as_int(value, spelling)
    if n < -1:
        raise StartupRefusal(f"{spelling} {value}: the budget is a token count, or -1 for no limit")
    settings.chat.reasoning_budget = n


def apply_reasoning_preserve(settings: Any, value: Any, spelling: str) -> None:
    settings.chat.template_kwargs["preserve_reasoning"] = bool(value)


# --- RoPE overrides (--rope-*, --yarn-*): semantics in mlxcel/models/rope_overrides.py ----------


def rope(field: str, conv: str = "float", *, inverse: bool = False, positive: bool = False):
    """One RopeOverrides field. `inverse`: --rope-scale N is a frequency scale of 1/N.
    `positive`: 0 and below mean nothing b10621 can honour (a scale of 0 divides by zero)."""
    from dataclasses import replace

    def apply(settings: Any, value: str, spelling: str) -> None:
        v = as_int(value, spelling) if conv == "int" else as_float(value, spelling)
        if positive and not v > 0:
            raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected a number > 0)")
        if inverse:
            v = 1.0 / v
        if field == "freq_scale" and settings.backend.rope.freq_scale > 0:
            raise StartupRefusal(f"{spelling}: --rope-scale and --rope-freq-scale set the same factor; give one")
        settings.backend.rope = replace(settings.backend.rope, **{field: v})

    return apply


def apply_rope_scaling(settings: Any, value: str, spelling: str) -> None:
    from dataclasses import replace

    from mlxcel.config.rope import SCALING_TYPES

    settings.backend.rope = replace(settings.backend.rope, scaling=one_of(value, spelling, SCALING_TYPES))


def apply_slot_save_path(settings: Any, value: str, spelling: str) -> None:
    """An existing directory, as b10621 requires (it never creates one)."""
    path = Path(value).expanduser()
    if not path.is_dir():
        raise StartupRefusal(f"invalid value for {spelling}: not a directory: {value}")
    settings.server.slot_save_path = path.resolve()


def apply_image_tokens(path: str):
    """--image-min-tokens / --image-max-tokens: an integer; <= 0 means the checkpoint's own bound."""
    field_path(path)

    def apply(settings: Any, value: Any, spelling: str) -> None:
        n = as_int(value, spelling)
        assign(settings, path, n if n > 0 else None)
        lo, hi = settings.media.image_min_tokens, settings.media.image_max_tokens
        if lo is not None and hi is not None and hi < lo:
            raise StartupRefusal(f"--image-max-tokens {hi} is below --image-min-tokens {lo}")

    return apply


def apply_media_path(settings: Any, value: str, spelling: str) -> None:
    """The root file:// media URLs resolve under (api/media_path.py); an existing directory."""
    path = Path(value).expanduser()
    if not path.is_dir():
        raise StartupRefusal(f"invalid value for {spelling}: not a directory: {value}")
    settings.media.media_path = path.resolve()
