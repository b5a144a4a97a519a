"""`mlxcel generate` and `mlxcel chat`: the engine from a terminal.

Both load the model exactly as the server does (mlxcel.runtime.load) and stream the engine's
token events to stdout, so what a user sees here is what a client of the server gets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from mlxcel.chat.chat_template import render_chat, render_plain, thinking_by_default
from mlxcel.config.settings import BackendSection, EngineSection, SamplingSection, ServerSettings, SourceSection
from mlxcel.engine.types import GenerationRequest
from mlxcel.store.paths import store_root
from mlxcel.store.resolve import ModelNotAvailable, ModelSourceRefused, resolve_model


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="checkpoint directory, owner/name, or bare name")
    p.add_argument("--models-dir", "--model-store-root", dest="store", type=Path, help="model store root")
    p.add_argument("--offline", action="store_true", help="never download")
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=None, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=-1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backend", default="auto", choices=("auto", "mlx", "torch"))
    p.add_argument("--device", default=os.environ.get("MLXCEL_DEVICE", "auto"),
                   help="auto, cpu, cuda[:N], mps, metal (env: MLXCEL_DEVICE)")
    p.add_argument("-t", "--threads", type=int, default=-1,
                   help="CPU threads (torch: its thread count; MLX CPU: threads per large product; -1 = default)")


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion for a prompt")
    _common(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    g.set_defaults(func=run_generate)
    c = sub.add_parser("chat", help="an interactive chat in the terminal")
    _common(c)
    c.add_argument("--system", default=None, help="a system message")
    c.set_defaults(func=run_chat)


def _load(args):
    from mlxcel.cli.server import enable_fast_blas, prepare_cpu_runtime, refuse_unsupported

    enable_fast_blas()  # before mlx.core is imported by the runtime
    from mlxcel.runtime.load import load_served_model

    prepare_cpu_runtime(os.environ)
    try:
        path = resolve_model(args.model, root=store_root(args.store, os.environ),
                             default_org=os.environ.get("MLXCEL_DEFAULT_ORG", "mlx-community"),
                             offline=args.offline)
    except (ModelSourceRefused, ModelNotAvailable) as e:
        raise SystemExit(f"error: {e}") from None
    refuse_unsupported(json.loads((path / "config.json").read_text()))  # before any weight is read
    settings = ServerSettings(source=SourceSection(model=args.model),
                              engine=EngineSection(parallel=1, warmup=False),
                              backend=BackendSection(name=args.backend, device=args.device, dtype=args.dtype,
                                                     threads=args.threads),
                              sampling=SamplingSection(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                                                       min_p=args.min_p, seed=args.seed))
    return load_served_model(settings, path)


async def _stream(model, prompt: list[int], max_tokens: int, out=sys.stdout) -> str:
    handle = model.engine.submit(GenerationRequest(prompt=prompt, params=model.defaults, max_tokens=max_tokens))
    parts = []
    async for ev in handle:
        if ev.error:
            raise SystemExit(f"error: {ev.error}")
        out.write(ev.text)
        out.flush()
        parts.append(ev.text)
    return "".join(parts)


def _chat_prompt(model, messages) -> list[int]:
    tok = model.tokenizer
    if not tok.chat_template:
        return tok.encode(render_plain(messages), add_special_tokens=False)
    # the server's --reasoning auto: thinking on where the template has a thinking mode
    thinking = thinking_by_default(tok.chat_template, tok.bos_token, tok.eos_token)
    text = render_chat(tok.chat_template, messages, bos_token=tok.bos_token, eos_token=tok.eos_token,
                       extra={"enable_thinking": thinking})
    return tok.encode(text, add_special_tokens=False)


def run_generate(args) -> int:
    model = _load(args)
    if args.chat:
        prompt = _chat_prompt(model, [{"role": "user", "content": args.prompt}])
    else:
        prompt = model.tokenizer.encode(args.prompt)
    try:
        asyncio.run(_stream(model, prompt, args.max_tokens))
    finally:
        model.engine.shutdown()
    print()
    _exit(0)


def run_chat(args) -> int:
    model = _load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []

    async def loop() -> None:
        while True:
            try:
                line = await asyncio.to_thread(input, ">>> ")
            except EOFError:
                return
            if line.strip() in ("/exit", "/quit"):
                return
            messages.append({"role": "user", "content": line})
            reply = await _stream(model, _chat_prompt(model, messages), args.max_tokens)
            print()
            messages.append({"role": "assistant", "content": reply})

    try:
        asyncio.run(loop())
    finally:
        model.engine.shutdown()
    _exit(0)


def _exit(code: int) -> None:
    """Leave without interpreter teardown: MLX's native threads can abort the process while
    static destructors run (seen as 'terminate called without an active exception')."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
