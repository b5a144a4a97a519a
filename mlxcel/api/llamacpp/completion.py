"""POST /completion and /completions: b10621's native completion object.

The prompt may be a string, a mixed array of strings and token ids (one prompt), or an
array of those (several prompts, answered as a JSON array in prompt order). Streaming
sends one frame per generated token (and prompt-progress frames when asked), then the
final object itself; there is no `[DONE]` sentinel on native streams. The server's steering
(live values, active profile or circuit) applies to every row, as on /v1.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, post

from mlxcel.api import media
from mlxcel.api import stream_runner as runner
from mlxcel.api.body import check_count, read_json_object
from mlxcel.api.errors import ApiError, engine_error, native_type
from mlxcel.api.llamacpp import native_grammar, native_media, render
from mlxcel.api.llamacpp.native_params import NativeRequest, parse_native, with_prompt
from mlxcel.api.model_names import name_rule
from mlxcel.api.openai.fields import ignored_fields_header
from mlxcel.api.openai.generation import served_model
from mlxcel.api.state import AppState
from mlxcel.api.stream_runner import Encoder, Job, Run, sse
from mlxcel.config.limits import MAX_PROMPTS
from mlxcel.engine.types import GenerationRequest, TokenEvent
from mlxcel.runtime.served import ServedModel
from mlxcel.steering.requests import server_steering

def _tokenize_one(model: ServedModel, prompt: Any, where: str) -> list[int]:
    tok = model.tokenizer
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_string"), str):
        return tok.encode(prompt["prompt_string"])  # media markers were replaced first (native_media)
    if isinstance(prompt, list) and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in prompt):
        # a mixed prompt: strings tokenized (special tokens added for a leading string only), ids kept
        out: list[int] = []
        for i, p in enumerate(prompt):
            out.extend(tok.encode(p, add_special_tokens=(i == 0)) if isinstance(p, str) else [p])
        return out
    raise ApiError(400, f"{where} must be a string, an array of strings and token ids, or an object "
                   "with prompt_string", code="invalid_parameter", param="prompt")


def tokenize_native_prompts(model: ServedModel, prompt: Any) -> list[list[int]]:
    if prompt is None:
        raise ApiError(400, '"prompt" must be provided', code="invalid_parameter", param="prompt")
    if isinstance(prompt, list) and any(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [_tokenize_one(model, prompt, "prompt")]
    elif isinstance(prompt, list):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", code="invalid_parameter", param="prompt")
        prompts = [_tokenize_one(model, p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        prompts = [_tokenize_one(model, prompt, "prompt")]
    vocab = model.info.vocab_size
    for p in prompts:
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is out of range [0, {vocab})", code="invalid_parameter", param="prompt")
    return prompts


def _native_error(ev: TokenEvent) -> dict[str, Any]:
    """A mid-stream error frame, with the status the error map gives the condition."""
    err = engine_error(ev.error or "", ev.error_code)
    return {"error": {"code": err.status, "message": err.message, "type": native_type(err)}}


def final_object(model: ServedModel, nreq: NativeRequest, greq: GenerationRequest, res: Run,
                 index: int, stream: bool) -> dict[str, Any]:
    ev = res.final
    probs = render.kept_probs(model, res.probs, ev) if not stream else None
    obj = render.final_json(
        model, greq, ev, index=index, content="" if stream else res.content(),
        tokens=res.tokens if (nreq.return_tokens and not stream) else [], stream=stream,
        timings_per_token=nreq.timings_per_token, probs=probs)
    return render.project(obj, nreq.response_fields)


class NativeEncoder(Encoder):
    """b10621's native shapes: one frame per generated token (and prompt-progress frames when
    asked), then the row's final object itself; no `[DONE]`. Not streamed: one final object,
    or an array of them in prompt order."""

    def __init__(self, model: ServedModel, nreq: NativeRequest, greqs: list[GenerationRequest]) -> None:
        self.model, self.nreq, self.greqs = model, nreq, greqs
        self.results = [Run() for _ in greqs]

    def error(self, ev: TokenEvent) -> bytes:
        return sse(_native_error(ev))

    def frames(self, index: int, ev: TokenEvent) -> list[bytes]:
        self.results[index].add(ev)
        idx = index if len(self.greqs) > 1 else 0
        frames = [sse(render.partial_json(self.model, ev, index=idx, timings_per_token=self.nreq.timings_per_token))]
        if ev.done:
            frames.append(sse(final_object(self.model, self.nreq, self.greqs[index], self.results[index], idx,
                                           stream=True)))
        return frames

    def body(self, runs: list[Run]) -> Any:
        objs = [final_object(self.model, self.nreq, g, r, i, stream=False)
                for i, (g, r) in enumerate(zip(self.greqs, runs))]
        return objs[0] if len(objs) == 1 else objs


async def respond(request: Request, app_state: AppState, model: ServedModel, nreq: NativeRequest,
                  greqs: list[GenerationRequest]) -> Any:
    """Run the prompts and answer in the native shape (one object, an array, or a stream)."""
    headers = {**ignored_fields_header(nreq.ignored), **server_steering(app_state, model, greqs)}
    job = Job(model=model, requests=greqs, headers=headers, stream=nreq.stream,
              ping_interval=nreq.sse_ping_interval)
    return await runner.run(request, job, NativeEncoder(model, nreq, greqs))


@post(["/completion", "/completions"], status_code=200)
async def completion(request: Request, app_state: AppState) -> Any:
    body = await read_json_object(request)
    check_count(body, "prompt", MAX_PROMPTS, "prompts")
    model = served_model(app_state, None)
    nreq = parse_native(body, model, app_state.settings.engine.parallel, app_state.settings.server.sse_ping_interval,
                        name_rule(app_state, model))
    nreq.template.grammar = await native_grammar.resolve(body, model)
    nreq.template.keep_tokens = native_grammar.preserved_tokens(body, model)  # written into the text
    nreq.template.grammar = native_grammar.lazy(body, model, nreq.template.grammar, nreq.template.keep_tokens)
    prompt, images = await native_media.gather(model, media.policy(app_state.settings), body.get("prompt"))
    greqs = [with_prompt(nreq.template, p) for p in tokenize_native_prompts(model, prompt)]
    for greq, ims in zip(greqs, images):
        if ims:
            await media.attach(model, greq, ims, "prompt")
    return await respond(request, app_state, model, nreq, greqs)
