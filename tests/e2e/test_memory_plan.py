"""Memory you can plan with, through the real CLI and server: --estimate-memory's figures against
what the running server reports it allocated (both backends), the startup refusal of a
configuration that cannot fit and --fit off, MLXCEL_WIRED_LIMIT off Metal, and the prefix cache's
/v1/cache/stats and /v1/cache/reset behind the API key."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import httpx
import pytest

from mlxcel.engine.kv_block_pool import RESERVED
from tests.conftest import REPO, ServerProcess, default_backends, fixture_path
from tests.fixtures import DEFAULT_MODEL, JSON_TOOLS_TINY, models_dir

KEY = "memory-plan-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GEOMETRY = ["-c", "1024", "-np", "2", "--cache-ram", "8"]
PROMPT = "The knight rode north through the winter forest, looking for the dragon that "


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxcel.cli.server", "-m", DEFAULT_MODEL, "--offline", *args],
                          cwd=REPO, env={**os.environ, "MLXCEL_MODELS_DIR": str(models_dir()), **(env or {})},
                          capture_output=True, text=True, timeout=300)


def estimate_figures(stdout: str) -> dict[str, float]:
    """--estimate-memory's lines as numbers: MiB for sizes, bytes for the per-token figure."""
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in stdout.splitlines() if line.strip())
    first = lambda key: float(rows[key].split()[0].replace(",", ""))  # noqa: E731
    return {"weights": first("weights") * 2**20, "total": first("total") * 2**20,
            "per_token": first("KV per token"), "per_slot": first("KV per slot") * 2**20}


@pytest.fixture(scope="module", params=default_backends())
def served(request):
    fixture_path(DEFAULT_MODEL)
    args = ["--backend", request.param, "--device", "cpu", *GEOMETRY]
    done = cli(*args, "--estimate-memory")
    assert done.returncode == 0, done.stderr
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", *args, "--metrics", "--no-warmup", "--api-key", KEY])
    yield server, estimate_figures(done.stdout)
    server.stop()


def complete(server, **body) -> str:
    r = httpx.post(server.base_url + "/completion", headers=AUTH, timeout=120,
                   json={"prompt": PROMPT, "n_predict": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["content"]


def test_estimate_is_within_ten_percent_of_what_the_server_allocated(served):
    server, est = served
    complete(server)  # the pool's storage grows with its first blocks
    props = httpx.get(server.base_url + "/props", headers=AUTH).json()
    kv, weights = props["kv_cache"], props["backend"]["weight_bytes"]
    assert abs(est["weights"] - weights) <= 0.1 * weights
    assert kv["resident_tokens"] > 0
    per_token = kv["resident_bytes"] / kv["resident_tokens"]  # measured from the backend's own arrays
    assert abs(est["per_token"] - per_token) <= 0.1 * per_token
    pool = per_token * (kv["total_blocks"] + RESERVED) * kv["block_size"]  # the pool once grown to its size
    assert abs((est["total"] - est["weights"]) - pool) <= 0.1 * pool
    assert kv["capacity_bytes"] == pytest.approx(pool, rel=0.1)
    assert (kv["type_k"], kv["type_v"], kv["dtype"]) == ("f16", "f16", props["backend"]["compute_dtype"])
    text = httpx.get(server.base_url + "/metrics", headers=AUTH).text
    assert f"mlxcel_kv_bytes_capacity {kv['capacity_bytes']}" in text
    assert 'mlxcel_kv_cache_mode{type_k="f16",type_v="f16",dtype="' in text


def test_cache_stats_and_reset(served):
    server, _ = served
    assert httpx.get(server.base_url + "/v1/cache/stats").status_code == 401  # the API key gates it
    assert httpx.post(server.base_url + "/v1/cache/reset").status_code == 401
    complete(server, prompt=PROMPT * 3)
    stats = httpx.get(server.base_url + "/v1/cache/stats", headers=AUTH).json()
    cache = stats["prefix_cache"]
    assert cache["enabled"] and cache["cached_blocks"] > 0
    assert cache["cached_bytes"] == cache["cached_blocks"] * cache["block_size"] * stats["kv"]["bytes_per_token"]
    assert cache["budget_bytes"] <= 8 << 20
    refused = httpx.post(server.base_url + "/v1/cache/reset", headers=AUTH, json={"slot": 0})
    assert refused.status_code == 400 and "takes no fields" in refused.json()["error"]["message"]
    assert httpx.post(server.base_url + "/v1/cache/reset", headers=AUTH, content=b"[1]").status_code == 400
    reset = httpx.post(server.base_url + "/v1/cache/reset", headers=AUTH).json()
    assert reset["blocks_freed"] == cache["cached_blocks"] and reset["prefix_cache"]["cached_blocks"] == 0
    assert httpx.get(server.base_url + "/v1/cache/stats", headers=AUTH).json()["prefix_cache"]["cached_blocks"] == 0


def test_reset_while_a_request_runs_leaves_it_whole(served):
    server, _ = served
    prompt = PROMPT * 2
    complete(server, prompt=prompt, n_predict=1)  # its prefix is cached: the next run shares those blocks
    body = {"prompt": prompt, "n_predict": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    pieces, resets = [], []
    with httpx.Client(timeout=120, headers=AUTH) as c, c.stream("POST", server.base_url + "/completion", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                pieces.append(json.loads(line[6:])["content"])
                if len(pieces) == 2:  # mid-generation: the reset runs between the engine's steps
                    t = threading.Thread(target=lambda: resets.append(
                        httpx.post(server.base_url + "/v1/cache/reset", headers=AUTH, timeout=60)))
                    t.start()
    t.join()
    assert resets[0].status_code == 200 and resets[0].json()["blocks_freed"] > 0
    assert "".join(pieces) == complete(server, prompt=prompt, n_predict=24, ignore_eos=True)


def test_a_configuration_that_cannot_fit_is_refused_before_loading():
    fixture_path(DEFAULT_MODEL)
    done = cli("--backend", "mlx", "-c", "100000000", "-np", "4")
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: this configuration needs about") and "more than the" in line
    assert re.search(r"\), [\d,.]+ MiB more than", line)


def test_fit_off_starts_a_configuration_the_check_would_refuse():
    fixture_path(DEFAULT_MODEL)
    args = ["--backend", "mlx", "-c", "4000000", "-np", "1", "--cache-ram", "0"]
    assert cli(*args).returncode == 1
    server = ServerProcess(["-m", DEFAULT_MODEL, "--offline", *args, "--no-warmup", "--fit", "off"])
    try:
        assert httpx.get(server.base_url + "/health").status_code == 200
    finally:
        server.stop()


@pytest.mark.skipif(sys.platform == "darwin", reason="on a Mac with Metal the limit is applied, not refused")
@pytest.mark.parametrize(("value", "says"), [("8G", "runs mlx on cpu"), ("lots", "expected a size")])
def test_wired_limit_is_refused_off_metal(value, says):
    fixture_path(DEFAULT_MODEL)
    done = cli("--backend", "mlx", env={"MLXCEL_WIRED_LIMIT": value})
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: MLXCEL_WIRED_LIMIT") and says in line
    generate = subprocess.run([sys.executable, "-m", "mlxcel.cli.main", "generate", "-m", DEFAULT_MODEL, "--offline",
                               "--backend", "mlx", "-p", "hi"], cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "MLXCEL_MODELS_DIR": str(models_dir()), "MLXCEL_WIRED_LIMIT": value})
    assert generate.returncode == 1 and says in generate.stderr.strip().splitlines()[-1]


def test_memory_options_are_refused_where_no_model_is_loaded_at_startup():
    done = subprocess.run([sys.executable, "-m", "mlxcel.cli.server", "--models-dir", str(models_dir()),
                           "--estimate-memory"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: --estimate-memory applies to the -m generation model")


def test_a_draft_model_counts_in_the_estimate():
    fixture_path(JSON_TOOLS_TINY)
    plain = cli("--backend", "mlx", *GEOMETRY, "--estimate-memory")
    drafted = cli("--backend", "mlx", *GEOMETRY, "-md", JSON_TOOLS_TINY, "--estimate-memory")
    assert plain.returncode == drafted.returncode == 0, drafted.stderr
    line = next(x for x in drafted.stdout.splitlines() if x.startswith("draft model"))
    draft = float(line.split()[2].replace(",", "")) * 2**20
    assert draft > 0 and "draft model" not in plain.stdout
    assert estimate_figures(drafted.stdout)["total"] == pytest.approx(estimate_figures(plain.stdout)["total"] + draft,
                                                                      abs=0.2 * 2**20)
