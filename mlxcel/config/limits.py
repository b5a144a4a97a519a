"""Bounds on the work one request can ask for, checked before any of it starts (docs/api.md,
"Request limits")."""

from __future__ import annotations

# Choices of one request (`n`). Fixed rather than tied to --parallel so the answer does not
# change with the server's shape; a request whose rows cannot all be slotted or queued is
# refused separately (engine admission).
MAX_CHOICES = 128
# Alternatives reported per token (`n_probs`, natively and on /v1): each is a (token, logprob)
# pair for every generated token, or every prompt token with `echo`; a vocabulary's worth would
# cost memory and engine time for all.
MAX_N_PROBS = 100
# Prompts or conversations of one generation request (`prompt` arrays, `extra_messages`):
# each becomes an engine row, so the same bound as `n`.
MAX_PROMPTS = 128
# Inputs of one embedding or rerank request: OpenAI's own cap on embedding inputs.
MAX_INPUTS = 2048
# Nesting of a request body's JSON: far above any real request, far below the decoder's
# recursion limit (about 1000).
MAX_JSON_DEPTH = 64
# Nesting of a GBNF grammar's groups: the parser recurses once per level.
MAX_GRAMMAR_DEPTH = 64
# Lazy-grammar triggers of one request, and the time all of one row's trigger patterns may take
# per generated token: matching runs on the engine thread, so a pattern that backtracks without
# end would stall every row; past the budget the row ends with an error instead.
MAX_GRAMMAR_TRIGGERS = 64
TRIGGER_MATCH_BUDGET_S = 0.02
# Images of one request (api/media.py), all checked from the image headers before any is decoded.
# Image parts per request: each becomes a vision-tower forward and its tokens in the prompt.
MAX_IMAGES = 16
# Encoded bytes per image (data: payload, file or download).
MAX_IMAGE_BYTES = 20 << 20
# Decoded width * height per image: a solid-colour PNG a few KB on disk can declare tens of
# megapixels, and decoding (RGB, then the processor's float copies) costs memory per pixel.
MAX_IMAGE_PIXELS = 40_000_000
# Decoded pixels summed over a request's images: the per-image cap times the count would still let
# one request hold gigabytes of decoded pictures.
MAX_REQUEST_IMAGE_PIXELS = 64_000_000
# Seconds of audio per transcription or translation request, checked on the length the file's
# headers declare before it is decoded and again on the samples the decoder produces (a header
# that understates it stops at the cap). Whisper runs one request at a time, so this bounds how
# long one clip holds the queue; decoded at 16 kHz it is 38 MB.
MAX_AUDIO_SECONDS = 600

# Seconds a client has to send a complete request header, counted from the connection's
# opening (or the first byte of a later request on a kept-alive connection); after it the
# connection is closed. Bounds half-open and slowly-trickling connections, which uvicorn's
# keep-alive timer does not (any byte cancels it). The idle wait between requests is --timeout.
HEADER_TIMEOUT_S = 30.0
# Seconds a client has to send a request's body once its header is complete, extended by one
# second for every BODY_MIN_RATE bytes received: a 25 MiB upload at 64 kbit/s still arrives,
# a body trickled a few bytes at a time does not hold the connection (cli/http_protocol.py).
# Past it the client gets a 408 and the connection closes.
BODY_TIMEOUT_S = 30.0
BODY_MIN_RATE = 8192  # bytes per second

# Client text quoted in an error message (a model or field name, a value, a pattern, a tool
# name): at most ECHO_CHARS characters of it, the rest elided (`echo`), so an error never
# repeats a large request back. A whole error message is cut at ERROR_MESSAGE_CHARS wherever it
# is rendered, for any quote that did not go through `echo`.
ECHO_CHARS = 200
ERROR_MESSAGE_CHARS = 1000


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """`value` (a string as it is, anything else as its repr) cut to `limit` characters, ending in
    an ellipsis and the count of characters left out when cut."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"
