"""GET /models and /v1/models in b10621's shape on a quantized checkpoint, with --tags and
--alias: the data entry's aliases, tags and meta block, the Ollama-style models block, and the
openai SDK still parsing the list and a retrieve by alias (one server, MLX 4-bit SmolLM2)."""

from __future__ import annotations

import json
import struct

import httpx
import pytest
from openai import OpenAI

from tests.conftest import module_server
from tests.fixtures import SMOLLM2_4BIT, fixture_path

server = module_server(SMOLLM2_4BIT, "--backend", "mlx", "--alias", "zebra,apple", "--tags", "prod, q4,,prod")
SMOLLM2_135M_PARAMS = 134515008  # the full-precision checkpoint's element count (model card: 135M)


def payload_bytes(path) -> int:
    """The tensor bytes of every safetensors file: file size less its 8-byte length and header."""
    total = 0
    for f in path.glob("*.safetensors"):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        total += f.stat().st_size - 8 - n
    return total


@pytest.fixture(scope="module")
def listing(server):
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()


def test_data_entry_carries_tags_aliases_and_checkpoint_meta(server, listing):
    entry = listing["data"][0]
    assert entry["id"] == "apple"  # b10621 serves the first of the sorted alias set
    assert entry["aliases"] == ["apple", "zebra"] and entry["tags"] == ["prod", "q4"]
    assert entry["object"] == "model" and entry["owned_by"] == "llamacpp"
    meta = entry["meta"]
    # 4-bit weights unpacked by their declared width count as many parameters as the fp checkpoint
    assert meta["n_params"] == SMOLLM2_135M_PARAMS
    assert meta["size"] == payload_bytes(fixture_path(SMOLLM2_4BIT)) < 2 * SMOLLM2_135M_PARAMS / 3
    config = json.loads((fixture_path(SMOLLM2_4BIT) / "config.json").read_text())
    assert (meta["n_vocab"], meta["n_embd"], meta["n_ctx_train"]) == \
        (config["vocab_size"], config["hidden_size"], config["max_position_embeddings"])
    assert meta["vocab_type"] == 2  # GPT-2 style BPE without byte fallback
    props = httpx.get(server.base_url + "/props", timeout=30).json()
    assert meta["n_ctx"] == props["default_generation_settings"]["n_ctx"]
    assert meta["ftype"] == props["model_ftype"] == "MLX 4bit-g64"


def test_ollama_models_block_and_native_route(server, listing):
    (ollama,) = [m for m in listing["models"] if m["name"] == "apple"]
    assert ollama["model"] == "apple" and ollama["type"] == "model" and ollama["capabilities"] == ["completion"]
    assert ollama["details"]["format"] == "safetensors"
    assert [m["name"] for m in listing["models"]] == [e["id"] for e in listing["data"]]
    native = httpx.get(server.base_url + "/models", timeout=30).json()
    assert [e["id"] for e in native["data"]] == ["apple"] and native["object"] == "list"
    assert native["data"][0]["meta"] == listing["data"][0]["meta"]
    assert native["models"][0]["name"] == "apple"


def test_openai_sdk_parses_list_and_retrieve_by_alias(server):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    first = client.models.list().data[0]
    assert first.id == "apple" and first.owned_by == "llamacpp"
    assert first.model_extra["tags"] == ["prod", "q4"]
    got = client.models.retrieve("zebra")
    assert got.id == "apple" and got.model_extra["meta"]["n_params"] == SMOLLM2_135M_PARAMS
