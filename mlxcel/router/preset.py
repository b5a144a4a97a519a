"""--models-preset: b10621's INI presets, read into plain data and applied to per-model settings.

A `[name]` section defines a model (`model =` a checkpoint directory, `hf-repo =` a snapshot
of the model store) or, without either, overlays configuration onto a discovered model of that
name; `[*]` is the global preset cascaded under every model. A key is a long option without its
dashes (`ctx-size`, `_` read as `-` as b10621 folds it) or its LLAMA_ARG_* variable. Only the
keys below are translated; any other key stops startup naming key and section, because a
preset key that silently did nothing would misconfigure the model it names.

Applying a preset to a model's settings runs each value through the option's own apply
function, so a preset value is validated exactly as the flag is; that needs the CLI's option
table, so the CLI hands the pool its `Configure` function (cli/flags.py `model_settings`).
"""

from __future__ import annotations

import configparser
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import ServerSettings

GLOBAL = "*"

# preset key -> the option-table key of the flag it sets (None: handled by the router itself)
TRANSLATED: dict[str, str | None] = {
    "model": None, "hf-repo": None, "alias": None, "tags": None,
    "ctx-size": "ctx_size", "parallel": "parallel", "temp": "temp", "top-k": "top_k", "top-p": "top_p",
    "min-p": "min_p", "seed": "seed", "n-predict": "predict",
    "load-on-startup": None, "stop-timeout": None,  # preset-only: honoured / parsed inert
}
# other spellings of the same keys: long-option synonyms and LLAMA_ARG_* variables
SYNONYMS = {
    "m": "model", "hf": "hf-repo", "hfr": "hf-repo", "temperature": "temp", "predict": "n-predict",
    "c": "ctx-size", "np": "parallel", "a": "alias", "s": "seed", "n": "n-predict",
    "LLAMA_ARG_MODEL": "model", "LLAMA_ARG_HF_REPO": "hf-repo", "LLAMA_ARG_ALIAS": "alias", "LLAMA_ARG_TAGS": "tags",
    "LLAMA_ARG_CTX_SIZE": "ctx-size", "LLAMA_ARG_N_PARALLEL": "parallel", "LLAMA_ARG_TOP_K": "top-k",
    "LLAMA_ARG_N_PREDICT": "n-predict",
}
TRUTHY, FALSEY = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")


@dataclass
class PresetSection:
    name: str
    values: dict[str, str] = field(default_factory=dict)  # canonical key -> raw text, in file order

    @property
    def model(self) -> str | None:
        return self.values.get("model")

    @property
    def hf_repo(self) -> str | None:
        return self.values.get("hf-repo")

    def listed(self, key: str) -> list[str]:
        """alias / tags: comma-separated, held as b10621 holds them (a sorted set)."""
        return sorted({v.strip() for v in self.values.get(key, "").split(",") if v.strip()})

    @property
    def load_on_startup(self) -> bool:
        raw = self.values.get("load-on-startup")
        return raw is not None and raw.strip().lower() in TRUTHY

    def to_ini(self) -> str:
        return f"[{self.name}]\n" + "".join(f"{k} = {v}\n" for k, v in self.values.items())


@dataclass
class Preset:
    path: Path
    global_: PresetSection
    sections: dict[str, PresetSection]


# A model's settings from the router's and its preset sections (global first), every value
# checked as its flag would be; a bad value is a StartupRefusal.
Configure = Callable[[ServerSettings, list[PresetSection]], ServerSettings]


def canonical_key(raw: str) -> str | None:
    key = raw.strip()
    if key in SYNONYMS:
        return SYNONYMS[key]
    key = key.lstrip("-").replace("_", "-")
    key = SYNONYMS.get(key, key)
    return key if key in TRANSLATED else None


def parse_preset(path: Path) -> Preset:
    """Read and check the INI file; every problem is a StartupRefusal naming file, section and key."""
    cp = configparser.ConfigParser(interpolation=None, delimiters=("=",), comment_prefixes=(";", "#"),
                                   strict=True, default_section="\0none")
    cp.optionxform = str  # keys keep their case (LLAMA_ARG_*)
    try:
        cp.read_string(Path(path).read_text(encoding="utf-8"), source=str(path))
    except (OSError, UnicodeDecodeError, configparser.Error) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StartupRefusal(f"--models-preset {path}: not a readable INI file ({first})") from None
    glob = PresetSection(GLOBAL)
    sections: dict[str, PresetSection] = {}
    for name in cp.sections():
        sec = PresetSection(name.strip())
        for raw_key, raw_value in cp.items(name):
            key = canonical_key(raw_key)
            if key is None:
                raise StartupRefusal(
                    f"--models-preset {path}: key {raw_key!r} in section [{name}] is not supported by mlxcel presets "
                    f"(accepted: {', '.join(TRANSLATED)}, or their LLAMA_ARG_* spellings)")
            if key in ("model", "hf-repo") and sec.name == GLOBAL:
                raise StartupRefusal(f"--models-preset {path}: key {raw_key!r} in section [*] would give every model "
                                     "the same checkpoint; set it in a model's own section")
            value = (raw_value or "").strip()
            if key == "load-on-startup" and value.lower() not in TRUTHY + FALSEY:
                raise StartupRefusal(f"--models-preset {path}: key {raw_key!r} in section [{name}]: invalid boolean "
                                     f"{value!r}")
            if key == "stop-timeout":
                try:
                    int(value)
                except ValueError:
                    raise StartupRefusal(f"--models-preset {path}: key {raw_key!r} in section [{name}]: expected an "
                                         f"integer, got {value!r}") from None
            sec.values[key] = value
        if sec.name == GLOBAL:
            glob = sec
        else:
            sections[sec.name] = sec
    return Preset(Path(path), glob, sections)


def effective_args(base: Any, sections: list[PresetSection]) -> list[str]:
    """The configuration a preset gives a model, as flags (GET /models status.args)."""
    out: dict[str, str] = {}
    for sec in sections:
        for key, value in sec.values.items():
            if TRANSLATED.get(key) is not None and TRANSLATED[key] not in base.cli_given:
                out[key] = value
    return [tok for key, value in out.items() for tok in (f"--{key}", value)]
