"""Every zoo family on every backend it is served on, through the paged engine.

One tiny random-weight checkpoint per family (scripts/fixtures/build_zoo.py: 2 layers, hidden
64, SmolLM2's tokenizer, float32). Per family and backend:
1. logits through mlxcel's paged KV against the reference (transformers' forward with its own
   cache, both fp32 from the same safetensors; for a family transformers has no class for,
   mlx-lm's module with mlx-lm's cache) over a prompt longer than the fixtures' sliding
   windows and 8 greedy decode steps: max |difference| <= 1e-3 and the same greedy tokens,
   and the KV pool holding what the backend's kv_spec says it does per token;
2. a row's greedy tokens in a batch of 4 with different prompt lengths equal its solo run;
3. a prefix-cache hit gives the cold run's tokens (a family with recurrent layers runs with the
   prefix cache off: the second run is as cold as the first, and the engine says why);
4. one /v1/chat/completions round trip over HTTP, every family through one router-mode server
   per backend (`--models-dir` over the zoo's folder), so each is loaded as a served model is.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from mlxcel.cli.flags import BUILD_ENV
from mlxcel.config.settings import BackendSection, EngineSection, ServerSettings, SourceSection
from mlxcel.engine.backend import layer_windows
from mlxcel.models.registry import FAMILIES
from tests import fixtures
from tests.conftest import ServerProcess, fixture_path, models_dir
from tests.models.test_engine import run

TOLERANCE = 1e-3
DECODE_STEPS = 8
PROMPT = ("The history of the city of Paris begins with a small settlement on an island in the river, "
          "where fishermen and traders built their huts")
CASES = [(t, b) for t in fixtures.ZOO_TYPES for b in FAMILIES[t].backends]


def test_every_zoo_type_is_a_registered_family():
    assert set(fixtures.ZOO_TYPES) <= set(FAMILIES)


def _backend(family: str, backend: str):
    path = fixture_path(fixtures.zoo_fixture(family))
    return _mlx(path) if backend == "mlx" else _torch(path)


def _mlx(path):
    from mlxcel.backends.mlx.backend import MLXBackend

    return MLXBackend(path, dtype="float32")


def _torch(path):
    from mlxcel.backends.torch.backend import TorchBackend

    return TorchBackend(path, dtype="float32")


@pytest.mark.parametrize("family,backend", CASES)
def test_logits_match_reference(family, backend):
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.engine.kv_block_pool import BlockAllocator
    from mlxcel.engine.tokenizer import Tokenizer
    from tests.models.reference import reference_stepper

    path = fixture_path(fixtures.zoo_fixture(family))
    ids = Tokenizer(path).encode(PROMPT)
    mine = _backend(family, backend)
    assert mine.info.model_type == family
    mine.bind_kv(BlockAllocator(num_blocks=64, block_size=16))
    ref = reference_stepper(path, FAMILIES[family].hf_architecture)
    seq = mine.new_sequence()
    got = mine.forward_all(ids, seq)
    # the KV manager sizes the pool from kv_spec: it must be what the storage holds per slot
    # (MLA's latent for DeepSeek, per-head keys and values elsewhere; nothing per token for a
    # model of recurrent layers only, Mamba 2's, whose state is per sequence)
    stored = [k for k in mine.storage.keys if k is not None]
    slots = stored[0].shape[0] if stored else 0
    assert mine.storage.nbytes == slots * mine.kv_spec.bytes_per_token
    want = ref(ids)
    worst = float(np.abs(got - want).max())
    assert worst <= TOLERANCE, f"prefill of {len(ids)} tokens: max abs diff {worst}"
    token = int(want[-1].argmax())
    assert int(got[-1].argmax()) == token
    for step in range(DECODE_STEPS):
        row = mine.forward([ForwardRow([token], seq)])[0]
        ref_row = ref([token])[-1]
        diff = float(np.abs(row - ref_row).max())
        assert diff <= TOLERANCE, f"decode step {step}: max abs diff {diff}"
        token = int(ref_row.argmax())
        assert int(row.argmax()) == token, f"greedy tokens diverge at step {step}"


# the zoo families whose every attention layer slides (window 24): their sequences free the
# blocks behind the window, so these runs read through freed (null) table entries
ALL_SLIDING = ("mistral", "phimoe")
# sliding layers beside full-attention ones: their own block group frees behind the window
INTERLEAVED = ("gemma2", "gemma3", "cohere2", "gpt_oss", "exaone4", "olmo3")
# Gemma 3's text checkpoint (real weights, 18 layers, 5 local of every 6) with its window of 512
# cut to this, so the test's prompt reaches past it
GEMMA3_TEXT_WINDOW = 32


def _gemma3_text_small_window(tmp_path):
    """gemma-3-270m with a window of GEMMA3_TEXT_WINDOW: its files linked, its config rewritten."""
    import json

    src = fixture_path(fixtures.GEMMA3)
    for f in src.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": GEMMA3_TEXT_WINDOW}))
    return tmp_path


@pytest.mark.parametrize("family,backend", [(t, b) for t in ALL_SLIDING + INTERLEAVED + ("gemma3_text",)
                                            for b in FAMILIES[t].backends])
def test_blocks_freed_behind_the_window_leave_the_logits_unchanged(family, backend, tmp_path):
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.engine.kv_block_pool import NULL_BLOCK
    from mlxcel.engine.kv_manager import KVManager
    from mlxcel.engine.tokenizer import Tokenizer
    from tests.models.reference import reference_stepper

    if family == "gemma3_text":
        path = _gemma3_text_small_window(tmp_path)
        mine = (_mlx if backend == "mlx" else _torch)(path)
    else:
        path = fixture_path(fixtures.zoo_fixture(family))
        mine = _backend(family, backend)
    ids = Tokenizer(path).encode(PROMPT + " and " + PROMPT)  # about twice the window
    if (family, backend) == ("gemma3_text", "torch"):
        # torch's fp32 forward of these real weights is 2e-2 off transformers' with every block
        # kept too; freeing must leave it exactly as it is with every block kept
        ref = _kept_stepper(_torch(path))
    else:
        ref = reference_stepper(path, FAMILIES[family].hf_architecture)
    kv = KVManager(n_ctx_slot=256, parallel=1, budget_bytes=0)
    kv.bind(mine)
    grouped = family not in ALL_SLIDING  # the sliding layers' blocks are a group of their own
    windowed = kv.allocator.sliding if grouped else kv.allocator
    assert kv.window_policy["free_behind_window"] and (kv.allocator.window is None) == grouped
    window = windowed.window
    assert window is not None and window < len(ids), "the fixture's window no longer covers its sliding layers"
    seq, _ = kv.start(ids, use_cache=False)
    bs = kv.block_size
    for start in range(0, len(ids), bs):  # chunked as a prefill is, freeing between chunks
        chunk = ids[start:start + bs]
        got, want = mine.forward_all(chunk, seq), ref(chunk)
        worst = float(np.abs(got - want).max())
        assert worst <= TOLERANCE, f"prefill chunk at {start}: max abs diff {worst}"
    token = int(want[-1].argmax())
    assert int(got[-1].argmax()) == token
    for step in range(DECODE_STEPS):
        row, ref_row = mine.forward([ForwardRow([token], seq)])[0], ref([token])[-1]
        diff = float(np.abs(row - ref_row).max())
        assert diff <= TOLERANCE, f"decode step {step}: max abs diff {diff}"
        token = int(ref_row.argmax())
        assert int(row.argmax()) == token, f"greedy tokens diverge at step {step}"
    assert (seq.sliding if grouped else seq.blocks)[0] == NULL_BLOCK
    assert windowed.used_blocks <= -(-(window - 1) // bs) + 1  # the window and the newest token's block
    if grouped:  # the global layers' table keeps every block
        assert NULL_BLOCK not in seq.blocks and kv.allocator.used_blocks == -(-seq.length // bs)


def _kept_stepper(backend):
    """Logits of every position of the tokens given, through `backend` over a pool that keeps
    every block in one table (--swa-full), one sequence across calls."""
    from mlxcel.engine.kv_manager import WINDOW_KEPT_FULL, KVManager

    kv = KVManager(n_ctx_slot=256, parallel=1, budget_bytes=0, keep_window=WINDOW_KEPT_FULL)
    kv.bind(backend)
    seq = kv.new_sequence()
    return lambda tokens: backend.forward_all(tokens, seq)


@pytest.fixture(scope="module")
def served(request):
    from mlxcel.runtime.load import load_served_model

    family, backend = request.param
    ref = fixtures.zoo_fixture(family)
    settings = ServerSettings(source=SourceSection(model=ref),
                              engine=EngineSection(ctx_size=2048, parallel=4, warmup=False),
                              backend=BackendSection(name=backend, dtype="float32",
                                                     build_env={k: os.environ[k] for k in BUILD_ENV if k in os.environ}))
    model = load_served_model(settings, fixture_path(ref))
    yield model
    model.engine.shutdown()


async def _run(model, prompt: list[int], max_tokens: int, cache_prompt: bool = True) -> tuple[list[int], int]:
    """The greedy tokens, and how many prompt tokens the prompt cache supplied."""
    tokens, last = await run(model, prompt, max_tokens, ignore_eos=True, cache_prompt=cache_prompt)
    return tokens, last.timings.cache_n


@pytest.mark.parametrize("served", CASES, indirect=True, ids=[f"{t}-{b}" for t, b in CASES])
def test_row_in_a_batch_of_four_equals_its_solo_run(served):
    enc = served.tokenizer.encode
    target = enc(PROMPT)
    others = [enc("Hi"), enc("List the planets of the solar system:"), enc(PROMPT + " and " + PROMPT)]

    async def scenario():
        solo = await _run(served, target, 12)
        together = await asyncio.gather(_run(served, target, 12, cache_prompt=False),
                                        *(_run(served, o, 6 + 3 * i) for i, o in enumerate(others)))
        return solo[0], together[0][0]

    solo, batched = asyncio.run(scenario())
    assert batched == solo


@pytest.mark.parametrize("served", CASES, indirect=True, ids=[f"{t}-{b}" for t, b in CASES])
def test_prefix_cache_hit_equals_cold_run(served):
    # a prompt no other test of this model starts with, so the first run is cold
    prompt = served.tokenizer.encode("Once more, from the top: " + PROMPT)

    async def scenario():
        return await _run(served, prompt, 10), await _run(served, prompt, 10)

    (cold, cold_cached), (warm, warm_cached) = asyncio.run(scenario())
    policy = served.engine.kv_policy()  # what /props shows under kv_cache
    if "recurrent" in FAMILIES[served.info.model_type].attention:
        assert not policy["prefix_cache"] and "recurrent" in policy["prefix_cache_off_reason"]
        assert cold_cached == 0 and warm_cached == 0
    else:
        assert policy["prefix_cache"] and policy["prefix_cache_off_reason"] is None
        assert cold_cached == 0 and warm_cached == len(prompt) - 1
    # blocks behind the window go back wherever a layer slides (on its own group beside global layers)
    assert policy["free_behind_window"] is any(layer_windows(served.info.config, served.info.num_layers))
    assert warm == cold


@pytest.fixture(scope="module")
def zoo_routers(tmp_path_factory):
    """Router-mode servers over the zoo's folder, one per backend, started on first use; one
    model loaded at a time, and an empty store root keeps the rest of the store out of the list."""
    servers: dict[str, ServerProcess] = {}

    def get(backend: str) -> ServerProcess:
        if backend not in servers:
            servers[backend] = ServerProcess([
                "--models-dir", str(models_dir() / fixtures.ZOO_OWNER), "--models-max", "1",
                "--model-store-root", str(tmp_path_factory.mktemp("empty-store")), "--offline",
                "--backend", backend, "--dtype", "float32", "-np", "2", "-c", "1024"])
        return servers[backend]

    yield get
    for server in servers.values():
        server.stop()


@pytest.mark.parametrize("family,backend", sorted(CASES, key=lambda c: c[1]))
def test_chat_round_trip(zoo_routers, family, backend):
    from openai import OpenAI

    client = OpenAI(base_url=zoo_routers(backend).base_url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=family, messages=[{"role": "user", "content": "Hello!"}],
                                           max_tokens=5, temperature=0)
    assert reply.model == family and reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens >= 1


def test_gemma3_multimodal_checkpoint_serves_text_and_refuses_images(zoo_routers):
    """Gemma 3's multimodal checkpoint is served for its text tower only (the round trip above);
    an image part is refused before it is read, with a hint that says the tower is not run."""
    import httpx

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": "gemma3", "max_tokens": 2,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]}
    r = httpx.post(zoo_routers("mlx").base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 501, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("image input is not supported - hint: ") and "served for text only" in message


def test_torch_refuses_an_mlx_conversion_whose_experts_are_stacked(tmp_path):
    """mlx-lm stacks a mixture of experts' weights (switch_mlp); transformers would load such a
    file with those weights random. The torch backend names what is missing instead."""
    from mlxcel.backends.mlx.backend import MLXBackend
    from mlxcel.backends.torch.backend import CheckpointRefused, TorchBackend
    from mlxcel.store.convert import convert

    out = convert(fixture_path(fixtures.zoo_fixture("mixtral")), tmp_path, "local/mixtral-mlx", dtype="float32")
    with pytest.raises(CheckpointRefused, match="lacks .* weights .* --backend mlx"):
        TorchBackend(out, dtype="float32")
    assert MLXBackend(out, dtype="float32").info.model_type == "mixtral"  # the conversion serves on MLX
