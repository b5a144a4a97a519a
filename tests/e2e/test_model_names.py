"""--any-model-name: every requested name is served by the loaded model, as llama-server serves
its one model, and the response names the model that answered in X-miLLM-Model-Substituted;
the model's own names (id, --alias list, path) are served without the header. (Without the
flag a foreign name is a 404: tests/e2e/test_openai_basic.py, test_side_workers.py.)"""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.conftest import DEFAULT_MODEL, module_server

server = module_server(DEFAULT_MODEL, "--any-model-name", "--alias", "tiny,small", "-c", "512")
HEADER = "x-millm-model-substituted"


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.mark.parametrize("name", ["gpt-4o", "llama3.2:1b"])
def test_a_foreign_name_is_served_and_said(client, name):
    raw = client.chat.completions.with_raw_response.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.http_response.status_code == 200 and raw.headers[HEADER] == "small"  # sorted aliases: first serves
    assert raw.parse().choices[0].message.content is not None


@pytest.mark.parametrize("name", ["tiny", "small", DEFAULT_MODEL])
def test_own_names_carry_no_header(client, name):
    raw = client.completions.with_raw_response.create(model=name, prompt="The", max_tokens=2)
    assert raw.http_response.status_code == 200 and HEADER not in raw.headers


def test_native_route_and_model_retrieve(server, client):
    r = httpx.post(server.base_url + "/completion", json={"model": "whatever", "prompt": "The", "n_predict": 2},
                   timeout=120)
    assert r.status_code == 200 and r.headers[HEADER] == "small"
    raw = client.models.with_raw_response.retrieve("gpt-4o")
    assert raw.parse().id == "small" and raw.headers[HEADER] == "small"
    assert HEADER not in httpx.get(server.base_url + "/health").headers
