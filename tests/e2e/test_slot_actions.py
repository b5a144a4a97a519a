"""--slot-save-path and POST /slots/:id_slot?action=save|restore|erase, and id_slot pinning on
/completion, through the real CLI and server (two slots, a random-weight Qwen vocabulary)."""

from __future__ import annotations

import threading

import httpx
import pytest

from mlxcel.engine.slot_actions import RESTORE_FAILED
from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import QWEN2_TINY

PROMPT = "hello there, " * 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    fixture_path(QWEN2_TINY)
    root = tmp_path_factory.mktemp("slots")
    server = ServerProcess(["-m", QWEN2_TINY, "--offline", "--parallel", "2", "--no-warmup",
                            "--slot-save-path", str(root)])
    yield server, root
    server.stop()


def action(server, slot, act, body=None) -> httpx.Response:
    return httpx.post(f"{server.base_url}/slots/{slot}", params={"action": act}, json=body or {}, timeout=60)


def complete(server, **body) -> dict:
    r = httpx.post(server.base_url + "/completion", json={"prompt": PROMPT, "n_predict": 4, "temperature": 0,
                                                          **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_save_erase_restore_round_trip(served):
    server, root = served
    done = complete(server, id_slot=1)
    assert done["id_slot"] == 1
    saved = action(server, 1, "save", {"filename": "one.bin"}).json()
    assert set(saved) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert saved["id_slot"] == 1 and saved["filename"] == "one.bin" and set(saved["timings"]) == {"save_ms"}
    assert saved["n_saved"] == done["tokens_cached"]  # the slot's token stream: prompt + generated in KV
    assert saved["n_written"] == (root / "one.bin").stat().st_size
    assert action(server, 1, "erase").json() == {"id_slot": 1, "n_erased": saved["n_saved"]}
    assert action(server, 1, "save", {"filename": "empty.bin"}).json()["n_saved"] == 0
    restored = action(server, 0, "restore", {"filename": "one.bin"}).json()
    assert set(restored) == {"id_slot", "filename", "n_restored", "n_read", "timings"}
    assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], saved["n_written"])
    assert set(restored["timings"]) == {"restore_ms"}
    action(server, 0, "save", {"filename": "zero.bin"})
    assert (root / "zero.bin").read_bytes() == (root / "one.bin").read_bytes()


@pytest.mark.parametrize(("slot", "act", "body", "message"), [
    ("abc", "save", {"filename": "x.bin"}, "Invalid slot ID"),
    ("0", "bogus", {}, "Invalid action"),
    ("5", "erase", {}, "Invalid slot ID"),
    ("0", "save", {"filename": "../x.bin"}, "Invalid filename"),
    ("0", "save", {"filename": "a:b"}, "Invalid filename"),
    ("0", "restore", {"filename": "missing.bin"}, RESTORE_FAILED),
])
def test_refusals(served, slot, act, body, message):
    server, _ = served
    r = action(server, slot, act, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and err["message"].startswith(message)


def test_restore_refuses_a_foreign_file(served):
    server, root = served
    (root / "foreign.bin").write_bytes(b"\x00" * 64)
    r = action(server, 0, "restore", {"filename": "foreign.bin"})
    assert r.status_code == 400 and "not an mlxcel slot file" in r.json()["error"]["message"]


def test_id_slot_pins_and_waits_without_blocking_others(served):
    server, _ = served
    assert httpx.post(server.base_url + "/completion", json={"prompt": "x", "id_slot": 2}).json()["error"][
        "message"] == "Invalid slot ID"
    pinned: dict = {}
    body = {"prompt": PROMPT, "n_predict": 4000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", server.base_url + "/completion", json=body) as r:
        lines = r.iter_lines()  # held: dropping the iterator would close the stream
        next(x for x in lines if x.startswith("data: "))  # the long request holds slot 0
        assert c.get(server.base_url + "/slots").json()[0]["is_processing"] is True
        t = threading.Thread(target=lambda: pinned.update(complete(server, id_slot=0)))
        t.start()
        other = complete(server)  # unpinned: not queued behind the pinned one, takes slot 1
        assert other["id_slot"] == 1 and t.is_alive()
    t.join(timeout=120)  # the stream closed: slot 0 frees and the pinned request runs there
    assert pinned["id_slot"] == 0 and pinned["stop"] is True
