"""Hypothesis strategies for request bodies, derived from the routes' request structs.

Each declared field gets a value of its declared type most of the time and arbitrary JSON
(wrong types, huge numbers, deep nesting, odd unicode) otherwise; fields whose meaning the
type does not carry (messages, prompt, grammar, ...) get shapes that reach past the first
check. `bounded()` then caps every length field, so a case never generates more than a few
tokens whatever else it asks for.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import msgspec
from hypothesis import strategies as st

from mlxcel.api.anthropic.messages import MessagesRequest
from mlxcel.api.llamacpp.schemas import NativeCompletionRequest
from mlxcel.api.openai.responses import ResponsesRequest
from mlxcel.api.openai.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from tests.hardening import targets

# --- GBNF: text assembled from the grammar's own tokens, so most cases parse past the start ---
_GBNF_TOKENS = st.sampled_from([
    "root", " ::= ", "::=", "a", "b-c", " ", "\n", "|", "(", ")", "*", "+", "?", "{2}", "{1,3}", "{,2}", "{2,}",
    "{99999999999}", '"x"', '"\\x41"', '"\\u00e9"', '"\\"', '"', "[a-z]", "[^\\n]", "[", "]", "[\\]-]", ".", "<tok>",
    "<[12]>", "!<[3]>", "<", "#c\n", "\\", "\\U0001F600", "é", "\x00",
])
gbnf_text = st.lists(_GBNF_TOKENS, max_size=40).map("".join)

# --- JSON Schema: nested schemas from the keywords the server accepts, and some it refuses ---
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                     st.text(max_size=8))
_TYPES = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null", "bogus"])


def _schema_children(children):
    keys = st.sampled_from(["type", "properties", "items", "required", "enum", "const", "anyOf", "oneOf", "allOf",
                            "minLength", "maxLength", "minimum", "maximum", "pattern", "format", "$ref", "$defs",
                            "additionalProperties", "minItems", "maxItems", "not", "if", "prefixItems"])
    values = st.one_of(_TYPES, _scalars, children, st.lists(children, max_size=3),
                       st.dictionaries(st.text(max_size=4), children, max_size=3),
                       st.just("#/$defs/a"), st.just("^(a|b)*$"), st.lists(_TYPES, max_size=3))
    return st.dictionaries(keys, values, max_size=4)


json_schemas = st.recursive(st.fixed_dictionaries({"type": _TYPES}), _schema_children, max_leaves=12)


ODD_TEXT = st.sampled_from(["", "hi", "\x00", "\ud7ff\ue000", "😀" * 3, "<|im_start|>", "</s>", "\u202e", "a" * 300,
                            "{{ raise }}", "{% for %}", "\\u0000", "\r\n\r\n", "<tool_call>"])
text = st.one_of(st.text(max_size=12), ODD_TEXT)
HUGE_INTS = st.sampled_from([-1, 0, 2**31, -2**31 - 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30])
# trigger patterns: catastrophic backtracking, broken syntax, look-arounds, huge repeats
REGEXES = st.sampled_from(["(a|a)*c", "(a+)+$", "[", "(?P<x>a)(?P=x)", "\\", "a{99999999}", "(?<=a)b", "(?=", ".*",
                           "^$", "\\p{L}+", "(?i)TOOL", "[\\s\\S]*?</tool>", "(?:" * 70 + "a" + ")" * 70])
ints = st.one_of(st.integers(-3, 40), HUGE_INTS)
floats = st.one_of(st.floats(-3, 3), st.sampled_from([1e308, -1e308, 5e-324, -0.0, 1e-9, 100.0]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, text)
json_values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=3),
                                                        st.dictionaries(text, c, max_size=3)), max_leaves=10)


def _deep(depth: int) -> Any:
    v: Any = 1
    for i in range(depth):
        v = [v] if i % 2 else {"a": v}
    return v


# arbitrary JSON, weighted towards what breaks decoders: nesting near and past the depth limit
garbage = st.one_of(json_values, st.integers(30, 200).map(_deep), HUGE_INTS, ODD_TEXT)

_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_image", "image"]),
                           "image_url": st.one_of(st.fixed_dictionaries({"url": st.sampled_from(
                               ["data:image/png;base64,AAAA", "http://127.0.0.1:1/x.png", "file:///etc/passwd", ""])}),
                               text)}),
    st.fixed_dictionaries({"type": st.sampled_from(["tool_use", "tool_result", "input_text", "bogus"]),
                           "text": text, "id": text, "content": text}),
    json_values,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bogus"]),
     "content": st.one_of(text, st.lists(_part, max_size=3), st.none())},
    optional={"name": text, "tool_call_id": text, "reasoning_content": text,
              "tool_calls": st.lists(st.fixed_dictionaries({"id": text, "type": st.just("function"), "function":
                                     st.fixed_dictionaries({"name": text, "arguments": st.one_of(text, json_values)})}),
                                     max_size=2)})
messages = st.lists(_message, min_size=0, max_size=4)
_function = st.fixed_dictionaries({"name": text}, optional={"description": text, "parameters": json_schemas})
_tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "custom", "bogus"]), "function": _function},
    optional={"name": text, "input_schema": json_schemas, "parameters": json_schemas})
tools = st.lists(_tool, max_size=2)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "bogus"])},
                          optional={"schema": json_schemas}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": st.sampled_from(["r", "", "x" * 70]), "schema": json_schemas}, optional={"strict": st.booleans()})}))
token_ids = st.lists(st.integers(-5, 160_000), max_size=6)
prompt = st.one_of(text, st.lists(text, max_size=3), token_ids, st.lists(token_ids, max_size=3),
                   st.lists(st.one_of(text, st.integers(-5, 160_000)), max_size=4))

# fields whose meaning their declared type (often Any) does not carry
SEMANTIC: dict[str, st.SearchStrategy] = {
    "messages": messages, "extra_messages": st.lists(messages, max_size=2), "prompt": prompt, "tools": tools,
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]),
                             st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                                 {"name": text})})),
    "response_format": response_format, "grammar": gbnf_text, "json_schema": json_schemas,
    "input": st.one_of(text, st.lists(text, max_size=3), st.lists(_message, max_size=2), token_ids),
    "content": st.one_of(text, st.lists(st.one_of(text, st.integers(-5, 160_000)), max_size=4)),
    "tokens": token_ids, "logit_bias": st.dictionaries(st.one_of(text, st.integers(0, 9).map(str)), floats, max_size=2),
    "stop": st.one_of(text, st.lists(text, max_size=3)), "lora": st.lists(st.fixed_dictionaries(
        {"id": ints, "scale": floats}), max_size=2),
    "grammar_triggers": st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["word", "pattern", "pattern_full", "token", 9, 0, 1, 2, 3]),
         "value": st.one_of(text, REGEXES)}, optional={"token": ints}), max_size=2),
    "preserved_tokens": st.lists(text, max_size=2), "chat_template_kwargs": json_values,
    "samplers": st.one_of(text, st.lists(text, max_size=3)), "query": text,
    "documents": st.lists(text, max_size=3), "texts": st.lists(text, max_size=3),
    "input_prefix": text, "input_suffix": text,
    "input_extra": st.lists(st.fixed_dictionaries({"filename": text, "text": text}), max_size=2),
    "system": st.one_of(text, st.lists(_part, max_size=2)), "thinking": json_values,
}
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")


def _for_type(t: msgspec.inspect.Type) -> st.SearchStrategy:
    mi = msgspec.inspect
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        return ints
    if isinstance(t, mi.FloatType):
        return floats
    if isinstance(t, mi.StrType):
        return text
    if isinstance(t, mi.ListType):
        return st.lists(_for_type(t.item_type), max_size=3)
    if isinstance(t, mi.DictType):
        return st.dictionaries(text, _for_type(t.value_type), max_size=3)
    if isinstance(t, mi.UnionType):
        return st.one_of(*[_for_type(x) for x in t.types])
    if isinstance(t, mi.StructType):
        return _struct_fields(t, {})
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(list(t.values))
    return json_values  # Any


def _struct_fields(info: msgspec.inspect.StructType, extra: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    required, optional = {}, dict(extra)
    for f in info.fields:
        typed = SEMANTIC[f.encode_name] if f.encode_name in SEMANTIC else _for_type(f.type)
        value = st.one_of(typed, typed, typed, garbage)  # mostly the declared shape
        (required if f.required else optional)[f.encode_name] = value
    # a few optional fields per body: with dozens at once, one refused field hides the rest
    names = sorted(optional)
    return st.lists(st.sampled_from(names), max_size=6, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({**required, **{n: optional[n] for n in chosen}}))


def struct_bodies(cls: type, **extra: st.SearchStrategy) -> st.SearchStrategy:
    """Objects with `cls`'s fields (required ones always, optional ones sometimes) plus `extra`."""
    return _struct_fields(msgspec.inspect.type_info(cls), extra)


def bounded(body: Any) -> Any:
    """Cap generation: a length field holding a plausible count becomes 0..8 tokens (huge,
    negative-below--1 and non-integer values stay: the decoder must refuse them)."""
    if isinstance(body, dict):
        for k in LENGTH_FIELDS:
            v = body.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and -1 <= v < 2**31:
                body[k] = v % 9
        if body.get("ignore_eos") is True:
            body["n_predict"] = 4
    return body


def raw_bodies(objects: st.SearchStrategy) -> st.SearchStrategy:
    """Request bytes: mostly the objects as JSON, sometimes a non-object, broken or deep text."""
    as_json = objects.map(lambda b: json.dumps(bounded(b)).encode())
    broken = st.one_of(
        garbage.map(lambda v: json.dumps(v).encode()),
        st.integers(60, 5000).map(lambda d: b"[" * d + b"]" * d),
        st.binary(max_size=64),
        st.sampled_from([b"", b"{", b'{"a": NaN}', b'{"messages": [}', b"\xff\xfe{}", b'{"a":1,"a":2}']),
    )
    # seven in ten cases are objects of the route's fields: those reach the handlers
    return st.integers(0, 9).flatmap(lambda k: as_json if k < 7 else broken)


ROUTES: dict[str, st.SearchStrategy] = {
    "/v1/chat/completions": struct_bodies(ChatCompletionRequest),
    "/v1/completions": struct_bodies(CompletionRequest),
    "/v1/responses": struct_bodies(ResponsesRequest),
    "/v1/messages": struct_bodies(MessagesRequest),
    "/v1/messages/count_tokens": struct_bodies(MessagesRequest),
    "/completion": struct_bodies(NativeCompletionRequest),
    "/infill": struct_bodies(NativeCompletionRequest, input_prefix=text, input_suffix=text,
                             input_extra=SEMANTIC["input_extra"]),
    "/tokenize": st.fixed_dictionaries({}, optional={"content": SEMANTIC["content"], "add_special": scalars,
                                                     "with_pieces": scalars, "parse_special": scalars}),
    "/detokenize": st.fixed_dictionaries({}, optional={"tokens": st.one_of(token_ids, garbage)}),
    "/v1/embeddings": struct_bodies(EmbeddingRequest),
    "/rerank": st.fixed_dictionaries({}, optional={"query": st.one_of(text, garbage),
                                                   "documents": SEMANTIC["documents"],
                                                   "texts": SEMANTIC["texts"], "top_n": ints,
                                                   "return_documents": scalars}),
    "/apply-template": st.fixed_dictionaries({"messages": messages}),
    "/v1/chat/completions/input_tokens": struct_bodies(ChatCompletionRequest),
    "/v1/responses/input_tokens": struct_bodies(ResponsesRequest),
    "/embedding": st.fixed_dictionaries({}, optional={"content": SEMANTIC["content"], "embd_normalize": ints}),
    "/props": st.fixed_dictionaries({}, optional={"default_generation_settings": json_values}),
    "/lora-adapters": st.lists(st.fixed_dictionaries({"id": ints, "scale": floats}), max_size=2),
    "/v1/streams/lookup": st.fixed_dictionaries({}, optional={"conversation_ids": st.lists(text, max_size=3)}),
    "/v1/chat/completions/control": st.fixed_dictionaries({}, optional={"id": text, "action": text}),
    "/slots/0?action=erase": st.fixed_dictionaries({}, optional={"filename": text}),
}
# headers a generation route reads besides the body (stream resumption, strict field checks)
HEADERS = st.fixed_dictionaries({}, optional={"X-Conversation-Id": st.sampled_from(["c1", "", "a" * 300, "é", "c 1"]),
                                              "X-miLLM-Strict": st.sampled_from(["1", "0", "true", "bogus", ""])})


# --- multipart: delimiter lines, headers and bodies in any order, some fields well formed ---
def _part(name: str, body: bytes, filename: bool) -> bytes:
    disp = f'form-data; name="{name}"' + ('; filename="a.wav"' if filename else "")
    return b"--" + targets.BOUNDARY + b"\r\nContent-Disposition: " + disp.encode() + b"\r\n\r\n" + body + b"\r\n"


_mp_pieces = st.one_of(
    st.builds(_part, st.sampled_from(["file", "model", "prompt", "x", ""]), st.binary(max_size=40), st.booleans()),
    st.sampled_from([b"--" + targets.BOUNDARY + b"--\r\n", b"--" + targets.BOUNDARY + b"\r\n", b"\r\n", b"\r\n\r\n",
                     b"Content-Type: audio/wav\r\n", b":", b"\xff\xfe", b"--" + targets.BOUNDARY + b"  \r\n"]),
    st.binary(max_size=30),
)
multipart_bodies = st.lists(_mp_pieces, max_size=10).map(b"".join)


# --- audio: container headers with fuzzed fields, then arbitrary sample bytes ---
def _wav(tag, channels, rate, bits, align, size, tail) -> bytes:
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits)
    return (b"RIFF" + struct.pack("<I", 36 + len(tail)) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", size) + tail)


def _flac(min_block, max_block, rate, channels, bits, total, tail) -> bytes:
    info = struct.pack(">HH", min_block, max_block) + b"\x00" * 6
    packed = (rate << 44) | ((channels - 1) << 41) | ((bits - 1) << 36) | total
    return b"fLaC" + b"\x80\x00\x00\x22" + info + packed.to_bytes(8, "big") + b"\x00" * 16 + tail


_u16, _u32 = st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF)
audio_files = st.one_of(
    st.builds(_wav, st.sampled_from([1, 3, 6, 7, 0xFFFE, 2]), st.integers(0, 9), st.integers(0, 200_000),
              st.sampled_from([0, 8, 16, 24, 32, 64, 12]), st.integers(0, 16), _u32, st.binary(max_size=200)),
    st.builds(_flac, _u16, _u16, st.integers(0, (1 << 20) - 1), st.integers(1, 8), st.integers(1, 32),
              st.integers(0, (1 << 36) - 1), st.binary(max_size=60)),
    st.builds(lambda head, tail: b"ID3" + head + tail, st.binary(min_size=7, max_size=7), st.binary(max_size=60)),
    st.builds(lambda h, tail: h + tail, st.sampled_from([b"\xff\xfb\x90\x64", b"\xff\xf3\x48\xc4", b"\xff\xe2"]),
              st.binary(max_size=400)),
)


# --- multipart forms for the audio routes over HTTP: the fields the routes read (odd values among
# them), a file part holding a fuzzed audio file, parts in any order, sometimes broken pieces
# spliced in or the closing delimiter missing; `max_tokens` is mostly small so a clip that does
# decode costs one short Whisper window ---
def _field(name: str, value: bytes, extra: bytes = b"") -> bytes:
    return (b"--" + targets.BOUNDARY + b'\r\nContent-Disposition: form-data; name="' + name.encode() + b'"'
            + extra + b"\r\n\r\n" + value + b"\r\n")


_FORM_FIELDS = {
    "model": text, "prompt": text,
    "language": st.sampled_from(["en", "EN", "english", "fr", "", "xx", "a" * 300]),
    "temperature": st.sampled_from(["0", "0.5", "1", "-1", "nan", "inf", "1e400", "x", ""]),
    "response_format": st.sampled_from(["json", "text", "srt", "verbose_json", "vtt", "bogus", ""]),
    "stream": st.sampled_from(["true", "false", "1", ""]),
    "timestamp_granularities[]": st.sampled_from(["word", "segment", "x"]),
}
# a clip the decoder accepts (a quarter second of a 440 Hz tone, 16 kHz PCM16), so some cases reach Whisper
_TONE = struct.pack("<4000h", *(int(8000 * ((i * 440 * 2 // 16000) % 2 * 2 - 1)) for i in range(4000)))
VALID_WAV = _wav(1, 1, 16000, 16, 2, len(_TONE), _TONE)
_file_part = st.builds(
    lambda name, ctype, data: _field("file", data, b'; filename="' + name.encode("utf-8", "replace") + b'"' + ctype),
    st.sampled_from(["a.wav", "a.mp3", "a.flac", "", "../../etc/passwd", "é" * 3, "a" * 300]),
    st.sampled_from([b"", b"\r\nContent-Type: audio/wav", b"\r\nContent-Type: application/octet-stream",
                     b"\r\nContent-Type: ", b"\r\nX: " + b"y" * 200]),
    # one file in 25 decodes: each of those runs a Whisper window (seconds), the rest stop in the parsers
    st.integers(0, 24).flatmap(lambda k: st.just(VALID_WAV) if k == 0 else st.one_of(audio_files,
                                                                                      st.binary(max_size=200))),
)
_form_parts = st.lists(st.one_of(
    *[st.builds(_field, st.just(name), values.map(lambda v: v.encode("utf-8", "replace")))
      for name, values in _FORM_FIELDS.items()],
    _file_part, _mp_pieces), max_size=4)
audio_forms = st.builds(
    lambda file, parts, tokens, close: b"".join([file, *parts, _field("max_tokens", tokens),
                                                 b"--" + targets.BOUNDARY + b"--\r\n" if close else b""]),
    _file_part, _form_parts, st.sampled_from([b"1", b"1", b"2", b"0", b"-1", b"99999999999999999999", b"x"]),
    st.sampled_from([True, True, True, True, False]))
FORM_CONTENT_TYPES = st.sampled_from(
    ["multipart/form-data; boundary=" + targets.BOUNDARY.decode()] * 12
    + ['multipart/form-data; boundary="' + targets.BOUNDARY.decode() + '"', "multipart/form-data",
       "multipart/form-data; boundary=", "multipart/form-data; boundary=" + "b" * 100, "application/json",
       "text/plain", "multipart/mixed; boundary=" + targets.BOUNDARY.decode()])
