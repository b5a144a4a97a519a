"""POST /infill: fill-in-the-middle with the model's own FIM marker tokens.

The markers are found by their spelling in the vocabulary, from the list llama.cpp's
vocabulary loader scans (Qwen, StarCoder/Granite, DeepSeek-Coder, CodeLlama, GLM); a
model without prefix, suffix and middle markers is refused with upstream's wording.
The prompt is upstream's layout: [repo marker + name] [file marker + name + text per
extra chunk] [BOS] <PRE> prefix prompt <SUF> suffix <MID>, with the suffix block ahead
of the prefix block under --spm-infill. Field text is tokenized with special-token
parsing off, as upstream does, so a marker spelled inside a file stays plain text.
Unlike upstream, prefix and suffix are not cut to a fraction of the batch: the whole
text is served (the context limit still applies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import Request, post

from mlxcel.api.body import read_json_object
from mlxcel.api.errors import ApiError
from mlxcel.api.llamacpp import native_grammar
from mlxcel.api.llamacpp.completion import respond
from mlxcel.api.llamacpp.native_params import parse_native, with_prompt
from mlxcel.api.model_names import name_rule
from mlxcel.api.openai.generation import served_model
from mlxcel.api.state import AppState
from mlxcel.engine.tokenizer import Tokenizer

FIM_SPELLINGS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>", "<file_sep>"),
}
INFILL_FIELDS = ("input_prefix", "input_suffix", "input_extra")
# upstream separates extra chunks this way when the model has no file-separator token
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTokens:
    pre: int | None
    suf: int | None
    mid: int | None
    rep: int | None
    sep: int | None

    def missing(self) -> str:
        return "".join(f"{what} token is missing. " for what, tok in
                       (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if tok is None)


def fim_tokens(tok: Tokenizer) -> FimTokens:
    vocab = tok.hf.get_vocab()
    found = {role: next((vocab[s] for s in spellings if s in vocab), None) for role, spellings in FIM_SPELLINGS.items()}
    return FimTokens(**found)


def _adds_bos(tok: Tokenizer) -> int | None:
    bos = tok.hf.bos_token_id
    if bos is None:
        return None
    ids = tok.encode("a", add_special_tokens=True)
    return bos if ids and ids[0] == bos else None


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f'"{name}" is required' if value is None else f'"{name}" must be a string',
                       code="invalid_parameter", param=name)
    return value


def infill_prompt(tok: Tokenizer, fim: FimTokens, body: dict[str, Any], *, spm: bool,
                  n_ctx: int, n_batch: int, n_predict: int) -> list[int]:
    prefix, suffix = _text(body, "input_prefix"), _text(body, "input_suffix")
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise ApiError(400, '"prompt" must be a string', code="invalid_parameter", param="prompt")
    extra = body.get("input_extra") or []
    if not isinstance(extra, list):
        raise ApiError(400, '"input_extra" must be an array of {"filename": string, "text": string}',
                       code="invalid_parameter", param="input_extra")

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False, parse_special=False)

    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens += [fim.rep] + enc("myproject\n")
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise ApiError(400, 'extra_context chunk must contain a "text" field with a string value',
                           code="invalid_parameter", param="input_extra")
        filename = chunk.get("filename", "tmp")
        if not isinstance(filename, str):
            raise ApiError(400, 'extra_context chunk\'s "filename" field must be a string',
                           code="invalid_parameter", param="input_extra")
        extra_tokens += [fim.sep] + enc(filename + "\n") if fim.sep is not None else enc(CHUNK_SEPARATOR)
        extra_tokens += enc(chunk["text"])
    if fim.sep is not None:
        extra_tokens += [fim.sep] + enc("filename\n")
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))

    head = [fim.pre] + enc(prefix) + enc(prompt)
    tail = [fim.suf] + enc(suffix)
    first, second = (tail, head) if spm else (head, tail)
    bos = _adds_bos(tok)
    out = extra_tokens[len(extra_tokens) - n_extra:] + ([bos] if bos is not None else []) + first + second
    return out + [fim.mid]


@post("/infill", status_code=200)
async def infill(request: Request, app_state: AppState) -> Any:
    body = await read_json_object(request)
    model = served_model(app_state, None)
    fim = fim_tokens(model.tokenizer)
    if fim.missing():
        raise ApiError(501, f"Infill is not supported by this model: {fim.missing()}",
                       code="not_supported", type="not_supported_error")
    nreq = parse_native({k: v for k, v in body.items() if k not in INFILL_FIELDS}, model,
                        app_state.settings.engine.parallel, app_state.settings.server.sse_ping_interval,
                        name_rule(app_state, model))
    nreq.template.grammar = await native_grammar.resolve(body, model)
    nreq.template.keep_tokens = native_grammar.preserved_tokens(body, model)  # written into the text
    nreq.template.grammar = native_grammar.lazy(body, model, nreq.template.grammar, nreq.template.keep_tokens)
    s = app_state.settings
    tokens = infill_prompt(model.tokenizer, fim, body, spm=s.server.spm_infill, n_ctx=model.n_ctx,
                           n_batch=s.engine.batch_size, n_predict=nreq.template.max_tokens)
    return await respond(request, app_state, model, nreq, [with_prompt(nreq.template, tokens)])
