"""The speculative-decoding options: --spec-type, the draft model and the n-gram tuning knobs.

Each apply function checks one value and lands it in ServerSettings; `spec_config` turns the
settings into the engine's SpecConfig once the draft checkpoint is resolved. mlxcel runs two of
b10621's drafters: draft-simple (a small checkpoint with the target's vocabulary) and
ngram-simple (prompt lookup in the row's own context). Every other type is refused at startup,
and so are the tuning values and cache files that only those types read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxcel.cli.options_apply import as_float, as_int, assign, field_path
from mlxcel.config.refusal import StartupRefusal

IMPLEMENTED = ("draft-simple", "ngram-simple")
# b10621's other types, and what to use instead
UNSUPPORTED = {
    "draft-eagle3": "an EAGLE-3 head",
    "draft-mtp": "a multi-token-prediction head",
    "draft-dflash": "a DFlash draft",
    "draft-dspark": "a DSpark draft",
    "ngram-map-k": "the ngram-map-k drafter",
    "ngram-map-k4v": "the ngram-map-k4v drafter",
    "ngram-mod": "the ngram-mod drafter",
    "ngram-cache": "the lookup-cache drafter",
}
ALTERNATIVE = ("mlxcel drafts with draft-simple (--spec-draft-model <small checkpoint with the same vocabulary>) "
               "or ngram-simple (prompt lookup, no draft model)")


def apply_spec_type(settings: Any, value: str, spelling: str) -> None:
    types = [t.strip() for t in str(value).split(",") if t.strip()]
    if not types:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected a comma-separated list of types)")
    unknown = [t for t in types if t != "none" and t not in IMPLEMENTED and t not in UNSUPPORTED]
    if unknown:
        known = ", ".join(("none",) + IMPLEMENTED + tuple(UNSUPPORTED))
        raise StartupRefusal(f"invalid value for {spelling}: unknown speculative type {unknown[0]!r} "
                             f"(expected: {known})")
    for t in types:
        if t in UNSUPPORTED:
            raise StartupRefusal(f"{spelling} {value}: mlxcel does not implement {UNSUPPORTED[t]} ({t}); {ALTERNATIVE}")
    chosen = [t for t in dict.fromkeys(types) if t != "none"]
    if len(chosen) > 1:
        raise StartupRefusal(f"{spelling} {value}: mlxcel runs one drafter at a time; pick one of {', '.join(chosen)}")
    settings.spec.type = chosen[0] if chosen else "none"


def bounded_int(path: str, low: int):
    field_path(path)

    def apply(settings: Any, value: str, spelling: str) -> None:
        n = as_int(value, spelling)
        if n < low:
            raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected an integer >= {low})")
        assign(settings, path, n)

    return apply


def _probability(value: str, spelling: str) -> float:
    p = as_float(value, spelling)
    if not 0.0 <= p <= 1.0:
        raise StartupRefusal(f"invalid value for {spelling}: {value!r} (expected a probability in [0, 1])")
    return p


def apply_p_min(settings: Any, value: str, spelling: str) -> None:
    settings.spec.draft_p_min = _probability(value, spelling)


def apply_p_split(_settings: Any, value: str, spelling: str) -> None:
    """Parsed and checked; b10621 reads it nowhere either (it configured a tree split it no longer has)."""
    _probability(value, spelling)


def apply_draft_model(settings: Any, value: str, _spelling: str) -> None:
    settings.spec.draft_model = value.strip()


def apply_draft_hf(settings: Any, value: str, spelling: str) -> None:
    """Like --hf-repo: an MLX repository id, resolved through the model store (offline when the
    hub cannot be reached); a GGUF ':quant' suffix is refused."""
    repo = value.strip()
    if ":" in repo:
        base, quant = repo.rsplit(":", 1)
        raise StartupRefusal(f"{spelling} {value}: the ':{quant}' suffix selects a GGUF quantization; mlxcel loads a "
                             f"whole MLX checkpoint, so name an MLX repository (e.g. {spelling} {base})")
    settings.spec.draft_hf = repo


def refuse_lookup_cache(_settings: Any, value: str, spelling: str) -> None:
    raise StartupRefusal(f"{spelling} {value}: lookup-cache files feed b10621's ngram-cache drafter, which mlxcel does "
                         f"not implement; --spec-type ngram-simple drafts from the request's own context without a "
                         f"cache file")


def resolve_draft(settings: Any, resolve_ref) -> Path | None:
    """The draft checkpoint's path (--spec-draft-hf wins over --spec-draft-model, as --hf-repo
    wins over -m), through the same store resolution as the target; None without one."""
    if settings.spec.draft_hf:
        return resolve_ref(settings, settings.spec.draft_hf, "--spec-draft-hf")
    if settings.spec.draft_model:
        return resolve_ref(settings, settings.spec.draft_model, "--spec-draft-model")
    return None


def check_draft(settings: Any, target: Path, draft: Path, placed) -> None:
    """Before the load: the draft must share the target's vocabulary token for token and run on
    the backend the target was given (`placed`, its backends.select.Choice); its model_type, like
    the target's, must be one mlxcel serves."""
    import json

    from transformers import AutoTokenizer

    from mlxcel.models.registry import UnsupportedModelType, family_for
    from mlxcel.runtime.load import select_backend

    try:
        family_for(json.loads((draft / "config.json").read_text()))
    except UnsupportedModelType as e:
        raise StartupRefusal(f"--spec-draft-model {draft.name}: {e}") from None

    vocab = [AutoTokenizer.from_pretrained(str(p), local_files_only=True).get_vocab() for p in (target, draft)]
    if vocab[0] != vocab[1]:
        raise StartupRefusal(f"--spec-draft-model {draft.name}: its vocabulary differs from the target's; a draft "
                             f"model must share the target's tokenizer token for token")
    choice = select_backend(settings, draft, placed)
    if choice.backend != placed.backend:
        raise StartupRefusal(f"--spec-draft-model {draft.name}: it would run on {choice.backend} while the target runs "
                             f"on {placed.backend}; pick a draft checkpoint both can share")


def refuse_unused(settings: Any, mode: str) -> None:
    """Speculation asked for where no single generation model runs (the router, or an
    --embeddings / --reranking server) would be parsed and never used: refused instead."""
    if settings.spec.type not in (None, "none") or settings.spec.draft_model or settings.spec.draft_hf:
        raise StartupRefusal(f"--spec-type / --spec-draft-model / --spec-draft-hf: speculative decoding drafts for the "
                             f"-m generation model, and this server runs {mode}")


def spec_config(settings: Any, draft_path: Path | None):
    """The engine's SpecConfig, or None when nothing speculates. A draft model with --spec-type
    not given means draft-simple; an explicit none turns speculation off (the draft is then not
    even loaded); draft-simple without a draft model is refused."""
    from mlxcel.engine.speculative import DRAFT, NGRAM_SIMPLE, SpecConfig

    kind = settings.spec.type
    if kind is None:
        kind = DRAFT if draft_path is not None else "none"
    if kind == "none":
        return None
    if kind == DRAFT and draft_path is None:
        raise StartupRefusal("--spec-type draft-simple needs a draft checkpoint: pass --spec-draft-model <dir|owner/name> "
                             "(a small model with the target's vocabulary)")
    if kind == NGRAM_SIMPLE and draft_path is not None:
        raise StartupRefusal("--spec-type ngram-simple drafts without a model; drop --spec-draft-model, or use "
                             "--spec-type draft-simple")
    if settings.spec.draft_n_min > settings.spec.draft_n_max and kind == DRAFT:
        raise StartupRefusal(f"--spec-draft-n-min {settings.spec.draft_n_min} exceeds --spec-draft-n-max "
                             f"{settings.spec.draft_n_max}: every draft would be dropped")
    return SpecConfig(kind=kind, n_max=settings.spec.draft_n_max, n_min=settings.spec.draft_n_min,
                      p_min=settings.spec.draft_p_min, ngram_size_n=settings.spec.ngram_simple_size_n,
                      ngram_size_m=settings.spec.ngram_simple_size_m, draft_model=draft_path)
