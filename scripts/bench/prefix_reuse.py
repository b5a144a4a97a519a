"""What the prompt cache saves on warm requests: prompt tokens supplied from cache, tokens run,
and prompt time, for two chat shapes on one loaded model (in process, greedy). Prints text;
not a test.

    python -m scripts.bench.prefix_reuse -m models/HuggingFaceTB/SmolLM2-135M-Instruct --backend torch

Shapes: `system` (requests sharing a system prompt, each with its own question; the first is
cold and left out) and `turns` (one conversation, each turn's prompt the whole history so far,
the model's own replies included). Prompts are SmolLM2's ChatML, written out here. With
`--draft PATH` the model speculates with that draft checkpoint (draft-simple, n_max 3), and the
decode time after the first token shows what the draft's own prefix cache saves.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from pathlib import Path

SYSTEM = ("You are a careful assistant for a small bicycle repair shop. Answer in one or two short "
          "sentences, name the tool needed, and say when a customer should bring the bike in instead.")
QUESTIONS = ["How do I fix a flat tyre?", "My chain keeps slipping, why?", "What pressure should road tyres have?",
             "How often should I oil the chain?", "The brakes squeal when wet.", "Can I true a wheel at home?",
             "Which grease goes on the headset?", "My gears click in the highest cog.", "How tight is a stem bolt?"]


def chatml(messages: list[tuple[str, str]]) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages) + "<|im_start|>assistant\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--backend", choices=("torch", "mlx"), default="torch")
    p.add_argument("--tokens", type=int, default=12, help="tokens generated per request")
    p.add_argument("--draft", type=Path, help="a draft checkpoint: speculate with it")
    p.add_argument("--system-repeat", type=int, default=1, help="the system prompt this many times over (longer prompts)")
    args = p.parse_args()

    from mlxcel.cli.flags import BUILD_ENV
    from mlxcel.config.settings import BackendSection, EngineSection, ServerSettings, SourceSection
    from mlxcel.engine.sampling_params import SamplingParams
    from mlxcel.engine.speculative import DRAFT, SpecConfig
    from mlxcel.engine.types import GenerationRequest
    from mlxcel.runtime.load import load_served_model
    from mlxcel.runtime.served import Startup

    spec = SpecConfig(kind=DRAFT, n_max=3, draft_model=args.draft) if args.draft else None
    settings = ServerSettings(source=SourceSection(model=str(args.model)),
                              engine=EngineSection(ctx_size=8192, parallel=4, warmup=False),
                              backend=BackendSection(name=args.backend,
                                                     build_env={k: os.environ[k] for k in BUILD_ENV if k in os.environ}))
    system = " ".join([SYSTEM] * args.system_repeat)
    model = load_served_model(settings, args.model, startup=Startup(speculative=spec))
    greedy = SamplingParams(temperature=0.0)

    async def ask(text: str):
        prompt = model.tokenizer.encode(text)
        handle = model.engine.submit(GenerationRequest(prompt=prompt, params=greedy, max_tokens=args.tokens))
        out, last = [], None
        async for ev in handle:
            if ev.token is not None:
                out.append(ev.token)
            last = ev
        assert last.error is None, last.error
        return model.tokenizer.decode(out), last.timings

    async def shapes():
        shared = [(await ask(chatml([("system", system), ("user", q)])))[1] for q in QUESTIONS]
        history, turns = [("system", system)], []
        for q in QUESTIONS[:5]:
            history.append(("user", q))
            reply, t = await ask(chatml(history))
            history.append(("assistant", reply))
            turns.append(t)
        return {"system": shared[1:], "turns": turns[1:]}

    try:
        for shape, timings in asyncio.run(shapes()).items():
            cache_n = [t.cache_n for t in timings]
            prompt_n = [t.prompt_n for t in timings]
            ms = [t.prompt_ms for t in timings]
            decode = [t.predicted_ms for t in timings]
            print(f"{args.backend} {shape}: {len(timings)} warm requests; cache_n {cache_n}; prompt_n {prompt_n}; "
                  f"prompt ms median {statistics.median(ms):.1f} mean {statistics.mean(ms):.1f}; "
                  f"decode ms median {statistics.median(decode):.1f}")
    finally:
        model.engine.shutdown()


if __name__ == "__main__":
    main()
