"""The llama.cpp GGUF architectures `mlxcel convert` reads, and the family each one becomes.

A plain table, so docs/models.md can list it per family (models/catalog.py) and the converter
can be held to it: store/gguf_source.py has a layout for exactly these names, and a GGUF of any
other `general.architecture` is refused with this list.
"""

from __future__ import annotations

# llama.cpp's `general.architecture` -> the model types a file of it converts into
GGUF_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    # llama.cpp exports Mistral as `llama` too (it becomes a llama checkpoint); a `llama` file with
    # experts is a Mixtral
    "llama": ("llama", "mixtral"),
    "command-r": ("cohere",),
    "cohere2": ("cohere2",),
    "gemma": ("gemma",),
    "gemma2": ("gemma2",),
    "gemma3": ("gemma3_text",),
    "granite": ("granite",),
    "granitemoe": ("granitemoe",),
    "olmo2": ("olmo2", "olmo3"),  # OLMo 3: olmo2 with a sliding window
    "phi2": ("phi",),
    "phi3": ("phi3",),
    "qwen2": ("qwen2",),
    "qwen2moe": ("qwen2_moe",),
    "qwen3": ("qwen3",),
    "qwen3moe": ("qwen3_moe",),
    "stablelm": ("stablelm",),
    "starcoder2": ("starcoder2",),
    "smollm3": ("smollm3",),
    "olmoe": ("olmoe",),
    "glm4": ("glm4",),
    "seed_oss": ("seed_oss",),
    "nemotron": ("nemotron",),
    "lfm2": ("lfm2",),
    "ernie4_5": ("ernie4_5",),
    "gpt-oss": ("gpt_oss",),
    "hunyuan-dense": ("hunyuan_v1_dense",),
    "exaone": ("exaone",),
    "exaone4": ("exaone4",),
    "phimoe": ("phimoe",),
    "internlm2": ("internlm2",),
    "gptneox": ("gpt_neox",),
    "dbrx": ("dbrx",),
    # llama.cpp's deepseek2 holds both: a file that routes by sigmoid is a V3
    "deepseek2": ("deepseek_v2", "deepseek_v3"),
    "mamba2": ("mamba2",),
}


# families llama.cpp exports under another family's architecture: a GGUF of one converts into that
# other family (Mistral: the same weights and graph; multimodal Gemma 3: its text tower, the
# image tower being a separate mmproj file)
GGUF_EXPORTED_AS: dict[str, str] = {"mistral": "llama", "gemma3": "gemma3_text"}


def gguf_sources(model_type: str) -> list[str]:
    """The GGUF architectures that convert into `model_type`, sorted."""
    return sorted(arch for arch, types in GGUF_ARCHITECTURES.items() if model_type in types)


def gguf_cell(model_type: str) -> str:
    """docs/models.md's "from GGUF" cell for a family."""
    if model_type in GGUF_EXPORTED_AS:
        other = GGUF_EXPORTED_AS[model_type]
        return f"{', '.join(gguf_sources(other))} (converts to {other})"
    return ", ".join(gguf_sources(model_type)) or "no"
