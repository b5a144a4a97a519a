"""The refusal reasons several option-table rows share, and b10621's built-in presets."""

from __future__ import annotations

# Reasons shared by the GGML-runtime group (accepted only in forms that ask for nothing).
POOL = "CPU affinity, priority and polling tune GGML's CPU thread pool, which mlxcel does not have"
THREADS = "mlxcel has no GGML CPU thread pool; only values <= 0 (all cores) are accepted"
ONE_DEVICE = "mlxcel runs the whole model on one MLX device and does not split it across GPUs"
SPLIT = ("mlxcel does not split a model over GGML devices; it splits one over processes and machines with "
         "--tp-size (tensor parallel) and --pp-size (pipeline parallel), see docs/distributed.md")
RPC = ("mlxcel has no GGML RPC backend; to serve one model from several machines start a group with --tp-size / "
       "--pp-size and --hostfile (docs/distributed.md)")
MOE_CPU = "mlxcel keeps every expert on the MLX device; there is no CPU expert placement"
LOAD = "mlxcel reads SafeTensors through MLX and has no mlock / direct-I/O load mode; accepted: --load-mode auto|mmap"
GGML_ONLY = "this is a GGML backend setting with no MLX counterpart"
NO_DRAFT = "the draft model runs on the target's backend and device; there is no draft layer placement to tune"
NO_DRAFT_SAMPLING = "mlxcel's draft sampling always runs on the draft's own device, so there is no switch to make"
NGRAM_OTHER = ("mlxcel's only n-gram drafter is ngram-simple (--spec-type refuses {mode}), so this {mode} knob has "
               "nothing to tune: the default is accepted, any other value refused")
UI = ("mlxcel's chat page takes no server-side UI settings and mlxcel executes no server-side tools or MCP; "
      "use the HTTP API directly (the --no-... form is accepted)")
GGUF = "mlxcel loads MLX SafeTensors checkpoints, not GGUF files; pass an MLX checkpoint with -m <dir|owner/name>"

# b10621's twelve built-in presets: each names a GGUF repo plus a parameter block, neither of
# which can be honoured alone. The nearest MLX checkpoint is a suggestion only, never resolved.
PRESETS = {
    "--embd-gemma-default": "mlx-community/embeddinggemma-300m-4bit",
    "--fim-qwen-1.5b-default": "mlx-community/Qwen2.5-Coder-1.5B-8bit",
    "--fim-qwen-3b-default": "mlx-community/Qwen2.5-Coder-3B-8bit",
    "--fim-qwen-7b-default": "mlx-community/Qwen2.5-Coder-7B-8bit",
    "--fim-qwen-7b-spec": "mlx-community/Qwen2.5-Coder-7B-8bit",
    "--fim-qwen-14b-spec": "mlx-community/Qwen2.5-Coder-14B-8bit",
    "--fim-qwen-30b-default": "mlx-community/Qwen3-Coder-30B-A3B-Instruct-8bit",
    "--gpt-oss-20b-default": "mlx-community/gpt-oss-20b-MXFP4-Q8",
    "--gpt-oss-120b-default": "mlx-community/gpt-oss-120b-MXFP4-Q8",
    "--vision-gemma-4b-default": "mlx-community/gemma-3-4b-it-qat-4bit",
    "--vision-gemma-12b-default": "mlx-community/gemma-3-12b-it-qat-4bit",
}


NO_SLOT_STATE = ("mlxcel keeps no per-slot retained prompts, shared KV buffer or checkpoint ring; "
                 "prompt reuse goes through one process-wide prefix cache")


def preset_reason(name: str) -> str:
    """Why a b10621 preset flag is refused, and the nearest thing mlxcel serves instead."""
    if name == "--spec-default":
        return ("this preset enables b10621's ngram-mod drafter, which mlxcel does not implement; mlxcel's n-gram "
                "drafter is --spec-type ngram-simple")
    repo = PRESETS[name]
    extra = " plus --spec-draft-model <a small MLX checkpoint with the same vocabulary>" if name.endswith("-spec") else ""
    return (f"this preset downloads a GGUF model and rewrites server parameters; the nearest MLX checkpoint is "
            f"{repo}: run `mlxcel-server -m {repo}` or `mlxcel serve -m {repo}`{extra}")
