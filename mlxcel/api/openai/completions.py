"""POST /v1/completions: raw prompts (no chat template) -> engine -> OpenAI text shapes.

Each prompt of a list has `n` choices, each its own engine row with its own seed (the seed
of choice j is row j's, as on chat, so a prompt's choices reproduce alone or in a list);
choice `prompt_index * n + j` answers prompt `prompt_index`. `logprobs` (an int) reports
each generated token's log-probability and that many alternatives, and `echo` opens each
choice with its prompt (with logprobs, the prompt tokens' too; logprobs.py).
With `allowed_token_ids` the request is a scoring request instead: one forward per prompt,
nothing generated (scoring.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
import copy
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, post
from litestar.response import Stream

from mlxcel.api import stream_runner as runner
from mlxcel.api.body import check_count, convert, read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.model_switch import model_for
from mlxcel.api.openai import generation as g
from mlxcel.api.openai import logprobs as lp
from mlxcel.api.openai import scoring as sc
from mlxcel.api.openai.encoders import CompletionEncoder
from mlxcel.api.openai.fields import COMPLETIONS, check_fields, object_locations, settle_unused, strict_mode
from mlxcel.api.openai.schemas import CompletionRequest
from mlxcel.api.state import AppState
from mlxcel.api.openai import response_format as rf
from mlxcel.api.stream_runner import Job, Run
from mlxcel.config.limits import MAX_CHOICES, MAX_PROMPTS
from mlxcel.engine.types import GenerationRequest, TokenEvent
from mlxcel.runtime.served import ServedModel
from mlxcel.steering import requests as steer


def tokenize_prompts(model: ServedModel, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
    """A string, a list of strings, a token list, or a list of token lists."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt, add_special_tokens=add_special_tokens)]
    elif prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [tok.encode(p, add_special_tokens=add_special_tokens) for p in prompt]
    elif all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids, "
                       "or a list of token-id lists", code="invalid_parameter", param="prompt")
    if not prompts:
        raise ApiError(400, "prompt must not be empty", code="invalid_parameter", param="prompt")
    vocab = model.info.vocab_size
    for i, p in enumerate(prompts):
        if any(not 0 <= t < vocab for t in p):
            raise ApiError(400, f"prompt[{i}] holds a token id outside the vocabulary", code="invalid_parameter",
                           param="prompt")
    return prompts


def _prompt_texts(model: ServedModel, prompt: Any, tokens: list[list[int]]) -> list[str]:
    """Each prompt as text, for `text_offset` (token prompts are decoded)."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [model.tokenizer.decode(t, skip_special_tokens=False) for t in tokens]


def _is_text_prompt(prompt: Any) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt)
                                      and all(isinstance(p, str) for p in prompt))


@dataclass
class CompletionAsk:
    """A text completion request with its fields checked: nothing here needs the model."""

    req: CompletionRequest
    activations: dict | None  # return_sae_activations
    spec: sc.ScoringSpec | None  # a scoring request's (None: generation)
    logprobs: lp.LogprobsAsk | None  # a generation's (None: not asked)
    sampling: g.SamplingAsk
    headers: dict[str, str]

    def owners(self, n_prompts: int) -> list[int]:
        """The prompt each choice answers, in choice order."""
        n = self.req.n or 1
        return [i for i in range(n_prompts) for _ in range(n)]


def _check_rows(body: dict) -> None:
    """Prompts x n engine rows, bounded as `n` alone is, before any prompt is tokenized."""
    prompt, n = body.get("prompt"), body.get("n")
    many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    if many and isinstance(n, int) and not isinstance(n, bool) and len(prompt) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompt)} prompts x n {n} is {len(prompt) * n} completions; at most {MAX_CHOICES} "
                       "are accepted per request", code="invalid_parameter", param="n")


async def _ask(request: Request) -> CompletionAsk:
    """Read and check the body: the field contract, scoring mode, the sampling ranges."""
    strict = strict_mode(request.headers)
    body = await read_json_object(request)
    check_count(body, "prompt", MAX_PROMPTS, "prompts")
    _check_rows(body)
    activations = steer.take_activations(body)  # honoured here; profile / steering_intensity are refused
    req = convert(body, CompletionRequest)
    rf.refuse(body, "/v1/completions")
    unused = check_fields(body, CompletionRequest, COMPLETIONS)
    unused += object_locations(body.get("stream_options"), ["include_usage"], "stream_options")
    if req.logprobs is True:
        raise ApiError(400, "logprobs on /v1/completions is the number of alternatives (0-20), not a boolean",
                       code="invalid_parameter", param="logprobs")
    _, spec, mode_unused = sc.resolve(req, body, chat=False)
    shared, shared_unused = g.read_shared(body, scoring=spec is not None)
    unused += mode_unused + shared_unused
    if req.add_special_tokens is not None and not _is_text_prompt(req.prompt):
        unused.append("add_special_tokens")
    headers = settle_unused(unused, strict, COMPLETIONS)
    n_probs = shared.n_probs if shared is not None else None
    logprobs = lp.ask_of(req, chat=False, n_probs=n_probs) if spec is None else None
    return CompletionAsk(req=req, activations=activations, spec=spec, logprobs=logprobs,
                         sampling=g.validate_sampling(req, logprobs, shared), headers=headers)


def _rows(app_state: AppState, model: ServedModel, ask: CompletionAsk,
          prompts: list[list[int]]) -> tuple[list[GenerationRequest], steer.ActivationReader | None]:
    """One engine row per choice, each with its seed and the server's steering; the activation reader."""
    n = ask.req.n or 1
    greqs = [g.build_request(ask.sampling, model, prompts[i], row=k % n, param="prompt")
             for k, i in enumerate(ask.owners(len(prompts)))]
    reader = None
    for greq in greqs:
        if not greq.prompt:
            raise ApiError(400, "the prompt tokenizes to nothing", code="invalid_parameter", param="prompt")
        # the server's steering (live values, active profile or circuit) applies to every completion
        steer_headers, reader = steer.apply(steer.SteeringFields(activations=ask.activations), model.steering,
                                            app_state.steering_store, greq)
        ask.headers.update(steer_headers)
    return greqs, reader


@post("/v1/completions", status_code=200)
async def completions(request: Request, app_state: AppState) -> Any:
    ask = await _ask(request)
    req = ask.req
    model = await model_for(app_state, req.model)  # may switch models (api/model_switch.py)
    ask.headers.update(g.seed_header(req.seed))
    prompts = tokenize_prompts(model, req.prompt, add_special_tokens=req.add_special_tokens is not False)
    if ask.activations is not None and (len(prompts) > 1 or (req.n or 1) > 1):
        raise ApiError(400, "return_sae_activations reads one position axis: it is refused with several prompts "
                       "and with n above 1", code="invalid_parameter", param="return_sae_activations")
    base = {"id": g.new_id("cmpl"), "object": "text_completion", "created": g.now(), "model": model.id}
    if ask.spec is not None:
        return await _score(model, req, ask.spec, prompts, base, ask.headers, ask.activations)
    greqs, reader = _rows(app_state, model, ask, prompts)
    grammar = await g.shared_grammar(ask.sampling, model)  # b10621's grammar / json_schema fields
    if grammar is not None:
        for greq in greqs:
            greq.grammar = grammar
    echo, logprobs = await _openings(model, ask, prompts)
    encoder = CompletionEncoder(base, g.fingerprint(model), reader=reader, echo=echo, logprobs=logprobs,
                                include_usage=bool(req.stream_options and req.stream_options.include_usage),
                                timings=ask.sampling.timings_per_token)
    if req.echo and ask.sampling.max_tokens == 0:
        return _echo_only(ask, encoder, prompts)
    job = Job(model=model, requests=greqs, headers=ask.headers, stream=req.stream)
    return await runner.run(request, job, encoder)


def _echo_only(ask: CompletionAsk, encoder: CompletionEncoder, prompts: list[list[int]]) -> Response | Stream:
    """max_tokens 0 with echo: each choice is its prompt (and its logprobs), nothing generated,
    so no engine row runs; the rows' last events are stated here instead."""
    if ask.activations is not None:
        raise ApiError(400, "return_sae_activations reads a forward, and max_tokens 0 with echo runs none",
                       code="invalid_parameter", param="return_sae_activations")
    finals = [TokenEvent(finish_reason="length", stop_type="limit", prompt_tokens=len(prompts[i]))
              for i in ask.owners(len(prompts))]
    if not ask.req.stream:
        return Response(encoder.body([Run(final=ev) for ev in finals]), headers=ask.headers)

    async def frames() -> AsyncIterator[bytes]:
        for frame in encoder.opening():
            yield frame
        for i, ev in enumerate(finals):
            for frame in encoder.frames(i, ev):
                yield frame
        for frame in encoder.closing(True):
            yield frame
        yield encoder.trailer

    return Stream(frames(), media_type="text/event-stream", headers={**runner.SSE_HEADERS, **ask.headers})


async def _openings(model: ServedModel, ask: CompletionAsk,
                    prompts: list[list[int]]) -> tuple[list[str] | None, lp.TextLogprobs | None]:
    """With echo, each choice's prompt text; with logprobs, each choice's accumulator: the
    echoed prompt's entries first, the generated tokens' offsets from the prompt text's end."""
    req, owners = ask.req, ask.owners(len(prompts))
    texts = _prompt_texts(model, req.prompt, prompts)
    echo = [texts[i] for i in owners] if req.echo else None
    if ask.logprobs is None:
        return echo, None
    per_prompt = []
    for p, text in zip(prompts, texts):
        acc = await lp.echo_logprobs(model, ask.logprobs, p) if req.echo else lp.CompletionLogprobs(offset=0)
        acc.offset = len(text)
        per_prompt.append(acc)
    # the prompt is read once; each of its choices builds on its own copy
    return echo, lp.TextLogprobs(model, ask.logprobs, [copy.deepcopy(per_prompt[i]) for i in owners])


async def _score(model: ServedModel, req: CompletionRequest, spec: sc.ScoringSpec, prompts: list[list[int]],
                 base: dict[str, Any], headers: dict[str, str], activations: dict | None = None) -> Any:
    """One forward per prompt, one choice each; the text is the most probable allowed token.
    Unsteered and unmonitored; the response says so in `X-miLLM-Steering: none`."""
    where = "prompt" if len(prompts) == 1 else "prompt[{}]"
    for i, p in enumerate(prompts):
        sc.check_prompt(model, spec, p, where.format(i))
    texts = _prompt_texts(model, req.prompt, prompts)
    choices = []
    reader = steer.scoring_reader(model.steering, activations, len(prompts[0])) if activations is not None else None
    for i, p in enumerate(prompts):
        scored = await sc.score_prompt(model, p, spec, reader.capture() if reader else None)
        choices.append({"index": i, "text": sc.token_text(model, scored.token),
                        "logprobs": sc.completion_logprobs(model, spec, scored, len(texts[i])),
                        "finish_reason": "length"})
    n_prompt = sum(len(p) for p in prompts)
    out = {
        **base, "system_fingerprint": g.fingerprint(model), "choices": choices,
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(prompts),
                  "total_tokens": n_prompt + len(prompts), "prompt_tokens_details": {"cached_tokens": 0}},
    }
    if reader is not None:
        out["millm"] = {"sae_activations": reader.render()}
    return Response(out, headers={**headers, **steer.UNSTEERED})
