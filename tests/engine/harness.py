"""Driving the engine through its public surface over the fake backend."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mlxcel.engine.engine import Engine
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.engine.types import GenerationRequest, TokenEvent
from tests.engine.fake_backend import FIRST_WORD, VOCAB, FakeBackend, FakeTokenizer

GREEDY = SamplingParams(temperature=0.0)


@contextmanager
def engine_on(backend: FakeBackend | None = None, *, start: bool = True, **kw) -> Iterator[Engine]:
    """An Engine over the fake backend (`engine.backend`); shut down (holds released) on exit.
    With start=False the test submits first and calls engine.start() itself, so the first
    step sees every request at once."""
    backend = backend if backend is not None else FakeBackend()
    # the default byte budget would size a pool of millions of blocks at the fake's tiny KV
    # bytes per token; None bounds the prefix cache by a pool of a few times the slots instead
    kw = {"n_ctx": 512, "parallel": 2, "batch_size": 64, "cache_budget_bytes": None, **kw}
    engine = Engine(backend, FakeTokenizer(), **kw)
    _record_compactions(engine, backend)
    started = start
    if start:
        engine.start()
    try:
        yield engine
    finally:
        backend.release_all()
        try:
            engine.shutdown()
        except RuntimeError:  # the test never started it
            assert not started


def _record_compactions(engine: Engine, backend: FakeBackend) -> None:
    """Every context shift's (tokens before, tokens after), as the KV manager compacts them."""
    compact = engine.kv.compact

    def recorded(seq, keep: int, discard: int):
        before = list(seq.tokens)
        out = compact(seq, keep, discard)
        backend.compactions.append((before, list(out.tokens)))
        return out

    engine.kv.compact = recorded


def prompt(first: int, n: int) -> list[int]:
    """A prompt of n tokens starting with `first` (the fake's step rows name requests by it)."""
    assert FIRST_WORD <= first < VOCAB
    return [first] + [FIRST_WORD + (first * 31 + i * 17) % (VOCAB - FIRST_WORD) for i in range(1, n)]


def request(tokens: list[int], max_tokens: int = 8, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=list(tokens), params=GREEDY, max_tokens=max_tokens, **kw)


@dataclass
class Result:
    tokens: list[int]
    events: list[TokenEvent]

    @property
    def last(self) -> TokenEvent | None:
        return self.events[-1] if self.events else None

    @property
    def slot(self) -> int:
        return self.events[-1].slot


async def collect(handle) -> Result:
    events = [ev async for ev in handle]
    if events and events[-1].done:
        assert events[-1].error is None, events[-1].error
    return Result([ev.token for ev in events if ev.token is not None], events)


async def run(engine: Engine, tokens: list[int], max_tokens: int = 8, **kw) -> Result:
    return await collect(engine.submit(request(tokens, max_tokens, **kw)))


def first_step(backend: FakeBackend, first: int) -> int:
    return min(i for i, _ in backend.rows_of(first))


def last_step(backend: FakeBackend, first: int) -> int:
    return max(i for i, _ in backend.rows_of(first))


def prompt_chunks(backend: FakeBackend, first: int) -> list[int]:
    """The sizes of the prompt chunks forwarded for the request(s) starting with `first`."""
    return [r.n for _, r in backend.rows_of(first) if not r.decode]
