"""The model host: one served model's lifecycle, for the single-model server (api/model_switch.py)
and for each model of the router's pool (router/pool.py).

- `open`: the first load, blocking (the -m model on the CLI's load thread, a router model on its
  worker thread); a failure propagates as raised.
- `load`: the named checkpoint, as a switch when a model is held, else on its own ("loading").
- `unload`: the requests already running finish first, for up to --graceful-unload-timeout;
  whatever is left then ends with the engine's error event; the engine stops, the model is
  dropped and the memory released ("unloading").
- `switch`: unload, then load; when the load fails the previous model is loaded back, so the
  server keeps serving.

While a phase runs, `check_not_busy` raises `HostBusy` (the API's 503 `model_busy`): no second
switch starts and no request runs on a half-moved model. A load that fails raises `LoadFailed`
(500 `model_load_failed`); a checkpoint refused before the held model is touched raises
`capacity.LoadRefused`. Every unload and failed load ends in the one memory clean-up
(runtime/memory.py), which the host also hands each engine it loads for --sleep-idle-seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from mlxcel.config.settings import ServerSettings
from mlxcel.runtime.capacity import check_loadable
from mlxcel.runtime.load import load_served_model
from mlxcel.runtime.memory import release_memory
from mlxcel.runtime.served import ServedModel, Startup

log = logging.getLogger("mlxcel.runtime")

UNLOADING, LOADING = "unloading", "loading"

# (settings, checkpoint, served id (None: the -m model), startup, the clean-up for idle sleep)
Loader = Callable[[ServerSettings, Path, "str | None", Startup, Callable[[], None]], ServedModel]


class HostBusy(Exception):
    """The host is unloading or loading a model: retry once it finishes."""

    def __init__(self, phase: str, target: str | None, previous: str | None) -> None:
        if phase == UNLOADING:
            what = f"the model {previous!r} is being unloaded" + (f" to load {target!r}" if target else "")
        else:
            what = f"the model {target!r} is being loaded"
        self.message = f"{what}; retry once it finishes"
        super().__init__(self.message)


class LoadFailed(Exception):
    """Loading `name` failed; the host holds the previous model again, or none."""

    def __init__(self, name: str, error: Exception) -> None:
        self.name = name
        self.message = f"loading the model '{name}' failed: {error}"
        super().__init__(self.message)


class ModelHost:
    """Holds at most one served model (`model`) and runs its load, unload and switch.

    `switching`: requests may switch this host's model (a single-model server started with a
    generation model); the API consults the phases only then. `loader` and `release` default to
    the composition root and the memory clean-up; tests pass stand-ins."""

    def __init__(self, settings: ServerSettings, startup: Startup | None = None, *,
                 model: ServedModel | None = None, switching: bool = False,
                 loader: Loader = load_served_model, release: Callable[[], None] = release_memory) -> None:
        self.settings = settings
        self.startup = startup or Startup()  # what the CLI settled for the -m model
        self.model = model
        self.load_error: str | None = None  # why no model is held, when a load failed
        self.switching = switching
        self.phase: str | None = None  # None | UNLOADING | LOADING
        self.target: str | None = None  # the model being loaded
        self.previous: str | None = None  # the model being unloaded
        self.unloaded: str | None = None  # the model `unload` let go (none loaded since)
        self.loader = loader
        self.release = release

    # --- phases -----------------------------------------------------------------------------

    def check_not_busy(self) -> None:
        if self.phase is not None:
            raise HostBusy(self.phase, self.target, self.previous)

    def check(self, path: Path) -> int:
        """What a load of `path` is refused for while the held model still serves (quick file
        reads; raises capacity.LoadRefused); the weights' estimated size."""
        return check_loadable(self.settings, path, self.model, self.startup.placement)

    def _enter(self, phase: str, target: str | None, previous: str | None) -> None:
        self.check_not_busy()
        self.phase, self.target, self.previous = phase, target, previous

    def _leave(self) -> None:
        self.phase = self.target = self.previous = None

    # --- blocking: startup and process exit -------------------------------------------------

    def open(self, path: Path, served_id: str | None = None) -> ServedModel:
        """The first load, blocking, with no phase (nothing is served yet). `served_id` None:
        the -m model, with the CLI's adapters and draft."""
        model = self.loader(self.settings, path, served_id, self.startup, self.release)
        self.model = model
        return model

    def close(self, reason: str | None = None) -> None:
        """Process exit: stop the engine without draining (the server is going away); requests
        still running end with an error naming `reason`."""
        if self.model is not None:
            self.model.engine.shutdown(reason)
            if self.model.group is not None:  # the other ranks exit with it
                self.model.group.close(reason or "rank 0 is shutting down")

    # --- on the event loop: load, unload, switch --------------------------------------------

    async def load(self, path: Path, name: str) -> ServedModel:
        """Load `path` to answer as `name`: a switch when a model is held, else phase 2 alone."""
        if self.model is not None:
            return await self.switch(path, name)
        self.check(path)
        self._enter(LOADING, name, None)
        try:
            model = await self._load(path, name)
            self.model, self.load_error, self.unloaded = model, None, None
            log.info("model %s loaded", name)
            return model
        finally:
            self._leave()

    async def unload(self) -> None:
        """Phase 1 alone: no model is held afterwards."""
        if self.model is None:
            return
        self._enter(UNLOADING, None, self.model.id)
        try:
            log.info("unloading %s", self.previous)
            self.unloaded = await self._drop()
        finally:
            self._leave()

    async def switch(self, path: Path, name: str) -> ServedModel:
        """Unload the held model, load `path` as `name`; when that fails, load the previous one
        back and raise LoadFailed."""
        self.check(path)  # the held model still serves while its refusals are decided
        self._enter(UNLOADING, name, self.model.id)
        try:
            log.info("switching models: unloading %s to load %s", self.previous, name)
            previous = self.model.info.path, self.model.id, list(self.model.aliases)
            await self._drop()
            self.phase = LOADING
            try:
                model = await self._load(path, name)
            except LoadFailed:
                await asyncio.to_thread(self._restore, *previous)
                raise
            self.model = model
            log.info("model %s loaded (switch)", name)
            return model
        finally:
            self._leave()

    async def _drop(self) -> str:
        """Drain, stop the engine, let the model go and release the memory; the id it had.
        Callers hold no reference to the model, so the clean-up can free its weights."""
        engine, served_id = self.model.engine, self.model.id
        timeout = self.settings.engine.graceful_unload_timeout
        if not await asyncio.to_thread(engine.drain, timeout):
            log.warning("unloading %s: the graceful unload timeout (%ss) ran out with %d requests running; "
                        "they end with an error", served_id, timeout, engine.outstanding)
        await asyncio.to_thread(engine.shutdown)
        self.model = None
        del engine
        self.release()
        return served_id

    async def _load(self, path: Path, name: str) -> ServedModel:
        try:
            return await asyncio.to_thread(self.loader, self.settings, path, name, self.startup, self.release)
        except Exception as e:  # noqa: BLE001 - any load failure is the caller's LoadFailed
            log.exception("loading %s failed", name)
            failed = LoadFailed(name, e)
        self.release()  # outside the except block: the traceback (a half-built model) is gone by now
        raise failed

    def _restore(self, path: Path, served_id: str, aliases: list[str]) -> None:
        """Load the previous model back after a failed switch (blocking; in a worker thread)."""
        try:
            model = self.loader(self.settings, path, served_id, self.startup, self.release)
        except Exception as e:  # noqa: BLE001 - the server stays up and says why
            self.load_error = f"reloading {served_id} after a failed switch failed: {e}"
            log.exception("reloading %s failed", served_id)
            return
        model.aliases = list(aliases)
        self.model = model
