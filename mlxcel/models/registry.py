"""The family registry: `model_type` -> the module that implements its forward pass.

An explicit table, not an import-by-name fallback: a checkpoint whose `model_type` is not
listed here is refused, on its config.json alone and before any weight is read, with one line
naming the type, the nearest supported families and docs/models.md (which is generated from
this table by scripts/gen_models_doc.py). mlx-lm's per-family modules are the maintained
reference implementations; a family file of our own goes here only when a family needs one.
"""

from __future__ import annotations

import difflib
import importlib
import re
from dataclasses import dataclass
from types import ModuleType

MLX, TORCH = "mlx", "torch"
DOCS_PAGE = "docs/models.md"


@dataclass(frozen=True)
class Family:
    model_type: str
    mlx_module: str | None  # module exposing `Model` and `ModelArgs`; None: torch backend only
    # transformers class used as the numerical reference; None: transformers has no class for
    # the family, so only MLX serves it and mlx-lm's module with its own cache is the reference
    hf_architecture: str | None
    attention: tuple[str, ...] = ("full",)  # the attention kinds its layers may declare
    # model types of the same architecture lineage that mlxcel does not serve, named as the
    # nearest family when one is refused (a shared name stem needs no entry here)
    kin: tuple[str, ...] = ()

    @property
    def backends(self) -> tuple[str, ...]:
        if self.mlx_module is None:
            return (TORCH,)
        return (MLX,) if self.hf_architecture is None else (MLX, TORCH)


# a config's sliding_window may put every layer, or Qwen's later layers, on a window
SLIDABLE = ("full", "sliding")

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "mlx_lm.models.llama", "LlamaForCausalLM", kin=("ministral",)),
        # Mistral's decoder is Llama's with a sliding window over every layer
        Family("mistral", "mlx_lm.models.llama", "MistralForCausalLM", attention=SLIDABLE),
        Family("mixtral", "mlx_lm.models.mixtral", "MixtralForCausalLM", attention=SLIDABLE),
        Family("qwen2", "mlx_lm.models.qwen2", "Qwen2ForCausalLM", attention=SLIDABLE),
        Family("qwen2_moe", "mlx_lm.models.qwen2_moe", "Qwen2MoeForCausalLM", attention=SLIDABLE),
        Family("qwen3", "mlx_lm.models.qwen3", "Qwen3ForCausalLM", attention=SLIDABLE),
        Family("qwen3_moe", "mlx_lm.models.qwen3_moe", "Qwen3MoeForCausalLM", attention=SLIDABLE),
        Family("gemma", "mlx_lm.models.gemma", "GemmaForCausalLM"),
        Family("gemma2", "mlx_lm.models.gemma2", "Gemma2ForCausalLM", attention=SLIDABLE),
        Family("gemma3_text", "mlx_lm.models.gemma3_text", "Gemma3ForCausalLM", attention=SLIDABLE),
        # Gemma 3's multimodal checkpoint, served for text: its text tower only (images refused)
        Family("gemma3", "mlx_lm.models.gemma3", "Gemma3ForConditionalGeneration", attention=SLIDABLE),
        Family("phi", "mlx_lm.models.phi", "PhiForCausalLM"),
        Family("phi3", "mlx_lm.models.phi3", "Phi3ForCausalLM", attention=SLIDABLE),
        Family("olmo2", "mlx_lm.models.olmo2", "Olmo2ForCausalLM"),
        Family("starcoder2", "mlx_lm.models.starcoder2", "Starcoder2ForCausalLM", attention=SLIDABLE),
        Family("cohere", "mlx_lm.models.cohere", "CohereForCausalLM"),
        Family("cohere2", "mlx_lm.models.cohere2", "Cohere2ForCausalLM", attention=SLIDABLE),
        Family("granite", "mlx_lm.models.granite", "GraniteForCausalLM"),
        Family("granitemoe", "mlx_lm.models.granitemoe", "GraniteMoeForCausalLM"),
        Family("smollm3", "mlx_lm.models.smollm3", "SmolLM3ForCausalLM"),
        Family("glm4", "mlx_lm.models.glm4", "Glm4ForCausalLM"),
        Family("gpt_oss", "mlx_lm.models.gpt_oss", "GptOssForCausalLM", attention=SLIDABLE),
        Family("olmo3", "mlx_lm.models.olmo3", "Olmo3ForCausalLM", attention=SLIDABLE),
        Family("olmoe", "mlx_lm.models.olmoe", "OlmoeForCausalLM"),
        Family("stablelm", "mlx_lm.models.stablelm", "StableLmForCausalLM"),
        Family("gpt_neox", "mlx_lm.models.gpt_neox", "GPTNeoXForCausalLM"),
        Family("helium", "mlx_lm.models.helium", "HeliumForCausalLM"),
        Family("ernie4_5", "mlx_lm.models.ernie4_5", "Ernie4_5ForCausalLM"),
        Family("nemotron", "mlx_lm.models.nemotron", "NemotronForCausalLM"),
        Family("seed_oss", "mlx_lm.models.seed_oss", "SeedOssForCausalLM"),
        Family("hunyuan_v1_dense", "mlx_lm.models.hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM"),
        Family("phimoe", "mlx_lm.models.phimoe", "PhimoeForCausalLM", attention=SLIDABLE),
        Family("dbrx", "mlx_lm.models.dbrx", "DbrxForCausalLM"),
        # multi-head latent attention: the paged pool holds the compressed latent (engine/backend.LayerKV)
        Family("deepseek_v2", "mlx_lm.models.deepseek_v2", "DeepseekV2ForCausalLM", attention=("latent",)),
        Family("deepseek_v3", "mlx_lm.models.deepseek_v3", "DeepseekV3ForCausalLM", attention=("latent",)),
        # EXAONE 3.x: transformers serves it with Llama's class (the hub's weight names renamed at load)
        Family("exaone", "mlx_lm.models.exaone", "LlamaForCausalLM"),
        # EXAONE 4: sliding layers with RoPE, full-attention layers without (NoPE)
        Family("exaone4", "mlx_lm.models.exaone4", "Exaone4ForCausalLM", attention=SLIDABLE),
        # no transformers class in the transformers mlxcel pins (the hub's is remote code): MLX only
        Family("internlm2", "mlx_lm.models.internlm2", None),
        Family("internlm3", "mlx_lm.models.internlm3", None),
        # recurrent: LFM2's short-convolution layers beside attention, Mamba 2's SSM layers
        Family("lfm2", "mlx_lm.models.lfm2", "Lfm2ForCausalLM", attention=("full", "recurrent")),
        Family("mamba2", "mlx_lm.models.mamba2", "Mamba2ForCausalLM", attention=("recurrent",)),
        # vision-language (models/vision.py): transformers' family code on the torch backend only
        Family("qwen2_vl", None, "Qwen2VLForConditionalGeneration"),
        Family("qwen2_5_vl", None, "Qwen2_5_VLForConditionalGeneration", attention=SLIDABLE),
        Family("llava", None, "LlavaForConditionalGeneration"),
        Family("idefics3", None, "Idefics3ForConditionalGeneration"),
        Family("paligemma", None, "PaliGemmaForConditionalGeneration"),
        Family("mistral3", None, "Mistral3ForConditionalGeneration", attention=SLIDABLE),
    )
}


@dataclass(frozen=True)
class WorkerType:
    """A checkpoint kind a side worker serves (mlxcel/workers) rather than the generation engine."""

    model_type: str
    serves: str  # what it answers
    how: str  # how a server is started to serve it
    backends: tuple[str, ...]


WORKER_TYPES: dict[str, WorkerType] = {
    w.model_type: w
    for w in (
        WorkerType("bert", "embeddings and reranking", "--embeddings / --reranking", (MLX, TORCH)),
        WorkerType("whisper", "transcription", "mlxcel-server -m <whisper checkpoint>", (MLX,)),
        WorkerType("kokoro", "speech (text-to-speech)", "mlxcel-server -m <kokoro checkpoint>", (MLX,)),
    )
}

# model_type values the encoder workers load (models/bert.py); listed apart from FAMILIES, and
# here rather than beside the MLX code, so reading a checkpoint's kind needs no MLX
ENCODER_TYPES = ("bert",)


class UnsupportedModelType(ValueError):
    pass


def _stem(name: str) -> str:
    """The leading letters of a type or class name: "qwen2_moe" -> "qwen", "MistralForCausalLM" -> "mistral"."""
    m = re.match(r"[a-z]+", name.lower())
    return m.group(0) if m else ""


def nearest_families(model_type: str, architectures=()) -> list[str]:
    """The supported families nearest an unsupported type, nearest first (at most three): those
    of the same lineage (a shared name stem, or listed as kin, by the type or by its
    transformers class), else those whose name is close to it."""
    stems = {_stem(model_type)} | {_stem(str(a).removesuffix("ForCausalLM")) for a in architectures or ()}
    stems.discard("")
    kin = [f.model_type for f in FAMILIES.values()
           if stems & ({_stem(f.model_type)} | {_stem(k) for k in f.kin})]
    if kin:
        return sorted(kin, key=lambda t: -difflib.SequenceMatcher(None, model_type, t).ratio())[:3]
    return difflib.get_close_matches(model_type, list(FAMILIES), n=3, cutoff=0.6)


def unsupported_message(config: dict) -> str:
    """The one line every entry point refuses an unsupported checkpoint with."""
    model_type = config.get("model_type")
    if model_type in WORKER_TYPES:
        w = WORKER_TYPES[model_type]
        return (f"model_type {model_type!r} is not supported for text generation: mlxcel serves it for "
                f"{w.serves} ({w.how}); see {DOCS_PAGE}")
    near = nearest_families(str(model_type or ""), config.get("architectures") or ())
    nearest = (f"nearest supported: {', '.join(near)}" if near
               else "no supported family is close to it")
    # the whole list no longer reads as one line; the page and `mlxcel list --supported` hold it
    return (f"model_type {model_type!r} is not supported ({nearest}); the {len(FAMILIES)} supported types are "
            f"listed in {DOCS_PAGE} and by `mlxcel list --supported`")


def family_for(config: dict) -> Family:
    fam = FAMILIES.get(config.get("model_type"))
    if fam is None:
        raise UnsupportedModelType(unsupported_message(config))
    return fam


def mlx_only(config: dict) -> str | None:
    """Why only the MLX backend serves this checkpoint's family (one line), or None."""
    fam = FAMILIES.get(config.get("model_type"))
    if fam is None or TORCH in fam.backends:
        return None
    return f"{fam.model_type} has no transformers class, which the torch backend runs"


def mlx_module(config: dict) -> ModuleType:
    fam = family_for(config)
    if fam.mlx_module is None:
        raise UnsupportedModelType(f"{fam.model_type} is a vision-language checkpoint, which only the torch backend "
                                   f"serves: use --backend torch")
    return importlib.import_module(fam.mlx_module)


def decoder_stack(model):
    """The module of an mlx-lm family `Model` that maps token ids to the final hidden states:
    embeddings, every decoder layer and the final norm, without the LM head. Every family
    listed above keeps it in `model.model` (EXAONE 3: `model.transformer`, Mamba: `model.backbone`),
    called as `(inputs, cache=...)`; a multimodal wrapper (Gemma 3's) in its text tower's."""
    model = getattr(model, "language_model", model)
    # EXAONE 3's module keeps its stack under the hub's remote-code name, `transformer`; Mamba's
    # under `backbone`. An MLX module is a dict: test for None, never for truth
    inner = getattr(model, "model", None)
    for name in ("transformer", "backbone"):
        if inner is None:
            inner = getattr(model, name, None)
    if inner is None or not callable(inner):
        raise UnsupportedModelType(f"{type(model).__module__} has no decoder stack at `.model` or `.backbone`; "
                                   "its hidden states cannot be read")
    return inner
