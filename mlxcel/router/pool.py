"""The in-process model pool: one engine per loaded model, loaded on demand, LRU past --models-max.

Each model of the registry has a `Slot` with b10621's status vocabulary (unloaded, loading,
loaded, downloading). A loaded slot holds a `Child`: the model's own AppState and Litestar app,
built by the same composition root as a single-model server, through a model host of its own
(`runtime.host.ModelHost`), so a routed request meets exactly the routes and engine a
single-model server would give it, and an unload drains, stops and frees it as a single-model
server's does.

Everything here runs on the event loop; loads, drains and downloads run in worker threads.
Every status change notifies `changed` (requests waiting for a load) and the /models/sse
subscribers. A load that would pass --models-max first unloads the least recently used loaded
model, idle ones before busy ones; an unload lets running requests finish (up to
--graceful-unload-timeout) while new ones wait for the next load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.api.app import build_litestar
from mlxcel.api.side_workers import close_worker_queues
from mlxcel.api.state import AppState
from mlxcel.api.stream_resume import wrap_streams
from mlxcel.api.stream_sessions import StreamStore
from mlxcel.config.limits import echo
from mlxcel.config.refusal import StartupRefusal
from mlxcel.config.settings import ServerSettings
from mlxcel.router.preset import Configure, Preset, effective_args
from mlxcel.router.registry import CACHE, ModelEntry, discover, lookup
from mlxcel.runtime.capacity import LoadRefused
from mlxcel.runtime.host import ModelHost
from mlxcel.runtime.load import select_backend
from mlxcel.runtime.served import Startup
from mlxcel.store.store import DownloadFailed, NotInStore, download, remove

log = logging.getLogger("mlxcel.router")


class RouterError(Exception):
    """A refusal in b10621's native envelope: status, message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Child:
    state: AppState  # this model's own
    app: Any  # its ASGI app (routes + resumable streams)

    @property
    def host(self) -> ModelHost:
        return self.state.host


@dataclass
class Slot:
    entry: ModelEntry
    status: str = "unloaded"  # unloaded | loading | loaded | downloading
    child: Child | None = None
    last_used: float = 0.0
    active: int = 0  # routed requests in flight
    stopping: bool = False  # an unload is draining it: new requests wait
    exit_code: int = 0  # 1 after a failed load (b10621 reports the child's exit code)
    failure: str | None = None
    cancelled: bool = False  # a download asked to stop (its files are dropped when it ends)
    progress: dict = field(default_factory=dict)  # download progress per url

    @property
    def running(self) -> bool:
        return self.status in ("loading", "loaded")


class RouterPool:
    def __init__(self, settings: ServerSettings, store_root: Path | None, preset: Preset | None,
                 configure: Configure, steering_store: Any = None) -> None:
        self.settings, self.store_root, self.preset = settings, store_root, preset
        self.configure = configure  # a model's settings from its preset sections (the CLI's option table)
        self.steering_store = steering_store
        self.slots: dict[str, Slot] = {}
        self.subscribers: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = set()  # /models/sse readers
        self.streams = StreamStore()  # resumable SSE sessions, shared by every model (the router serves their routes)
        self._changed: asyncio.Condition | None = None
        self._room = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()  # loads and downloads in flight (held so none is collected)
        self.rescan()

    # --- inventory --------------------------------------------------------------------------

    def rescan(self) -> None:
        """Re-read the sources; loaded and downloading models stay, vanished idle ones go."""
        found = discover(self.store_root, self.settings.router.models_dir, self.preset, self.settings.source.default_org)
        for name, entry in found.items():
            if name in self.slots:
                self.slots[name].entry = entry
            else:
                self.slots[name] = Slot(entry)
        for name in [n for n, s in self.slots.items() if n not in found and not s.running
                     and s.status != "downloading"]:
            del self.slots[name]

    def find(self, name: str) -> Slot | None:
        entry = lookup({n: s.entry for n, s in self.slots.items()}, name) if name else None
        return self.slots.get(entry.name) if entry is not None else None

    def args(self, slot: Slot) -> list[str]:
        path = slot.entry.path
        return (["--model", str(path)] if path is not None else ["--hf-repo", str(slot.entry.repo_id)]) + \
            effective_args(self.settings, slot.entry.sections)

    # --- events -----------------------------------------------------------------------------

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def close_subscribers(self) -> None:
        """End every /models/sse stream (shutdown: an open stream would hold the server up)."""
        for loop, q in list(self.subscribers):
            loop.call_soon_threadsafe(q.put_nowait, None)  # called from the signal handler

    def publish(self, model: str, event: str, data: dict | None = None) -> None:
        item = {"model": model, "event": event}
        if data is not None:
            item["data"] = data
        for _, q in list(self.subscribers):
            q.put_nowait(item)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _status(self, slot: Slot, status: str, **extra: Any) -> None:
        slot.status = status
        data = {"status": status, **extra}
        self.publish(slot.entry.name, "status_change", data)

    # --- loading ----------------------------------------------------------------------------

    async def ready(self, slot: Slot, autoload: bool) -> Child:
        """The slot's child once loaded: waits for a load or unload in progress; loads it when
        `autoload`, else refuses as b10621 does."""
        started = False
        while True:
            if slot.status == "loaded" and not slot.stopping:
                return slot.child
            if slot.status == "downloading":
                raise RouterError(400, f"model name={slot.entry.name} is not running")
            if slot.status == "unloaded" and not slot.stopping:
                if started:
                    raise RouterError(500, f"model name={slot.entry.name} failed to load"
                                      + (f": {slot.failure}" if slot.failure else ""))
                if not autoload:
                    raise RouterError(400, "model is not loaded")
                await self.load(slot)
                started = True
                continue
            async with self.changed:
                await self.changed.wait_for(lambda: slot.status not in ("loading",) and not slot.stopping)

    async def load(self, slot: Slot) -> None:
        """Start loading `slot` (after making room under --models-max); returns once loading."""
        async with self._room:
            if slot.status != "unloaded" or slot.stopping:
                return
            await self._make_room()
            slot.status, slot.exit_code, slot.failure = "loading", 0, None
            self.publish(slot.entry.name, "model_status", {"status": "loading"})
        self.spawn(self._load(slot))

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _make_room(self) -> None:
        limit = self.settings.router.models_max
        while limit > 0 and sum(s.running for s in self.slots.values()) >= limit:
            loaded = [s for s in self.slots.values() if s.status == "loaded" and not s.stopping]
            if not loaded:
                raise RouterError(503, "model limit reached, try again later")
            victim = min(loaded, key=lambda s: (s.active > 0, s.last_used))
            log.info("--models-max %d reached: unloading the least recently used model %s", limit,
                     victim.entry.name)
            await self.unload(victim)

    async def _load(self, slot: Slot) -> None:
        name = slot.entry.name
        try:
            child = await asyncio.to_thread(build_child, self.settings, self.configure, slot.entry,
                                            self.store_root, self.steering_store, self.streams)
        except Exception as e:  # noqa: BLE001 - the model stays listed, unloaded and failed
            log.error("loading %s failed: %s", name, e)
            slot.exit_code, slot.failure = 1, str(e)
            self._status(slot, "unloaded", exit_code=1)
        else:
            slot.child, slot.last_used = child, time.monotonic()
            log.info("model %s loaded", name)
            self._status(slot, "loaded")
        await self._notify()

    async def unload(self, slot: Slot) -> None:
        """Drain and drop the slot's engine; a download is cancelled instead."""
        if slot.status == "downloading":
            slot.cancelled = True
            async with self.changed:
                await self.changed.wait_for(lambda: slot.status != "downloading")
            return
        if slot.status == "loading":
            async with self.changed:
                await self.changed.wait_for(lambda: slot.status != "loading")
        if slot.status != "loaded" or slot.stopping:
            return
        slot.stopping = True
        try:
            await slot.child.host.unload()  # drain (up to --graceful-unload-timeout), stop, free
            slot.child = None
            log.info("model %s unloaded", slot.entry.name)
            self._status(slot, "unloaded", exit_code=0)
        finally:
            slot.stopping = False
            await self._notify()

    async def load_startup_models(self) -> None:
        for slot in list(self.slots.values()):
            if slot.entry.load_on_startup and slot.status == "unloaded":
                try:
                    await self.load(slot)
                except RouterError as e:
                    log.error("load-on-startup %s: %s", slot.entry.name, e.message)

    def shutdown(self, reason: str | None = None) -> None:
        """Stop every loaded model; at a drain's deadline (`reason` given) their requests and any
        side-worker jobs end with it, as a one-model server's do."""
        for slot in list(self.slots.values()):
            child = slot.child
            if child is None:
                continue
            if reason is not None:
                close_worker_queues(child.state, reason)
            child.host.close(reason)

    # --- the store --------------------------------------------------------------------------

    async def download(self, repo_id: str) -> None:
        from mlxcel.router.download import fetch_with_progress

        slot = Slot(ModelEntry(repo_id, CACHE, None, repo_id=repo_id), status="downloading")
        self.slots[repo_id] = slot
        self.publish(repo_id, "model_status", {"status": "downloading"})
        loop = asyncio.get_running_loop()

        def progress(url: str, done: int, total: int) -> None:
            loop.call_soon_threadsafe(self._progress, slot, url, done, total)

        async def run() -> None:
            ok = True
            try:
                await asyncio.to_thread(download, repo_id, Path(self.store_root), hf_token=self.settings.source.hf_token,
                                        fetch=fetch_with_progress(progress))
            except DownloadFailed as e:
                ok, slot.failure = False, str(e)
                log.error("%s", e)
            if ok and slot.cancelled:
                await asyncio.to_thread(_remove_files, self.store_root, repo_id)
                ok = False
            self.publish(repo_id, "download_finished" if ok else "download_failed", {})
            slot.status = "unloaded"
            del self.slots[repo_id]
            self.rescan()
            self.publish("*", "models_reload")
            await self._notify()

        self.spawn(run())

    def _progress(self, slot: Slot, url: str, done: int, total: int) -> None:
        slot.progress[url] = {"done": done, "total": total}
        self.publish(slot.entry.name, "download_progress", {"progress": dict(slot.progress)})

    async def remove(self, name: str) -> None:
        slot = self.slots.get(name)
        if slot is None:
            raise RouterError(404, f"model name={echo(name)} is not found")
        if slot.entry.source != CACHE:
            raise RouterError(400, f"model name={echo(name)} is not removable (not from cache)")
        await self.unload(slot)
        await asyncio.to_thread(_remove_files, self.store_root, slot.entry.repo_id or name)
        self.slots.pop(name, None)
        self.publish(name, "model_remove")


def _remove_files(root: Path | None, repo_id: str) -> None:
    """Delete the snapshot, containment-checked against the store root (store.remove)."""
    if root is None:
        return
    try:
        remove(repo_id, Path(root))
    except NotInStore as e:
        log.warning("removing %s: %s", repo_id, e)


def build_child(settings: ServerSettings, configure: Configure, entry: ModelEntry, store_root: Path | None,
                steering_store: Any, streams: StreamStore) -> Child:
    """The model's own settings (presets applied), engine, state and app (runs in a worker thread);
    a refusal the CLI would have stopped startup with is this load's failure."""
    try:
        return _build_child(settings, configure, entry, store_root, steering_store, streams)
    except StartupRefusal as e:
        raise RuntimeError(e.message) from None


def _build_child(settings: ServerSettings, configure: Configure, entry: ModelEntry, store_root: Path | None,
                 steering_store: Any, streams: StreamStore) -> Child:
    if entry.path is None:
        raise RuntimeError(f"{entry.repo_id} is not in the model store {store_root}; POST /models downloads it")
    own = configure(settings, entry.sections)
    own.source.model, own.source.alias, own.source.tags = entry.name, list(entry.aliases), list(entry.tags)
    choice = select_backend(own, entry.path)
    host = ModelHost(own, Startup(placement=choice))  # its loads ask for this choice, as the CLI's do
    try:
        host.check(entry.path)
    except LoadRefused as e:
        raise RuntimeError(e.message) from None
    served = host.open(entry.path, entry.name)
    served.aliases, served.tags = list(entry.aliases), list(entry.tags)
    state = AppState(settings=own, host=host, store_root=store_root, steering_store=steering_store,
                     streams=streams)
    return Child(state, wrap_streams(build_litestar(state), state))
