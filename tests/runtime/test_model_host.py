"""The model host (runtime/host.py) over the engine's fake backend, no checkpoint loaded: an
unload drains, then stops the engine, then releases the memory once; a switch refuses requests
as busy while it runs; a failed load brings the previous model back; the idle sleeper runs the
clean-up it was handed."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.model_switch import check_not_busy, load_model
from mlxcel.api.state import AppState
from mlxcel.config.settings import BackendSection, EngineSection, ServerSettings
from mlxcel.engine.engine import Engine
from mlxcel.engine.sampling_params import SamplingParams
from mlxcel.runtime.host import HostBusy, LoadFailed, ModelHost
from mlxcel.runtime.served import ServedModel, Startup
from tests.engine.fake_backend import FakeBackend, FakeTokenizer, reference
from tests.engine.harness import collect, prompt, request

pytestmark = pytest.mark.timeout(60)

PROMPT = prompt(100, 6)


def checkpoint(root: Path, name: str) -> Path:
    """Enough of a checkpoint for the switch's pre-checks (capacity.check_loadable); the fake
    loader never reads it."""
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return path


def settings(**engine) -> ServerSettings:
    return ServerSettings(backend=BackendSection(name="mlx", device="cpu"),
                          engine=EngineSection(model_memory_budget_mib=64, **engine))


class Loader:
    """Stands in for the composition root: a fake-backend engine per load. Loads of a path in
    `failing` raise; with `gate`, a load waits for it (the test looks at the loading phase)."""

    def __init__(self, failing: tuple[Path, ...] = ()) -> None:
        self.failing = set(failing)
        self.calls: list[tuple[str, str | None]] = []
        self.releases: list = []  # the clean-up each load was handed
        self.backends: list[FakeBackend] = []
        self.gate: threading.Event | None = None
        self.started = threading.Event()

    def __call__(self, settings: ServerSettings, path: Path, served_id: str | None, startup: Startup,
                 release) -> ServedModel:
        self.calls.append((Path(path).name, served_id))
        self.releases.append(release)
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if Path(path) in self.failing:
            raise RuntimeError("the weights are corrupt")
        backend = FakeBackend()
        backend.info = replace(backend.info, path=Path(path))  # where a restore loads it back from
        self.backends.append(backend)
        engine = Engine(backend, FakeTokenizer(), n_ctx=512, parallel=2, batch_size=64, cache_budget_bytes=None,
                        sleep_idle_seconds=settings.engine.sleep_idle_seconds, reload=FakeBackend, release_memory=release)
        engine.start()
        return ServedModel(id=served_id or Path(path).name, aliases=[], info=backend.info,
                           tokenizer=engine.tokenizer, engine=engine, defaults=SamplingParams(temperature=0.0),
                           n_ctx=engine.n_ctx_slot, n_predict=-1)

    def release_holds(self) -> None:
        for b in self.backends:
            b.release_all()


class Events:
    """Records drain, shutdown and release in the order they happen."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.model_freed_at_release: list[bool] = []
        self.ref = None

    def watch(self, model: ServedModel) -> None:
        engine = model.engine
        drain, shutdown = engine.drain, engine.shutdown
        engine.drain = lambda timeout: (self.seen.append("drain"), drain(timeout))[1]
        engine.shutdown = lambda *why: (self.seen.append("shutdown"), shutdown(*why))[1]
        self.ref = weakref.ref(model)

    def release(self) -> None:
        self.seen.append("release")
        gc.collect()
        self.model_freed_at_release.append(self.ref is not None and self.ref() is None)


def test_unload_drains_then_shuts_down_and_releases_memory_once(tmp_path, caplog):
    loader, events = Loader(), Events()
    host = ModelHost(settings(graceful_unload_timeout=30), loader=loader, switching=True, release=events.release)
    host.open(checkpoint(tmp_path, "first"))
    events.watch(host.model)
    backend = loader.backends[0]
    hold = backend.hold_when(lambda step: any(r.decode for r in step))

    async def scenario():
        running = asyncio.ensure_future(collect(host.model.engine.submit(request(PROMPT, 8))))
        await hold.wait()
        unload = asyncio.ensure_future(host.unload())
        while not events.seen:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert host.phase == "unloading" and events.seen == ["drain"]  # the running request is waited for
        hold.release()
        await unload
        return await running

    try:
        with caplog.at_level(logging.WARNING, logger="mlxcel.runtime"):
            result = asyncio.run(scenario())
    finally:
        loader.release_holds()
    assert result.tokens == reference(PROMPT, 8)  # it finished on the model being unloaded
    assert events.seen == ["drain", "shutdown", "release"]
    assert events.model_freed_at_release == [True]  # nothing held the model when the memory was released
    assert host.model is None and host.unloaded == "first" and host.phase is None
    assert not caplog.records  # nothing was cut off


def test_an_unload_past_the_graceful_timeout_cuts_the_running_request_off(tmp_path, caplog):
    loader = Loader()
    host = ModelHost(settings(graceful_unload_timeout=0), loader=loader, release=lambda: None)
    host.open(checkpoint(tmp_path, "first"))
    hold = loader.backends[0].hold_when(lambda step: any(r.decode for r in step))
    engine = host.model.engine
    drain = engine.drain
    engine.drain = lambda timeout: (drain(timeout), hold.release())[0]  # the stuck forward ends after the drain

    async def scenario():
        handle = engine.submit(request(PROMPT, 400))
        running = asyncio.ensure_future(_events(handle))
        await hold.wait()
        await host.unload()
        return await running

    try:
        with caplog.at_level(logging.WARNING, logger="mlxcel.runtime"):
            events = asyncio.run(scenario())
    finally:
        loader.release_holds()
    last = events[-1]
    assert last.done and last.error_code == "model_busy" and "unloaded before this request finished" in last.error
    assert any("graceful unload timeout (0s) ran out with 1 requests running" in r.getMessage()
               for r in caplog.records)
    assert host.model is None


async def _run(engine: Engine, tokens: list[int], n: int):
    return await collect(engine.submit(request(tokens, n)))


async def _events(handle) -> list:
    return [ev async for ev in handle]


def test_a_switch_refuses_requests_as_busy_in_both_phases(tmp_path):
    loader = Loader()
    host = ModelHost(settings(graceful_unload_timeout=30), loader=loader, switching=True, release=lambda: None)
    state = AppState(settings=host.settings, host=host)
    first, second = checkpoint(tmp_path, "first"), checkpoint(tmp_path, "second")
    host.open(first)
    hold = loader.backends[0].hold_when(lambda step: any(r.decode for r in step))

    def refusal() -> tuple[str, ApiError]:
        with pytest.raises(HostBusy) as busy:
            host.check_not_busy()
        with pytest.raises(ApiError) as api:
            check_not_busy(state)  # what every /v1 request meets
        return busy.value.message, api.value

    async def scenario():
        running = asyncio.ensure_future(collect(host.model.engine.submit(request(PROMPT, 8))))
        await hold.wait()
        loader.gate = threading.Event()
        loader.started.clear()  # set by the first load
        switch = asyncio.ensure_future(host.switch(second, "second"))
        await asyncio.sleep(0.1)
        unloading = refusal()
        with pytest.raises(HostBusy):
            await host.switch(first, "first")  # no second switch while one runs
        hold.release()
        assert await asyncio.to_thread(loader.started.wait, 10)
        loading = refusal()
        loader.gate.set()
        model = await switch
        await running
        return unloading, loading, model

    try:
        unloading, loading, model = asyncio.run(scenario())
    finally:
        loader.release_holds()
    assert unloading[0] == "the model 'first' is being unloaded to load 'second'; retry once it finishes"
    assert loading[0] == "the model 'second' is being loaded; retry once it finishes"
    for _, api in (unloading, loading):
        assert (api.status, api.code, api.type) == (503, "model_busy", "server_error")
    assert model is host.model and model.id == "second" and host.phase is None
    check_not_busy(state)  # served again
    host.close()


def test_a_failed_load_restores_the_previous_model(tmp_path):
    first, broken = checkpoint(tmp_path, "first"), checkpoint(tmp_path, "broken")
    loader = Loader(failing=(broken,))
    releases = []
    host = ModelHost(settings(), loader=loader, switching=True, release=lambda: releases.append(1))
    host.open(first, "first")
    host.model.aliases = ["the-first"]
    with pytest.raises(LoadFailed) as failed:
        asyncio.run(host.switch(broken, "broken"))
    assert failed.value.message == "loading the model 'broken' failed: the weights are corrupt"
    assert loader.calls == [("first", "first"), ("broken", "broken"), ("first", "first")]
    assert host.model.id == "first" and host.model.aliases == ["the-first"] and host.load_error is None
    assert len(releases) == 2  # after the unload and after the failed load
    assert host.phase is None

    # through the API: the same failure is a 500 model_load_failed, the model is back again
    state = AppState(settings=host.settings, host=host)
    with pytest.raises(ApiError) as api:
        asyncio.run(load_model(state, "broken", broken))
    assert (api.value.status, api.value.code, api.value.param) == (500, "model_load_failed", "model")
    assert api.value.message == "loading the model 'broken' failed: the weights are corrupt"
    assert state.model.id == "first"
    host.close()


def test_a_failed_restore_leaves_no_model_and_says_why(tmp_path):
    first, broken = checkpoint(tmp_path, "first"), checkpoint(tmp_path, "broken")
    loader = Loader()
    host = ModelHost(settings(), loader=loader, release=lambda: None)
    host.open(first, "first")
    loader.failing = {broken, first}  # the previous checkpoint broke meanwhile
    with pytest.raises(LoadFailed):
        asyncio.run(host.load(broken, "broken"))  # a model is held: load switches
    assert host.model is None
    assert host.load_error == "reloading first after a failed switch failed: the weights are corrupt"


def test_a_refused_checkpoint_leaves_the_model_untouched(tmp_path):
    from mlxcel.runtime.capacity import LoadRefused

    loader = Loader()
    host = ModelHost(settings(), loader=loader, release=lambda: None)
    host.open(checkpoint(tmp_path, "first"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadRefused):
        asyncio.run(host.switch(tmp_path / "empty", "empty"))
    assert host.model.id == "first" and host.phase is None and len(loader.calls) == 1
    host.close()


def test_the_host_hands_its_clean_up_to_the_idle_sleeper(tmp_path):
    released = []
    loader = Loader()
    host = ModelHost(settings(sleep_idle_seconds=0), loader=loader, release=lambda: released.append(1))
    model = host.open(checkpoint(tmp_path, "first"))
    assert loader.releases == [host.release]
    engine = model.engine

    def wait_asleep():
        deadline = time.monotonic() + 10
        while not engine.is_sleeping:
            assert time.monotonic() < deadline, "the engine never went to sleep"
            time.sleep(0.01)

    try:
        wait_asleep()
        assert released == [1]  # the sleep ran the host's clean-up, once
        result = asyncio.run(_run(engine, PROMPT, 4))  # wakes it
        assert result.tokens == reference(PROMPT, 4)
        wait_asleep()
        assert released == [1, 1]
    finally:
        host.close()
