"""SmolLM2 served by a two-rank group on each backend (torch over gloo, MLX over its ring; both on
loopback), against the single-process model of the same backend.

`mlxcel-server --tp-size 2` and `--pp-size 2` each start their second rank themselves. Every
e2e reference prompt must get, greedily and in fp32, exactly the tokens the backend's single-process
model gives (driven in this process on the same token ids); so must eight requests at once,
and a prompt served again from the prefix cache. Last, a rank is killed: while a request runs
(the request gets 503 and the server exits with status 3) and while the server idles (found by
rank 0's heartbeat, same exit). The bounds waited on are the failure contract's, not speed.

MLXCEL_TEST_DEVICE picks the device (default cpu); scripts/bench/dist_check.sh sets cuda, where
each rank takes its own GPU and the tensors go over NCCL. MLXCEL_TEST_MODEL picks the checkpoint
(default: the default model; the check points it at SmolLM2's random twin where the weights
cannot travel).
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL, ServerProcess, fixture_path
from tests.e2e.test_torch_smoke import PROMPTS

DEVICE = os.environ.get("MLXCEL_TEST_DEVICE", "cpu")
MODEL = os.environ.get("MLXCEL_TEST_MODEL", DEFAULT_MODEL)
MAX_TOKENS = 6
TIMEOUT_S = 10  # --dist-timeout: a silent rank fails the group after this
EXIT_BOUND_S = 4 * TIMEOUT_S  # the group's contract: a lost rank ends the server well within this
GROUP_FAILED = 3  # rank 0's exit status for a lost rank (cli/distributed.py)


@pytest.fixture(scope="module", params=["torch", "mlx"] if DEVICE == "cpu" else ["torch"])
def backend(request) -> str:
    pytest.importorskip("torch" if request.param == "torch" else "mlx.core")
    return request.param


def start(backend: str, *extra: str) -> ServerProcess:
    fixture_path(MODEL)
    return ServerProcess(["-m", MODEL, "--offline", "--backend", backend, "--device", DEVICE, "--dtype",
                          "float32", "--threads", "1", "--dist-timeout", str(TIMEOUT_S), "--metrics", *extra],
                         env={"OMP_NUM_THREADS": "1"}, ready_timeout=300)


@pytest.fixture(scope="module")
def tp_server(backend):
    server = start(backend, "--tp-size", "2")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pp_server(backend):
    server = start(backend, "--pp-size", "2")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prompt_ids(tp_server) -> list[list[int]]:
    return [httpx.post(tp_server.base_url + "/tokenize", json={"content": p}).json()["tokens"] for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(backend, prompt_ids) -> list[list[int]]:
    """The backend's single-process greedy tokens for each prompt alone."""
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.engine.tokenizer import Tokenizer

    model = single_process(backend)
    eos = set(Tokenizer(fixture_path(MODEL)).eos_token_ids)
    out = []
    for ids in prompt_ids:
        seq = model.new_sequence()
        tokens = [int(np.argmax(model.forward([ForwardRow(ids, seq)])[0]))]
        while len(tokens) < MAX_TOKENS and tokens[-1] not in eos:  # the server's list ends with the EOS it stopped at
            tokens.append(int(np.argmax(model.forward([ForwardRow(tokens[-1:], seq, decode=True)])[0])))
        seq.release()
        out.append(tokens)
    return out


def single_process(backend: str):
    if backend == "mlx":
        from mlxcel.backends.mlx.backend import MLXBackend

        return MLXBackend(fixture_path(MODEL), dtype="float32", threads=1)
    from mlxcel.backends.torch.backend import TorchBackend

    return TorchBackend(fixture_path(MODEL), dtype="float32", device=DEVICE, threads=1)


def complete(server: ServerProcess, ids: list[int]) -> dict:
    r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                   json={"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def tokens_of(server: ServerProcess, ids: list[int]) -> list[int]:
    r = httpx.post(server.base_url + "/completion", timeout=120,
                   json={"prompt": ids, "n_predict": MAX_TOKENS, "temperature": 0, "return_tokens": True,
                         "cache_prompt": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.parametrize("which", ["tp_server", "pp_server"])
def test_greedy_tokens_match_the_single_process_backend(which, request, prompt_ids, reference):
    server = request.getfixturevalue(which)
    assert [tokens_of(server, ids) for ids in prompt_ids] == reference


def test_concurrent_requests_batch_across_the_group(tp_server, prompt_ids, reference):
    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        got = list(pool.map(lambda ids: tokens_of(tp_server, ids), prompt_ids))
    assert got == reference


def test_prefix_cache_hit_across_the_group(pp_server, prompt_ids, reference):
    ids = prompt_ids[2] * 3  # long enough to fill a whole cached block
    first = complete(pp_server, ids)
    again = complete(pp_server, ids)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_props_and_metrics_report_the_group(tp_server, pp_server):
    tp = httpx.get(tp_server.base_url + "/props").json()["distributed"]
    pp = httpx.get(pp_server.base_url + "/props").json()["distributed"]
    assert (tp["tp_size"], tp["pp_size"], tp["world_size"], tp["failed"]) == (2, 1, 2, None)
    assert (pp["tp_size"], pp["pp_size"], pp["world_size"]) == (1, 2, 2)
    # SmolLM2's 3 KV heads split 2 + 1; its 30 layers 15 + 15
    assert tp["ranks"][0]["kv_bytes_per_token"] == 2 * tp["ranks"][1]["kv_bytes_per_token"]
    assert pp["ranks"][0]["kv_bytes_per_token"] == pp["ranks"][1]["kv_bytes_per_token"]
    assert pp["ranks"][1]["weight_bytes"] < pp["ranks"][0]["weight_bytes"]
    text = httpx.get(tp_server.base_url + "/metrics").text
    assert "mlxcel_group_ranks 2" in text and "mlxcel_group_failed 0" in text
    assert f'mlxcel_group_rank_weight_bytes{{rank="1"}} {tp["ranks"][1]["weight_bytes"]}' in text


def test_no_sae_attaches_to_a_group(tp_server):
    r = httpx.post(tp_server.base_url + "/api/saes/attach", json={"path": "/nowhere/sae"}, timeout=30)
    assert r.status_code == 501, r.text
    assert r.json()["error"]["code"] == "not_supported" and "--tp-size" in r.json()["error"]["message"]
    r = httpx.post(tp_server.base_url + "/api/saes/compatibility", json={"path": "/nowhere/sae"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"]["compatible"] is False, r.text


def follower_pid(server: ServerProcess) -> int:
    children = [int(p) for p in open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read().split()]
    assert len(children) == 1, children
    return children[0]


def test_a_rank_killed_mid_request_gets_503_and_the_server_exits(tp_server, prompt_ids):
    os.kill(follower_pid(tp_server), signal.SIGKILL)
    r = httpx.post(tp_server.base_url + "/v1/completions", timeout=EXIT_BOUND_S,
                   json={"prompt": prompt_ids[0], "max_tokens": 64, "temperature": 0})
    assert r.status_code == 503, r.text
    assert "distributed group" in r.json()["error"]["message"]
    assert tp_server.proc.wait(timeout=EXIT_BOUND_S) == GROUP_FAILED


def test_a_rank_lost_while_idle_ends_the_server(pp_server):
    os.kill(follower_pid(pp_server), signal.SIGKILL)
    assert pp_server.proc.wait(timeout=EXIT_BOUND_S) == GROUP_FAILED
    assert "stopped answering" in pp_server.log()
