"""The one table of server options: every b10621 `--help` entry plus mlxcel's own.

This table drives everything about the flag surface: the argparse parser and `--help`
(flags.py), the argv pre-pass for llama.cpp's multi-letter single-dash spellings, the
environment bindings, `--completion-bash`, the hidden `--dump-flag-surface`, and the startup
classification (what is honoured, what is inert, what is refused and why). Rows follow
b10621's help order; each row's state is the compatibility manifest's state for that entry.
"""

from __future__ import annotations

from functools import partial

from mlxcel.cli import options_apply as a
from mlxcel.cli import options_lora as lo
from mlxcel.cli import options_sampling as sa
from mlxcel.cli import options_spec as sp
from mlxcel.cli.options_model import (
    ALIASED,
    BY_DESIGN,
    FLAG,
    NOT_APPLICABLE,
    PAIR,
    SUPPORTED,
    VALUE,
    VALUE2,
    Option,
    always,
    eq,
    le,
    make,
    only_negative_form,
    only_positive_form,
)
from mlxcel.config.sampling import B10621_SAMPLING as _D

COMMON, SAMPLING, SPEC, SERVER = "common params", "sampling params", "speculative params", "example-specific params"
NATIVE = "mlxcel"

C = partial(make, section=COMMON)
S = partial(make, section=SAMPLING)
D = partial(make, section=SPEC)
X = partial(make, section=SERVER)
_f = sa.shown  # a float default as b10621 prints it

# Reasons shared by the GGML-runtime group (accepted only in forms that ask for nothing).
POOL = "CPU affinity, priority and polling tune GGML's CPU thread pool, which mlxcel does not have"
THREADS = "mlxcel has no GGML CPU thread pool; only values <= 0 (all cores) are accepted"
ONE_DEVICE = "mlxcel runs the whole model on one MLX device and does not split it across GPUs"
MOE_CPU = "mlxcel keeps every expert on the MLX device; there is no CPU expert placement"
LOAD = "mlxcel reads SafeTensors through MLX and has no mlock / direct-I/O load mode; accepted: --load-mode auto|mmap"
GGML_ONLY = "this is a GGML backend setting with no MLX counterpart"
NO_DRAFT = "the draft model runs on the target's backend and device; there is no draft layer placement to tune"
NO_DRAFT_SAMPLING = "mlxcel's draft sampling always runs on the draft's own device, so there is no switch to make"
NGRAM_OTHER = ("mlxcel's only n-gram drafter is ngram-simple (--spec-type refuses {mode}), so this {mode} knob has "
               "nothing to tune: the default is accepted, any other value refused")
UI = "mlxcel ships no web UI and executes no server-side tools; use the HTTP API directly (the --no-... form is accepted)"
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


def _preset(name: str) -> Option:
    if name == "--spec-default":
        why = ("this preset enables b10621's ngram-mod drafter, which mlxcel does not implement; mlxcel's n-gram "
               "drafter is --spec-type ngram-simple")
    else:
        repo = PRESETS[name]
        extra = (" plus --spec-draft-model <a small MLX checkpoint with the same vocabulary>" if name.endswith("-spec")
                 else "")
        why = (f"this preset downloads a GGUF model and rewrites server parameters; the nearest MLX checkpoint is "
               f"{repo}: run `mlxcel-server -m {repo}` or `mlxcel serve -m {repo}`{extra}")
    return X(name, state=NOT_APPLICABLE, why=why)


def ggml(spellings: str, kind: str = VALUE, *, why: str, inert=None, **kw) -> Option:
    return C(spellings, kind, state=NOT_APPLICABLE, why=why, inert=inert, **kw)


def ggml_draft(spellings: str, kind: str = VALUE, *, why: str, inert=None, **kw) -> Option:
    return D(spellings, kind, state=NOT_APPLICABLE, why=why, inert=inert, **kw)


CHAT_TEMPLATE_NAMES = frozenset(
    "bailing bailing-think bailing2 chatglm3 chatglm4 chatml command-r deepseek deepseek-ocr deepseek2 "
    "deepseek3 exaone-moe exaone3 exaone4 falcon3 gemma gigachat glmedge gpt-oss granite granite-4.0 "
    "granite-4.1 grok-2 hunyuan-dense hunyuan-moe hunyuan-vl kimi-k2 llama2 llama2-sys llama2-sys-bos "
    "llama2-sys-strip llama3 llama4 megrez minicpm mistral-v1 mistral-v3 mistral-v3-tekken mistral-v7 "
    "mistral-v7-tekken monarch openchat orion pangu-embedded phi3 phi4 rwkv-world seed_oss smolvlm "
    "solar-open vicuna vicuna-orca yandex zephyr".split()
)


def _chat_template(from_file: bool):
    """Jinja text inline or from a file; a bare built-in template name is refused (mlxcel has
    no template library: it would render every prompt as that literal word)."""

    def apply(settings, value: str, spelling: str) -> None:
        text = a._read_text(value, spelling) if from_file else value
        if text.strip() in CHAT_TEMPLATE_NAMES:
            raise a.StartupRefusal(
                f"{spelling} {value}: mlxcel has no built-in template library; an MLX checkpoint carries its own "
                f"template (tokenizer_config.json), used by default, or pass the Jinja text itself"
            )
        if not text.strip():
            raise a.StartupRefusal(f"{spelling}: the chat template is empty")
        import jinja2

        try:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        except jinja2.TemplateSyntaxError as e:
            raise a.StartupRefusal(f"{spelling}: the chat template is not valid Jinja (line {e.lineno}: "
                                   f"{e.message})") from None
        setattr(settings, "chat_template_file" if from_file else "chat_template", text)

    return apply


def _log_prompts_dir(settings, value: str, spelling: str) -> None:
    raise a.StartupRefusal(
        f"{spelling} {value}: mlxcel never writes request prompts to disk; for request-level debugging use "
        f"--log-file PATH with --verbosity 4"
    )


def _removed(new: str) -> str:
    return f"the argument has been removed; use {new}"


_COMMON: tuple[Option, ...] = (
    # ---- common params ---------------------------------------------------------------------
    C("-h, --help, --usage", state=SUPPORTED, apply=lambda *_: None, help="print usage and exit"),
    C("--version", state=SUPPORTED, apply=lambda *_: None, help="print version and exit"),
    C("-cl, --cache-list", state=SUPPORTED, apply=lambda *_: None,
      help="list the checkpoints in the model store and exit"),
    C("--completion-bash", state=SUPPORTED, apply=lambda *_: None, help="print a bash completion script and exit"),
    C("-t, --threads", VALUE, mv="N", env="LLAMA_ARG_THREADS", default="-1", state=SUPPORTED,
      apply=a.setter("threads", "int"),
      help="CPU threads: torch's thread count (-1 = torch's default, all cores); on MLX's CPU device, the "
           "threads each large matrix product is split over (-1 = 2 where there are 2+ cores); "
           "refused with MLX on Metal"),
    ggml("-tb, --threads-batch", mv="N", why=THREADS, inert=le(0)),
    ggml("-C, --cpu-mask", mv="M", default="", why=POOL, inert=eq("")),
    ggml("-Cr, --cpu-range", mv="lo-hi", why=POOL),
    ggml("--cpu-strict", mv="<0|1>", default="0", why=POOL, inert=eq("0")),
    ggml("--prio", mv="N", default="0", why=POOL, inert=eq("0")),
    ggml("--poll", mv="<0...100>", default="50", why=POOL, inert=eq("50")),
    ggml("-Cb, --cpu-mask-batch", mv="M", why=POOL, inert=eq("")),
    ggml("-Crb, --cpu-range-batch", mv="lo-hi", why=POOL),
    ggml("--cpu-strict-batch", mv="<0|1>", why=POOL, inert=eq("0")),
    ggml("--prio-batch", mv="N", default="0", why=POOL, inert=eq("0")),
    ggml("--poll-batch", mv="<0|1>", why=POOL, inert=eq("50")),
    C("-c, --ctx-size", VALUE, mv="N", env="LLAMA_ARG_CTX_SIZE", default="0", state=SUPPORTED,
      apply=a.apply_ctx_size, help="context size in tokens (0 = the model's own)"),
    C("-n, --predict, --n-predict", VALUE, mv="N", env="LLAMA_ARG_N_PREDICT", default="-1", state=SUPPORTED,
      apply=a.setter("n_predict", "int"), help="default number of tokens to predict (-1 = until the context is full)"),
    C("-b, --batch-size", VALUE, mv="N", env="LLAMA_ARG_BATCH", default="2048", state=ALIASED,
      apply=a.apply_positive_int("batch_size"), help="logical prefill batch size (mlxcel default: 512)"),
    C("-ub, --ubatch-size", VALUE, mv="N", env="LLAMA_ARG_UBATCH", default="512", state=NOT_APPLICABLE,
      apply=a.apply_positive_int("ubatch_size"),
      help="accepted and reported only: MLX has no physical micro-batch"),
    C("--keep", VALUE, mv="N", default="0", state=SUPPORTED,
      apply=lambda s, v, sp: setattr(s, "keep", a.as_int(v, sp)),
      help="tokens of the prompt kept on a context shift (-1 = the whole prompt)"),
    C("--swa-full", env="LLAMA_ARG_SWA_FULL", default="false", state=NOT_APPLICABLE,
      why="sliding-window models build their own ring caches from the checkpoint; a full-size SWA cache cannot be selected"),
    ggml("-fa, --flash-attn", mv="[on|off|auto]", env="LLAMA_ARG_FLASH_ATTN", default="auto",
         why="mlxcel always uses MLX's fused attention and cannot switch it off; accepted: on, auto", inert=eq("on", "auto")),
    ggml("--perf, --no-perf", PAIR, env="LLAMA_ARG_PERF", default="false",
         why="libllama performance timings do not exist here; use --metrics for mlxcel's counters", inert=only_negative_form),
    C("-e, --escape, --no-escape", PAIR, default="true", state=NOT_APPLICABLE, apply=a.flag_to("escape"),
      why="the server reads no prompt from the command line; only --dry-sequence-breaker values are unescaped"),
    C("--rope-scaling", VALUE, mv="{none,linear,yarn}", env="LLAMA_ARG_ROPE_SCALING_TYPE", state=SUPPORTED,
      apply=a.apply_rope_scaling, help="RoPE scaling method (default: the checkpoint's, else linear when scaled)"),
    C("--rope-scale", VALUE, mv="N", env="LLAMA_ARG_ROPE_SCALE", state=SUPPORTED,
      apply=a.rope("freq_scale", inverse=True, positive=True), help="RoPE context scaling factor: expands context N times"),
    C("--rope-freq-base", VALUE, mv="N", env="LLAMA_ARG_ROPE_FREQ_BASE", state=SUPPORTED, apply=a.rope("freq_base"),
      help="RoPE base frequency (default: the checkpoint's rope_theta)"),
    C("--rope-freq-scale", VALUE, mv="N", env="LLAMA_ARG_ROPE_FREQ_SCALE", state=SUPPORTED, apply=a.rope("freq_scale"),
      help="RoPE frequency scaling factor: expands context 1/N times (default: the checkpoint's)"),
    C("--yarn-orig-ctx", VALUE, mv="N", env="LLAMA_ARG_YARN_ORIG_CTX", default="0", state=SUPPORTED,
      apply=a.rope("yarn_orig_ctx", "int"), help="YaRN: original context of the model (0 = the checkpoint's)"),
    C("--yarn-ext-factor", VALUE, mv="N", env="LLAMA_ARG_YARN_EXT_FACTOR", default="-1.00", state=SUPPORTED,
      apply=a.rope("yarn_ext_factor"), help="YaRN: extrapolation mix (-1 = the model's; only 1.0 can be honoured)"),
    C("--yarn-attn-factor", VALUE, mv="N", env="LLAMA_ARG_YARN_ATTN_FACTOR", default="-1.00", state=SUPPORTED,
      apply=a.rope("yarn_attn_factor"), help="YaRN: attention magnitude factor (-1 = the model's; only 1.0 can be honoured)"),
    C("--yarn-beta-slow", VALUE, mv="N", env="LLAMA_ARG_YARN_BETA_SLOW", default="-1.00", state=SUPPORTED,
      apply=a.rope("yarn_beta_slow"), help="YaRN: high correction dim (-1 = the checkpoint's, else 1)"),
    C("--yarn-beta-fast", VALUE, mv="N", env="LLAMA_ARG_YARN_BETA_FAST", default="-1.00", state=SUPPORTED,
      apply=a.rope("yarn_beta_fast"), help="YaRN: low correction dim (-1 = the checkpoint's, else 32)"),
    ggml("-kvo, --kv-offload, -nkvo, --no-kv-offload", PAIR, env="LLAMA_ARG_KV_OFFLOAD", default="true",
         why="the KV cache always lives on the MLX device; to shrink it see --cache-type-k / --cache-type-v",
         inert=only_positive_form),
    ggml("--repack, -nr, --no-repack", PAIR, env="LLAMA_ARG_REPACK", default="true", why=GGML_ONLY, inert=always),
    ggml("--no-host", FLAG, env="LLAMA_ARG_NO_HOST", default="false", why=GGML_ONLY),
    C("-ctk, --cache-type-k", VALUE, mv="TYPE", env="LLAMA_ARG_CACHE_TYPE_K", default="f16", state=ALIASED,
      apply=a.cache_type("cache_type_k"), hidden=True),
    C("-ctv, --cache-type-v", VALUE, mv="TYPE", env="LLAMA_ARG_CACHE_TYPE_V", default="f16", state=ALIASED,
      apply=a.cache_type("cache_type_v"), hidden=True),
    ggml("-dt, --defrag-thold", mv="N", env="LLAMA_ARG_DEFRAG_THOLD", why="deprecated upstream", inert=always),
    ggml("--rpc", mv="SERVERS", env="LLAMA_ARG_RPC", why="mlxcel has no GGML RPC backend; it serves from one MLX device"),
    ggml("--mlock", FLAG, env="LLAMA_ARG_MLOCK", default="false", why=LOAD),
    ggml("--mmap, --no-mmap", PAIR, env="LLAMA_ARG_MMAP", default="true", why=LOAD, inert=only_positive_form),
    ggml("-dio, --direct-io, -ndio, --no-direct-io", PAIR, env="LLAMA_ARG_DIO", why=LOAD, inert=only_negative_form),
    ggml("-lm, --load-mode", mv="MODE", env="LLAMA_ARG_LOAD_MODE", default="auto", why=LOAD, inert=eq("auto", "mmap")),
    ggml("--numa", mv="TYPE", env="LLAMA_ARG_NUMA", why="NUMA placement belongs to GGML's CPU backend"),
    C("-dev, --device", VALUE, mv="<dev1,dev2,..>", env="LLAMA_ARG_DEVICE", state=ALIASED, apply=a.apply_device,
      help="the one compute device: auto, cpu, cuda[:N], mps, metal, or llama.cpp's CPU, CUDA<N>, MTL0, none "
           "(default: auto; env MLXCEL_DEVICE too); a list of several devices is refused"),
    ggml("--list-devices", FLAG, why="mlxcel has no GGML backend devices to list"),
    ggml("-ot, --override-tensor", mv="<tensor name pattern>=<buffer type>,...", env="LLAMA_ARG_OVERRIDE_TENSOR",
         why=GGML_ONLY),
    ggml("-cmoe, --cpu-moe", FLAG, env="LLAMA_ARG_CPU_MOE", why=MOE_CPU),
    ggml("-ncmoe, --n-cpu-moe", mv="N", env="LLAMA_ARG_N_CPU_MOE", why=MOE_CPU, inert=eq("0")),
    C("-ngl, --gpu-layers, --n-gpu-layers", VALUE, mv="N", env="LLAMA_ARG_N_GPU_LAYERS", default="auto",
      state=NOT_APPLICABLE, apply=a.apply_gpu_layers),
    ggml("-sm, --split-mode", mv="{none,layer,row,tensor}", env="LLAMA_ARG_SPLIT_MODE", why=ONE_DEVICE, inert=eq("none")),
    ggml("-ts, --tensor-split", mv="N0,N1,N2,...", env="LLAMA_ARG_TENSOR_SPLIT", why=ONE_DEVICE),
    ggml("-mg, --main-gpu", mv="INDEX", env="LLAMA_ARG_MAIN_GPU", default="0", why=ONE_DEVICE, inert=eq("0")),
    ggml("-fit, --fit", mv="[on|off]", env="LLAMA_ARG_FIT", default="on",
         why="mlxcel does not fit parameters to device memory; set --ctx-size yourself (accepted: off)", inert=eq("off")),
    ggml("-fitt, --fit-target", mv="MiB0,MiB1,MiB2,...", env="LLAMA_ARG_FIT_TARGET",
         why="mlxcel does not fit parameters to device memory"),
    ggml("-fitc, --fit-ctx", mv="N", env="LLAMA_ARG_FIT_CTX", why="mlxcel does not fit parameters to device memory"),
    ggml("--check-tensors", FLAG, default="false", why="tensor validation is part of the GGUF loader"),
    ggml("--override-kv", mv="KEY=TYPE:VALUE,...", why="this overrides GGUF metadata; an MLX checkpoint is configured by its config.json"),
    ggml("--op-offload, --no-op-offload", PAIR, default="true", why=GGML_ONLY, inert=only_positive_form),
    C("--lora", VALUE, mv="FNAME", state=ALIASED, path_value=True, repeatable=True, apply=lo.apply_lora,
      help="LoRA adapter directory (PEFT or mlx-lm layout), served unfused at scale 1.0; comma-separated for several"),
    C("--lora-scaled", VALUE, mv="FNAME:SCALE,...", state=ALIASED, repeatable=True, apply=lo.apply_lora_scaled,
      help="LoRA adapter directory with its scale (FNAME:SCALE); comma-separated for several"),
    C("--control-vector", VALUE, mv="FNAME", state=NOT_APPLICABLE,
      why="mlxcel has no control-vector (residual steering) path; the nearest feature is per-request logit_bias"),
    C("--control-vector-scaled", VALUE, mv="FNAME:SCALE,...", state=NOT_APPLICABLE,
      why="mlxcel has no control-vector (residual steering) path; the nearest feature is per-request logit_bias"),
    C("--control-vector-layer-range", VALUE2, mv="START END", state=NOT_APPLICABLE, inert=always,
      why="without control vectors the layer range configures nothing"),
    C("-m, --model", VALUE, mv="FNAME", env="LLAMA_ARG_MODEL", state=ALIASED, apply=a.setter("model"),
      help="MLX checkpoint directory, owner/name repository id, or bare name", path_value=True),
    C("-mu, --model-url", VALUE, mv="MODEL_URL", env="LLAMA_ARG_MODEL_URL", state=NOT_APPLICABLE,
      apply=a.apply_model_url),
    C("-dr, --docker-repo", VALUE, mv="[<repo>/]<model>[:quant]", env="LLAMA_ARG_DOCKER_REPO", state=NOT_APPLICABLE,
      why="Docker Hub model repositories distribute GGUF; " + GGUF),
    C("-hf, -hfr, --hf-repo", VALUE, mv="<user>/<model>", env="LLAMA_ARG_HF_REPO", state=ALIASED,
      apply=a.apply_hf_repo, help="Hugging Face repository of an MLX checkpoint (wins over -m)"),
    C("-hff, --hf-file", VALUE, mv="FILE", env="LLAMA_ARG_HF_FILE", state=NOT_APPLICABLE,
      why="this selects one GGUF file in a repository; mlxcel loads a whole MLX snapshot (use --hf-repo alone)"),
    C("-hft, --hf-token", VALUE, mv="TOKEN", env="HF_TOKEN", state=ALIASED, apply=a.apply_hf_token,
      help="Hugging Face access token for downloads"),
    C("--log-disable", FLAG, state=SUPPORTED, apply=a.flag_to("log_disable"), help="disable logging"),
    C("--log-file", VALUE, mv="FNAME", env="LLAMA_ARG_LOG_FILE", state=SUPPORTED, apply=a.setter("log_file", "path"),
      help="log to this file (created with mode 0600)", path_value=True),
    C("--log-colors", VALUE, mv="[on|off|auto]", env="LLAMA_ARG_LOG_COLORS", default="auto", state=SUPPORTED,
      apply=a.apply_log_colors, help="colored log output (auto = only on a terminal)"),
    C("-v, --verbose, --log-verbose", FLAG, state=SUPPORTED, apply=a.apply_verbose, help="log every message"),
    C("--offline", FLAG, env="LLAMA_ARG_OFFLINE", default="false", state=SUPPORTED, apply=a.flag_to("offline"),
      help="never download; use the local model store only"),
    C("-lv, --verbosity, --log-verbosity", VALUE, mv="N", env="LLAMA_ARG_LOG_VERBOSITY", default="3", state=SUPPORTED,
      apply=a.apply_verbosity, help="log threshold: 0 generic, 1 error, 2 warning, 3 info, 4 trace, 5 debug"),
    C("--log-prefix, --no-log-prefix", PAIR, env="LLAMA_ARG_LOG_PREFIX", default="true", state=SUPPORTED,
      apply=a.flag_to("log_prefix"), help="level tag on each log line"),
    C("--log-timestamps, --no-log-timestamps", PAIR, env="LLAMA_ARG_LOG_TIMESTAMPS", default="true", state=SUPPORTED,
      apply=a.flag_to("log_timestamps"), help="timestamp on each log line"),
    C("--spec-draft-type-k, -ctkd, --cache-type-k-draft", VALUE, mv="TYPE", env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K",
      default="f16", state=SUPPORTED, apply=a.cache_type("spec_draft_cache_type_k"),
      help="draft model KV cache type for K (f16 only, as --cache-type-k)"),
    C("--spec-draft-type-v, -ctvd, --cache-type-v-draft", VALUE, mv="TYPE", env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V",
      default="f16", state=SUPPORTED, apply=a.cache_type("spec_draft_cache_type_v"),
      help="draft model KV cache type for V (f16 only, as --cache-type-v)"),
)

_SAMPLING: tuple[Option, ...] = (
    S("--samplers", VALUE, mv="SAMPLERS", state=SUPPORTED, apply=sa.apply_samplers,
      help=f"default sampler order, ';'-separated (default: {';'.join(_D.samplers)})"),
    S("-s, --seed", VALUE, mv="SEED", default="-1", state=SUPPORTED, apply=a.apply_seed,
      help="default RNG seed (-1 = random)"),
    S("--sampler-seq, --sampling-seq", VALUE, mv="SEQUENCE", state=SUPPORTED, apply=sa.apply_sampler_seq,
      help=f"default sampler order as one letter per stage (default: {sa.sampler_letters(_D.samplers)})"),
    S("--ignore-eos", FLAG, state=SUPPORTED, apply=sa.apply_ignore_eos,
      help="by default, ban every end-of-generation token and continue generating"),
    S("--temp, --temperature", VALUE, mv="N", default=_f(_D.temperature),
      state=BY_DESIGN, apply=a.setter("temperature", "float"),
      help=f"default temperature (unset: the checkpoint's generation_config.json, else {_f(_D.temperature)})"),
    S("--top-k", VALUE, mv="N", env="LLAMA_ARG_TOP_K", default=str(_D.top_k),
      state=BY_DESIGN, apply=a.setter("top_k", "int"),
      help=f"default top-k (0 = disabled; unset: generation_config.json, else {_D.top_k})"),
    S("--top-p", VALUE, mv="N", default=_f(_D.top_p), state=BY_DESIGN, apply=a.setter("top_p", "float"),
      help=f"default top-p (1.0 = disabled; unset: generation_config.json, else {_f(_D.top_p)})"),
    S("--min-p", VALUE, mv="N", default=_f(_D.min_p), state=BY_DESIGN, apply=a.setter("min_p", "float"),
      help=f"default min-p (0.0 = disabled; unset: generation_config.json, else {_f(_D.min_p)})"),
    S("--top-nsigma, --top-n-sigma", VALUE, mv="N", default=_f(_D.top_n_sigma), state=SUPPORTED,
      apply=sa.number("top_n_sigma"), help="default top-n-sigma (-1.0 = disabled)"),
    S("--xtc-probability", VALUE, mv="N", default=_f(_D.xtc_probability),
      state=SUPPORTED, apply=sa.number("xtc_probability"),
      help="default XTC probability (0.0 = disabled)"),
    S("--xtc-threshold", VALUE, mv="N", default=_f(_D.xtc_threshold), state=SUPPORTED, apply=sa.number("xtc_threshold"),
      help="default XTC threshold (1.0 = disabled)"),
    S("--typical, --typical-p", VALUE, mv="N", default=_f(_D.typical_p), state=SUPPORTED, apply=sa.number("typical_p"),
      help="default locally typical p (1.0 = disabled)"),
    S("--repeat-last-n", VALUE, mv="N", default=str(_D.repeat_last_n), state=SUPPORTED,
      apply=sa.number("repeat_last_n", "int", minimum=-1),
      help="default window of the repetition penalties (0 = disabled, -1 = the whole context)"),
    S("--repeat-penalty", VALUE, mv="N", default=_f(_D.repeat_penalty),
      state=SUPPORTED, apply=sa.number("repeat_penalty"),
      help="default repetition penalty (1.0 = disabled)"),
    S("--presence-penalty", VALUE, mv="N", default=_f(_D.presence_penalty),
      state=SUPPORTED, apply=sa.number("presence_penalty"),
      help="default presence penalty (0.0 = disabled)"),
    S("--frequency-penalty", VALUE, mv="N", default=_f(_D.frequency_penalty),
      state=SUPPORTED, apply=sa.number("frequency_penalty"),
      help="default frequency penalty (0.0 = disabled)"),
    S("--dry-multiplier", VALUE, mv="N", default=_f(_D.dry_multiplier),
      state=SUPPORTED, apply=sa.number("dry_multiplier"),
      help="default DRY multiplier (0.0 = disabled)"),
    S("--dry-base", VALUE, mv="N", default=_f(_D.dry_base), state=SUPPORTED, apply=sa.apply_dry_base,
      help=f"default DRY base (0 keeps {_f(_D.dry_base)})"),
    S("--dry-allowed-length", VALUE, mv="N", default=str(_D.dry_allowed_length), state=SUPPORTED,
      apply=sa.number("dry_allowed_length", "int", minimum=0), help="default DRY allowed length"),
    S("--dry-penalty-last-n", VALUE, mv="N", default=str(_D.dry_penalty_last_n), state=SUPPORTED,
      apply=sa.number("dry_penalty_last_n", "int", minimum=-1),
      help="default DRY window (0 = disabled, -1 = the context size)"),
    S("--dry-sequence-breaker", VALUE, mv="STRING", state=SUPPORTED, repeatable=True,
      apply=sa.apply_dry_sequence_breakers,
      help=f"add a DRY sequence breaker, replacing the defaults ({', '.join(map(repr, _D.dry_sequence_breakers))}); "
           '"none" clears them'),
    S("--adaptive-target", VALUE, mv="N", default=_f(_D.adaptive_target),
      state=SUPPORTED, apply=sa.number("adaptive_target"),
      help="default adaptive-p target probability (negative = disabled; active when the sampler order names "
           "adaptive_p)"),
    S("--adaptive-decay", VALUE, mv="N", default=_f(_D.adaptive_decay),
      state=SUPPORTED, apply=sa.number("adaptive_decay"),
      help="default adaptive-p decay (0.0 to 0.99)"),
    S("--dynatemp-range", VALUE, mv="N", default=_f(_D.dynatemp_range),
      state=SUPPORTED, apply=sa.number("dynatemp_range"),
      help="default dynamic temperature range (0.0 = disabled)"),
    S("--dynatemp-exp", VALUE, mv="N", default=_f(_D.dynatemp_exponent),
      state=SUPPORTED, apply=sa.number("dynatemp_exponent"),
      help="default dynamic temperature exponent"),
    S("--mirostat", VALUE, mv="N", default=str(_D.mirostat),
      state=SUPPORTED, apply=sa.number("mirostat", "int", allowed=(0, 1, 2)),
      help="default Mirostat mode (0 = disabled, 1 = Mirostat, 2 = Mirostat 2.0)"),
    S("--mirostat-lr", VALUE, mv="N", default=_f(_D.mirostat_eta), state=SUPPORTED, apply=sa.number("mirostat_eta"),
      help="default Mirostat learning rate (eta)"),
    S("--mirostat-ent", VALUE, mv="N", default=_f(_D.mirostat_tau), state=SUPPORTED, apply=sa.number("mirostat_tau"),
      help="default Mirostat target entropy (tau)"),
    S("-l, --logit-bias", VALUE, mv="TOKEN_ID(+/-)BIAS", state=BY_DESIGN, repeatable=True, apply=sa.apply_logit_bias,
      help="default logit bias of one token, e.g. 15043+1 or 15043-1 (repeatable; a request's own logit_bias "
           "replaces the set)"),
    S("--grammar", VALUE, mv="GRAMMAR", state=SUPPORTED, apply=a.apply_grammar(False),
      help="GBNF grammar constraining native completions by default"),
    S("--grammar-file", VALUE, mv="FNAME", state=SUPPORTED, path_value=True, apply=a.apply_grammar(True),
      help="file to read the default GBNF grammar from"),
    S("-j, --json-schema", VALUE, mv="SCHEMA", state=SUPPORTED, apply=a.apply_json_schema(False),
      help="JSON schema constraining native completions by default, e.g. `{}` for any JSON object"),
    S("-jf, --json-schema-file", VALUE, mv="FILE", state=SUPPORTED, path_value=True, apply=a.apply_json_schema(True),
      help="file containing the default JSON schema"),
    S("-bs, --backend-sampling", FLAG, env="LLAMA_ARG_BACKEND_SAMPLING", default="false", state=NOT_APPLICABLE,
      inert=always, why="mlxcel always samples on the MLX device"),
)

_SPEC: tuple[Option, ...] = (
    D("--spec-draft-hf, -hfd, -hfrd, --hf-repo-draft", VALUE, mv="<user>/<model>", env="LLAMA_ARG_SPEC_DRAFT_HF_REPO",
      state=ALIASED, apply=sp.apply_draft_hf, help="Hugging Face repository of the MLX draft checkpoint (wins over -md)"),
    ggml_draft("--spec-draft-threads, -td, --threads-draft", mv="N", why=THREADS, inert=le(0)),
    ggml_draft("--spec-draft-threads-batch, -tbd, --threads-batch-draft", mv="N", why=THREADS, inert=le(0)),
    ggml_draft("--spec-draft-cpu-mask, -Cd, --cpu-mask-draft", mv="M", why=POOL, inert=eq("")),
    ggml_draft("--spec-draft-cpu-range, -Crd, --cpu-range-draft", mv="lo-hi", why=POOL),
    ggml_draft("--spec-draft-cpu-strict, --cpu-strict-draft", mv="<0|1>", why=POOL, inert=eq("0")),
    ggml_draft("--spec-draft-prio, --prio-draft", mv="N", default="0", why=POOL, inert=eq("0")),
    ggml_draft("--spec-draft-poll, --poll-draft", mv="<0|1>", why=POOL, inert=eq("50")),
    ggml_draft("--spec-draft-cpu-mask-batch, -Cbd, --cpu-mask-batch-draft", mv="M", why=POOL, inert=eq("")),
    ggml_draft("--spec-draft-cpu-strict-batch, --cpu-strict-batch-draft", mv="<0|1>", why=POOL, inert=eq("0")),
    ggml_draft("--spec-draft-prio-batch, --prio-batch-draft", mv="N", default="0", why=POOL, inert=eq("0")),
    ggml_draft("--spec-draft-poll-batch, --poll-batch-draft", mv="<0|1>", why=POOL, inert=eq("50")),
    ggml_draft("--spec-draft-override-tensor, -otd, --override-tensor-draft",
               mv="<tensor name pattern>=<buffer type>,...", why=GGML_ONLY),
    ggml_draft("--spec-draft-cpu-moe, -cmoed, --cpu-moe-draft", FLAG, env="LLAMA_ARG_SPEC_DRAFT_CPU_MOE", why=MOE_CPU),
    ggml_draft("--spec-draft-n-cpu-moe, --spec-draft-ncmoe, -ncmoed, --n-cpu-moe-draft", mv="N",
               env="LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE", why=MOE_CPU, inert=eq("0")),
    D("--spec-draft-n-max", VALUE, mv="N", env="LLAMA_ARG_SPEC_DRAFT_N_MAX", default="3", state=SUPPORTED,
      apply=sp.bounded_int("spec_draft_n_max", 1), help="draft tokens per verify round (draft model)"),
    D("--spec-draft-n-min", VALUE, mv="N", env="LLAMA_ARG_SPEC_DRAFT_N_MIN", default="0", state=SUPPORTED,
      apply=sp.bounded_int("spec_draft_n_min", 0), help="a shorter draft is dropped (draft model)"),
    D("--spec-draft-p-split, --draft-p-split", VALUE, mv="P", env="LLAMA_ARG_SPEC_DRAFT_P_SPLIT", default="0.10",
      state=SUPPORTED, apply=sp.apply_p_split, help="checked and unused, as in b10621"),
    D("--spec-draft-p-min, --draft-p-min", VALUE, mv="P", env="LLAMA_ARG_SPEC_DRAFT_P_MIN", default="0.00",
      state=SUPPORTED, apply=sp.apply_p_min, help="stop drafting when the draft's top probability is lower"),
    ggml_draft("--spec-draft-backend-sampling, --no-spec-draft-backend-sampling", PAIR,
               env="LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING", default="true", why=NO_DRAFT_SAMPLING, inert=always),
    ggml_draft("--spec-draft-device, -devd, --device-draft", mv="<dev1,dev2,..>",
               why="mlxcel runs on the one MLX device and has no backend device list"),
    ggml_draft("--spec-draft-ngl, -ngld, --gpu-layers-draft, --n-gpu-layers-draft", mv="N",
               env="LLAMA_ARG_N_GPU_LAYERS_DRAFT", default="auto", why=NO_DRAFT, inert=eq("auto", "all")),
    D("--spec-draft-model, -md, --model-draft", VALUE, mv="FNAME", env="LLAMA_ARG_SPEC_DRAFT_MODEL", state=SUPPORTED,
      apply=sp.apply_draft_model, path_value=True,
      help="draft checkpoint (dir | owner/name) with the target's vocabulary; alone it selects draft-simple"),
    D("--spec-type", VALUE, mv="TYPES", env="LLAMA_ARG_SPEC_TYPE", default="none", state=SUPPORTED,
      apply=sp.apply_spec_type, help="none | draft-simple | ngram-simple (the other b10621 types are refused)"),
    D("--spec-ngram-mod-n-min", VALUE, mv="N", default="48", state=NOT_APPLICABLE, inert=eq("48"),
      why=NGRAM_OTHER.format(mode="ngram-mod")),
    D("--spec-ngram-mod-n-max", VALUE, mv="N", default="64", state=NOT_APPLICABLE, inert=eq("64"),
      why=NGRAM_OTHER.format(mode="ngram-mod")),
    D("--spec-ngram-mod-n-match", VALUE, mv="N", default="24", state=NOT_APPLICABLE, inert=eq("24"),
      why=NGRAM_OTHER.format(mode="ngram-mod")),
    D("--spec-ngram-simple-size-n", VALUE, mv="N", default="12", state=SUPPORTED,
      apply=sp.bounded_int("spec_ngram_simple_size_n", 1), help="ngram-simple: length of the looked-up n-gram"),
    D("--spec-ngram-simple-size-m", VALUE, mv="N", default="48", state=SUPPORTED,
      apply=sp.bounded_int("spec_ngram_simple_size_m", 1), help="ngram-simple: longest continuation drafted"),
    D("--spec-ngram-simple-min-hits", VALUE, mv="N", default="1", state=SUPPORTED,
      apply=sp.bounded_int("spec_ngram_simple_min_hits", 0), help="checked; ngram-simple never reads it, as in b10621"),
    D("--spec-ngram-map-k-size-n", VALUE, mv="N", default="12", state=NOT_APPLICABLE, inert=eq("12"),
      why=NGRAM_OTHER.format(mode="ngram-map-k")),
    D("--spec-ngram-map-k-size-m", VALUE, mv="N", default="48", state=NOT_APPLICABLE, inert=eq("48"),
      why=NGRAM_OTHER.format(mode="ngram-map-k")),
    D("--spec-ngram-map-k-min-hits", VALUE, mv="N", default="1", state=NOT_APPLICABLE, inert=eq("1"),
      why=NGRAM_OTHER.format(mode="ngram-map-k")),
    D("--spec-ngram-map-k4v-size-n", VALUE, mv="N", default="12", state=NOT_APPLICABLE, inert=eq("12"),
      why=NGRAM_OTHER.format(mode="ngram-map-k4v")),
    D("--spec-ngram-map-k4v-size-m", VALUE, mv="N", default="48", state=NOT_APPLICABLE, inert=eq("48"),
      why=NGRAM_OTHER.format(mode="ngram-map-k4v")),
    D("--spec-ngram-map-k4v-min-hits", VALUE, mv="N", default="1", state=NOT_APPLICABLE, inert=eq("1"),
      why=NGRAM_OTHER.format(mode="ngram-map-k4v")),
    # removed upstream: b10621 itself refuses these, so refusing them is matching behaviour
    D("--draft, --draft-n, --draft-max", VALUE, mv="N", env="LLAMA_ARG_DRAFT_MAX", state=SUPPORTED, hidden=True,
      why=_removed("--spec-draft-n-max or --spec-ngram-mod-n-max")),
    D("--draft-min, --draft-n-min", VALUE, mv="N", env="LLAMA_ARG_DRAFT_MIN", state=SUPPORTED, hidden=True,
      why=_removed("--spec-draft-n-min or --spec-ngram-mod-n-min")),
    D("--spec-ngram-size-n", VALUE, mv="N", state=SUPPORTED, hidden=True,
      why=_removed("the respective --spec-ngram-*-size-n or --spec-ngram-mod-n-match")),
    D("--spec-ngram-size-m", VALUE, mv="N", state=SUPPORTED, hidden=True,
      why=_removed("the respective --spec-ngram-*-size-m")),
    D("--spec-ngram-min-hits", VALUE, mv="N", state=SUPPORTED, hidden=True,
      why=_removed("the respective --spec-ngram-*-min-hits")),
)

NO_SLOT_STATE = ("mlxcel keeps no per-slot retained prompts, shared KV buffer or checkpoint ring; "
                 "prompt reuse goes through one process-wide prefix cache")

_SERVER: tuple[Option, ...] = (
    X("-lcs, --lookup-cache-static", VALUE, mv="FNAME", state=NOT_APPLICABLE, path_value=True, apply=sp.refuse_lookup_cache),
    X("-lcd, --lookup-cache-dynamic", VALUE, mv="FNAME", state=NOT_APPLICABLE, path_value=True,
      apply=sp.refuse_lookup_cache),
    X("-ctxcp, --ctx-checkpoints, --swa-checkpoints", VALUE, mv="N", env="LLAMA_ARG_CTX_CHECKPOINTS", default="32",
      state=NOT_APPLICABLE, inert=eq("0"), why=NO_SLOT_STATE + " (accepted: 0)"),
    X("-cms, --checkpoint-min-step", VALUE, mv="N", env="LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT", default="8192",
      state=NOT_APPLICABLE, inert=always, why="without context checkpoints the spacing configures nothing"),
    X("-cram, --cache-ram", VALUE, mv="N", env="LLAMA_ARG_CACHE_RAM", default="8192", state=ALIASED,
      apply=a.apply_cache_ram, help="prompt cache budget in MiB (-1 = no limit, 0 = disable; mlxcel default 2048)"),
    X("-kvu, --kv-unified, -no-kvu, --no-kv-unified", PAIR, env="LLAMA_ARG_KV_UNIFIED", state=NOT_APPLICABLE,
      inert=only_negative_form, why="mlxcel allocates KV per sequence and has no unified KV buffer; "
      "use --parallel 1 to give one request the whole context"),
    X("--cache-idle-slots, --no-cache-idle-slots", PAIR, env="LLAMA_ARG_CACHE_IDLE_SLOTS", default="true",
      state=NOT_APPLICABLE, inert=only_negative_form, why=NO_SLOT_STATE),
    X("--context-shift, --no-context-shift", PAIR, env="LLAMA_ARG_CONTEXT_SHIFT", default="false", state=BY_DESIGN,
      apply=a.flag_to("context_shift"), help="at the context bound, drop tokens after --keep instead of stopping"),
    X("-r, --reverse-prompt", VALUE, mv="PROMPT", state=NOT_APPLICABLE,
      why="an interactive-mode option; use the per-request stop field"),
    X("-sp, --special", FLAG, default="false", state=SUPPORTED, apply=a.flag_to("special"),
      help="output generated special tokens as their text"),
    X("--warmup, --no-warmup", PAIR, default="true", state=SUPPORTED, apply=a.flag_to("warmup"),
      help="run a warmup pass at startup"),
    X("--spm-infill", FLAG, default="false", state=SUPPORTED, apply=a.flag_to("spm_infill"),
      help="/infill puts the suffix block before the prefix block (Suffix/Prefix/Middle)"),
    X("--pooling", VALUE, mv="{none,mean,cls,last,rank}", env="LLAMA_ARG_POOLING", state=BY_DESIGN,
      apply=a.apply_pooling, help="embedding pooling: mean, cls or last (rank = --reranking; none is refused)"),
    X("-np, --parallel", VALUE, mv="N", env="LLAMA_ARG_N_PARALLEL", default="-1", state=BY_DESIGN,
      apply=a.apply_parallel, help="number of server slots (-1 = auto = 4)"),
    X("-cb, --cont-batching, -nocb, --no-cont-batching", PAIR, env="LLAMA_ARG_CONT_BATCHING", default="true",
      state=SUPPORTED, apply=a.flag_to("cont_batching"), help="continuous batching"),
    X("-mm, --mmproj", VALUE, mv="FILE", env="LLAMA_ARG_MMPROJ", state=NOT_APPLICABLE,
      why="there is no separate projector file for an MLX checkpoint; point -m at an MLX vision-language checkpoint"),
    X("-mmu, --mmproj-url", VALUE, mv="URL", env="LLAMA_ARG_MMPROJ_URL", state=NOT_APPLICABLE,
      why="there is no separate projector file for an MLX checkpoint; point -m at an MLX vision-language checkpoint"),
    X("--mmproj-auto, --no-mmproj, --no-mmproj-auto", PAIR, env="LLAMA_ARG_MMPROJ_AUTO", default="true",
      state=ALIASED, apply=a.flag_to("mmproj"),
      help="admit image parts for a vision-language checkpoint (--no-mmproj refuses every media part)"),
    X("--mmproj-offload, --no-mmproj-offload", PAIR, env="LLAMA_ARG_MMPROJ_OFFLOAD", default="true",
      state=NOT_APPLICABLE, inert=only_positive_form, why="mlxcel has no host-side projector path"),
    X("-mmdev, --mmproj-device", VALUE, mv="DEVICE", env="MTMD_BACKEND_DEVICE", state=NOT_APPLICABLE,
      why="the whole checkpoint runs on the one MLX device"),
    X("--image-min-tokens", VALUE, mv="N", env="LLAMA_ARG_IMAGE_MIN_TOKENS", state=ALIASED,
      apply=a.apply_image_tokens("image_min_tokens"),
      help="minimum tokens per image on a dynamic-resolution processor (<= 0: the checkpoint's own)"),
    X("--image-max-tokens", VALUE, mv="N", env="LLAMA_ARG_IMAGE_MAX_TOKENS", state=ALIASED,
      apply=a.apply_image_tokens("image_max_tokens"),
      help="maximum tokens per image on a dynamic-resolution processor (<= 0: the checkpoint's own)"),
    X("--mtmd-batch-max-tokens", VALUE, mv="N", env="LLAMA_ARG_MTMD_BATCH_MAX_TOKENS", default="1024",
      state=NOT_APPLICABLE, inert=eq("1024"),
      why="mlxcel encodes each image in one vision-tower forward and has no image-token batch to bound "
          "(accepted: 1024)"),
    X("-a, --alias", VALUE, mv="STRING", env="LLAMA_ARG_ALIAS", state=ALIASED, apply=a.apply_alias,
      help="model name aliases, comma-separated"),
    X("--tags", VALUE, mv="STRING", env="LLAMA_ARG_TAGS", state=SUPPORTED, repeatable=True, apply=a.apply_tags,
      help="informational model tags, comma-separated, reported on the model's /v1/models entry"),
    X("--embd-normalize", VALUE, mv="N", default="2", state=BY_DESIGN, apply=a.apply_embd_normalize,
      help="embedding normalization: -1 none, 0 max-abs (int16), 1 taxicab, 2 euclidean, >2 p-norm "
           "(default: the checkpoint's own normalize flag)"),
    X("--host", VALUE, mv="HOST", env="LLAMA_ARG_HOST", default="127.0.0.1", state=SUPPORTED, apply=a.apply_host,
      help="address to listen on; a value ending in .sock binds a Unix socket"),
    X("--port", VALUE, mv="PORT", env="LLAMA_ARG_PORT", default="8080", state=SUPPORTED, apply=a.apply_port,
      help="port to listen on (0 = any free port)"),
    X("--reuse-port", FLAG, env="LLAMA_ARG_REUSE_PORT", default="false", state=SUPPORTED,
      apply=a.flag_to("reuse_port"), help="bind the listening port with SO_REUSEPORT, so several servers can share it"),
    X("--path", VALUE, mv="PATH", env="LLAMA_ARG_STATIC_PATH", default="", state=NOT_APPLICABLE, inert=eq(""), why=UI),
    X("--cors-origins", VALUE, mv="ORIGINS", env="LLAMA_ARG_CORS_ORIGINS", default="*", state=SUPPORTED,
      apply=a.setter("cors_origins"), help="allowed CORS origins, comma-separated ('localhost' = local origins only)"),
    X("--cors-methods", VALUE, mv="METHODS", env="LLAMA_ARG_CORS_METHODS", default="GET, POST, DELETE, OPTIONS",
      state=SUPPORTED, apply=a.setter("cors_methods"), help="methods announced on CORS preflights"),
    X("--cors-headers", VALUE, mv="HEADERS", env="LLAMA_ARG_CORS_HEADERS", default="*", state=SUPPORTED,
      apply=a.setter("cors_headers"), help="headers announced on CORS preflights"),
    X("--cors-credentials, --no-cors-credentials", PAIR, env="LLAMA_ARG_CORS_CREDENTIALS", default="true",
      state=SUPPORTED, apply=a.flag_to("cors_credentials"), help="allow credentials on CORS requests"),
    X("--api-prefix", VALUE, mv="PREFIX", env="LLAMA_ARG_API_PREFIX", default="", state=SUPPORTED,
      apply=a.apply_api_prefix, help="path prefix every route is served under, without a trailing slash"),
    X("--ui-config, --webui-config", VALUE, mv="JSON", env="LLAMA_ARG_UI_CONFIG", state=NOT_APPLICABLE, why=UI),
    X("--ui-config-file, --webui-config-file", VALUE, mv="PATH", env="LLAMA_ARG_UI_CONFIG_FILE", state=NOT_APPLICABLE,
      why=UI),
    X("--ui-mcp-proxy, --webui-mcp-proxy, --no-ui-mcp-proxy, --no-webui-mcp-proxy", PAIR, env="LLAMA_ARG_UI_MCP_PROXY",
      default="false", state=NOT_APPLICABLE, inert=only_negative_form, why=UI),
    X("--tools", VALUE, mv="TOOL1,TOOL2,...", env="LLAMA_ARG_TOOLS", state=NOT_APPLICABLE, why=UI),
    X("--tools-runtime", VALUE, mv="OPTION", env="LLAMA_ARG_TOOLS_RUNTIME", state=NOT_APPLICABLE, why=UI),
    X("--mcp-servers-config", VALUE, mv="PATH", env="LLAMA_ARG_MCP_SERVERS_CONFIG", state=NOT_APPLICABLE, why=UI),
    X("--mcp-servers-json", VALUE, mv="JSON", env="LLAMA_ARG_MCP_SERVERS_JSON", state=NOT_APPLICABLE, why=UI),
    X("-ag, --agent, -no-ag, --no-agent", PAIR, env="LLAMA_ARG_AGENT", default="false", state=NOT_APPLICABLE,
      inert=only_negative_form, why=UI),
    X("--ui, --webui, --no-ui, --no-webui", PAIR, env="LLAMA_ARG_UI", default="true", state=NOT_APPLICABLE,
      inert=only_negative_form, why=UI),
    X("--embedding, --embeddings", FLAG, env="LLAMA_ARG_EMBEDDINGS", default="false", state=BY_DESIGN,
      apply=a.flag_to("embedding"),
      help="serve embeddings only, from -m or --embedding-model (an embedding checkpoint); generation is off"),
    X("--rerank, --reranking", FLAG, env="LLAMA_ARG_RERANKING", default="false", state=BY_DESIGN,
      apply=a.flag_to("reranking"),
      help="serve reranking only, from -m or --reranker-model (a cross-encoder); generation is off"),
    X("--api-key", VALUE, mv="KEY", env="LLAMA_API_KEY", state=SUPPORTED, apply=a.apply_api_key,
      help="API key(s) required on requests, comma-separated"),
    X("--api-key-file", VALUE, mv="FNAME", env="LLAMA_ARG_API_KEY_FILE", state=SUPPORTED, apply=a.apply_api_key_file,
      help="file of API keys, one per line ('#' starts a comment)", path_value=True),
    X("--ssl-key-file", VALUE, mv="FNAME", env="LLAMA_ARG_SSL_KEY_FILE", state=SUPPORTED,
      apply=a.setter("ssl_key_file", "path"), help="PEM private key for TLS", path_value=True),
    X("--ssl-cert-file", VALUE, mv="FNAME", env="LLAMA_ARG_SSL_CERT_FILE", state=SUPPORTED,
      apply=a.setter("ssl_cert_file", "path"), help="PEM certificate for TLS", path_value=True),
    X("--chat-template-kwargs", VALUE, mv="STRING", env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS", state=SUPPORTED,
      apply=a.apply_chat_template_kwargs, help="JSON object of extra chat-template context (per-request "
      "chat_template_kwargs override it)"),
    X("-to, --timeout", VALUE, mv="N", env="LLAMA_ARG_TIMEOUT", default="3600", state=SUPPORTED, apply=a.apply_timeout,
      help="HTTP socket read/write timeout in seconds"),
    X("--sse-ping-interval", VALUE, mv="N", env="LLAMA_ARG_SSE_PING_INTERVAL", default="30", state=SUPPORTED,
      apply=a.setter("sse_ping_interval", "int"), help="SSE keep-alive ping interval in seconds (-1 = off)"),
    X("--threads-http", VALUE, mv="N", env="LLAMA_ARG_THREADS_HTTP", default="-1", state=NOT_APPLICABLE, inert=always,
      why="the HTTP server is asynchronous and has no thread pool to size"),
    X("--cache-prompt, --no-cache-prompt", PAIR, env="LLAMA_ARG_CACHE_PROMPT", default="true", state=SUPPORTED,
      apply=a.flag_to("cache_prompt"), help="prompt prefix caching"),
    X("--cache-reuse", VALUE, mv="N", env="LLAMA_ARG_CACHE_REUSE", default="0", state=NOT_APPLICABLE, inert=eq("0"),
      why="mlxcel's prompt cache reuses strict token prefixes only and cannot shift cached RoPE positions to reuse "
          "a non-prefix chunk (accepted: 0)"),
    X("--metrics", FLAG, env="LLAMA_ARG_ENDPOINT_METRICS", default="false", state=SUPPORTED,
      apply=a.flag_to("metrics"), help="enable GET /metrics"),
    X("--props", FLAG, env="LLAMA_ARG_ENDPOINT_PROPS", default="false", state=SUPPORTED,
      apply=a.flag_to("props"), help="enable POST /props"),
    X("--slots, --no-slots", PAIR, env="LLAMA_ARG_ENDPOINT_SLOTS", default="true", state=SUPPORTED,
      apply=a.flag_to("slots"), help="expose GET /slots"),
    X("--slot-save-path", VALUE, mv="PATH", state=BY_DESIGN, path_value=True, apply=a.apply_slot_save_path,
      help="directory for POST /slots/{id}?action=save|restore files (a slot's token stream, not its KV)"),
    X("--media-path", VALUE, mv="PATH", state=ALIASED, path_value=True, apply=a.apply_media_path,
      help="directory file:// media URLs resolve under: a path is taken relative to it first, an absolute path "
           "naming a file inside it is accepted too; nothing may leave it (default: file:// refused)"),
    X("--models-dir", VALUE, mv="PATH", env="LLAMA_ARG_MODELS_DIR", state=ALIASED, path_value=True,
      apply=a.setter("models_dir", "path"),
      help="router mode: serve every checkpoint directory under PATH on demand (mlxcel/router)"),
    X("--models-preset", VALUE, mv="PATH", env="LLAMA_ARG_MODELS_PRESET", state=ALIASED, path_value=True,
      apply=a.setter("models_preset", "path"), help="router mode: INI file of model presets"),
    X("--models-max", VALUE, mv="N", env="LLAMA_ARG_MODELS_MAX", default="4", state=SUPPORTED,
      apply=a.apply_models_max, help="router mode: models loaded at once, least recently used unloaded past it "
      "(0 = unlimited)"),
    X("--models-autoload, --no-models-autoload", PAIR, env="LLAMA_ARG_MODELS_AUTOLOAD", default="true",
      state=SUPPORTED, apply=a.flag_to("models_autoload"),
      help="router mode: load a requested model on demand (per request: ?autoload=)"),
    X("--jinja, --no-jinja", PAIR, env="LLAMA_ARG_JINJA", default="true", state=NOT_APPLICABLE,
      inert=only_positive_form, why="mlxcel always renders the checkpoint's Jinja chat template"),
    X("--reasoning-format", VALUE, mv="FORMAT", env="LLAMA_ARG_THINK", default="auto", state=BY_DESIGN,
      apply=a.apply_reasoning_format, help="where thoughts go: none | deepseek | deepseek-legacy | auto "
      "(auto resolves to deepseek)"),
    X("-rea, --reasoning", VALUE, mv="[on|off|auto]", env="LLAMA_ARG_REASONING", default="auto", state=SUPPORTED,
      apply=a.apply_reasoning, help="enable_thinking for the chat template (auto: the template's default)"),
    X("--reasoning-effort", VALUE, mv="LEVEL", env="LLAMA_ARG_REASONING_EFFORT", default="default", state=SUPPORTED,
      apply=a.apply_reasoning_effort, help="reasoning_effort for the chat template"),
    X("--reasoning-budget", VALUE, mv="N", env="LLAMA_ARG_THINK_BUDGET", default="-1", state=SUPPORTED,
      apply=a.apply_reasoning_budget, help="thinking tokens allowed before the close tag is forced (-1: no limit, "
      "0: close at once)"),
    X("--reasoning-budget-message", VALUE, mv="MESSAGE", env="LLAMA_ARG_THINK_BUDGET_MESSAGE", state=SUPPORTED,
      apply=a.setter("reasoning_budget_message"), help="text forced before the close tag when the budget runs out"),
    X("--reasoning-preserve, --no-reasoning-preserve", PAIR, env="LLAMA_ARG_REASONING_PRESERVE", state=SUPPORTED,
      apply=a.apply_reasoning_preserve, help="preserve_reasoning for the chat template"),
    X("--chat-template", VALUE, mv="JINJA_TEMPLATE", env="LLAMA_ARG_CHAT_TEMPLATE", state=SUPPORTED,
      apply=_chat_template(False), help="Jinja chat template used instead of the checkpoint's (wins over "
      "--chat-template-file; built-in template names are refused)"),
    X("--chat-template-file", VALUE, mv="JINJA_TEMPLATE_FILE", env="LLAMA_ARG_CHAT_TEMPLATE_FILE", state=SUPPORTED,
      apply=_chat_template(True), path_value=True, help="file holding a Jinja chat template used instead of "
      "the checkpoint's"),
    X("--skip-chat-parsing, --no-skip-chat-parsing", PAIR, env="LLAMA_ARG_SKIP_CHAT_PARSING", default="false",
      state=SUPPORTED, apply=a.flag_to("skip_chat_parsing"),
      help="report the raw generation as content (no reasoning or tool-call parsing)"),
    X("--prefill-assistant, --no-prefill-assistant", PAIR, env="LLAMA_ARG_PREFILL_ASSISTANT", default="true",
      state=SUPPORTED, apply=a.flag_to("prefill_assistant"),
      help="a trailing assistant message is a prefix to continue"),
    X("-sps, --slot-prompt-similarity", VALUE, mv="SIMILARITY", default="0.10", state=NOT_APPLICABLE, inert=eq("0"),
      why="mlxcel has no slot-selection policy to tune (accepted: 0.0)"),
    X("--lora-init-without-apply", FLAG, default="false", state=SUPPORTED, apply=a.flag_to("lora_init_without_apply"),
      help="load the LoRA adapters at scale 0.0 (raise them later with POST /lora-adapters)"),
    X("--sleep-idle-seconds", VALUE, mv="SECONDS", default="-1", state=BY_DESIGN,
      apply=a.setter("sleep_idle_seconds", "int"),
      help="unload the model after this many idle seconds and reload it on the next request (< 0: never)"),
    X("--log-prompts-dir", VALUE, mv="PATH", state=NOT_APPLICABLE, apply=_log_prompts_dir),
    *(_preset(n) for n in PRESETS),
    _preset("--spec-default"),
)

_NATIVE: tuple[Option, ...] = (
    make("--model-store-root", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="DIR",
         apply=a.setter("model_store_root", "path"), path_value=True,
         help="the local model store (default: $MLXCEL_MODELS_DIR, else ~/.cache/mlxcel/models)"),
    make("--state-dir", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="DIR",
         apply=a.setter("state_dir", "path"), path_value=True,
         help="server state (steering profiles and clusters, SQLite; default: <model store root>/.mlxcel-state)"),
    make("--dtype", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="{auto,float16,bfloat16,float32}",
         apply=lambda s, v, sp: setattr(s, "dtype", a.one_of(v, sp, ("auto", "float16", "bfloat16", "float32"))),
         help="compute dtype for unquantized weights"),
    make("--prompt-cache-capacity-bytes", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="N",
         apply=lambda s, v, sp: setattr(s, "prompt_cache_capacity_bytes", max(a.as_int(v, sp), -1)),
         help="prompt cache budget in bytes (-1 = no limit, 0 = disable); wins over --cache-ram"),
    make("--backend", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="{auto,mlx,torch}",
         apply=lambda s, v, sp: setattr(s, "backend", a.one_of(v, sp, ("auto", "mlx", "torch"))),
         help="inference backend: auto = MLX on Apple Silicon, torch on CUDA and on other CPUs (default: auto)"),
    make("--torch-compile", FLAG, section=NATIVE, state=SUPPORTED, native=True, apply=a.flag_to("torch_compile"),
         help="run the torch backend's forward through torch.compile (slow first steps while it compiles; "
              "off by default, see docs/benchmarks.md); refused on the MLX backend"),
    make("--max-queue-depth", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="N",
         apply=lambda s, v, sp: setattr(s, "max_queue_depth", max(a.as_int(v, sp), -1)),
         help="requests that may wait for a slot before new ones get 503 (default: 64, -1 = unbounded)"),
    make("--graceful-unload-timeout", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="SECONDS",
         env="GRACEFUL_UNLOAD_TIMEOUT",
         apply=lambda s, v, sp: setattr(s, "graceful_unload_timeout", max(a.as_float(v, sp), 0.0)),
         help="a model switch waits this long for running requests before unloading (default: 30)"),
    make("--model-memory-budget", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="MiB",
         apply=lambda s, v, sp: setattr(s, "model_memory_budget_mib", max(a.as_int(v, sp), 0)),
         help="weights a model switch may load, in MiB (default: the free memory after the unload)"),
    make("--embedding-model", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="MODEL",
         apply=a.setter("embedding_model"), help="embedding checkpoint served on the embedding routes"),
    make("--reranker-model", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="MODEL",
         apply=a.setter("reranker_model"), help="cross-encoder checkpoint served on the rerank routes"),
    make("--reasoning-alias-field", VALUE, section=NATIVE, state=SUPPORTED, native=True, mv="{none,reasoning}",
         apply=lambda s, v, sp: setattr(s, "reasoning_alias_field", a.one_of(v, sp, ("none", "reasoning"))),
         help="also report reasoning_content as 'reasoning' on chat messages and deltas (OpenRouter-style "
              "clients; default: reasoning), or none for b10621's field alone"),
    make("--dump-flag-surface", FLAG, section=NATIVE, state=SUPPORTED, native=True, hidden=True,
         apply=lambda *_: None),
)

TABLE: tuple[Option, ...] = _COMMON + _SAMPLING + _SPEC + _SERVER + _NATIVE
SECTIONS = (COMMON, SAMPLING, SPEC, SERVER, NATIVE)

# every spelling -> (option, is_positive)
BY_SPELLING: dict[str, tuple[Option, bool]] = {}
for _o in TABLE:
    for _s in _o.longs + _o.shorts:
        BY_SPELLING[_s] = (_o, True)
    for _s in _o.neg_longs + _o.neg_shorts:
        BY_SPELLING[_s] = (_o, False)


def b10621_entries() -> list[Option]:
    return [o for o in TABLE if o.entry is not None]
