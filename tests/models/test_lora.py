"""LoRA terms against a hand-merged reference (scripts/fixtures/build_lora.py's adapter on SmolLM2).

The reference is transformers in fp32 with the adapter merged into the base weights by hand
(W + s * alpha / r * B @ A); mlxcel serves the same adapter unfused, per row. Checked on each
backend in fp32, over a prefill and decode steps with two rows in one batch at different
scales: each row's logits within TOLERANCE of its own merged reference (the unfused sum and
the merged matmul round differently; measured worst here 5.9e-5 on MLX, 2.7e-5 on torch), and a row at 0.0 equal to
the base model's logits bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import DEFAULT_MODEL, default_backends, fixture_path
from tests.fixtures import LORA_SMOLLM2, fixture_path as store_path, lora_available

TOLERANCE = 2e-4
PROMPTS = ("The capital of France is", "Once upon a time,")
SCALES = (1.0, 0.5)
DECODE_STEPS = 3


def _adapter_path():
    if not lora_available(LORA_SMOLLM2):
        pytest.fail(f"fixture adapter {LORA_SMOLLM2} is missing: run `make fixtures`")
    return store_path(LORA_SMOLLM2)


def _merged_reference(path, adapter, scale):
    import torch
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    mods = dict(ref.named_modules())
    with torch.no_grad():
        for module, (a, b) in adapter.terms.items():  # b already carries alpha / r
            mods[module].weight += scale * torch.from_numpy(b) @ torch.from_numpy(a)
    return ref


def _backend(name, path):
    if name == "torch":
        from mlxcel.backends.torch.backend import TorchBackend

        return TorchBackend(path, dtype="float32")
    import mlx.core as mx

    from mlxcel.backends.mlx.backend import MLXBackend

    mx.set_default_device(mx.cpu)
    return MLXBackend(path, dtype="float32")


@pytest.mark.parametrize("backend_name", default_backends())
def test_unfused_terms_match_merged_weights(backend_name):
    import torch

    from mlxcel.engine.backend import ForwardRow
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.models.lora import load_adapter

    path = fixture_path(DEFAULT_MODEL)
    adapter = load_adapter(_adapter_path())
    tok = Tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    backend = _backend(backend_name, path)
    backend.attach_lora([adapter])

    # base logits (no adapter in use) before and after attaching are the same bits
    seq = backend.new_sequence()
    base_row = backend.forward([ForwardRow(prompts[0], seq, lora=(0.0,))])[0]
    seq.release()
    plain = _backend(backend_name, path)
    seq = plain.new_sequence()
    assert np.array_equal(base_row, plain.forward([ForwardRow(prompts[0], seq)])[0])
    seq.release()
    del plain

    refs = [_merged_reference(path, adapter, s) for s in SCALES]
    seqs = [backend.new_sequence() for _ in prompts]
    pasts, nexts, worst = [], [], 0.0
    for i, ids in enumerate(prompts):
        mine = backend.forward([ForwardRow(ids, seqs[i], lora=(SCALES[i],))])[0]
        with torch.no_grad():
            out = refs[i](torch.tensor([ids]), use_cache=True)
        pasts.append(out.past_key_values)
        theirs = out.logits[0, -1].numpy()
        worst = max(worst, float(np.abs(mine - theirs).max()))
        nexts.append(int(theirs.argmax()))
    for _ in range(DECODE_STEPS):  # both rows in one batch, each with its own scale
        rows = backend.forward([ForwardRow([n], s, lora=(sc,)) for n, s, sc in zip(nexts, seqs, SCALES)])
        for i in range(len(prompts)):
            with torch.no_grad():
                out = refs[i](torch.tensor([[nexts[i]]]), past_key_values=pasts[i], use_cache=True)
            pasts[i] = out.past_key_values
            theirs = out.logits[0, -1].numpy()
            worst = max(worst, float(np.abs(rows[i] - theirs).max()))
            nexts[i] = int(theirs.argmax())
    print(f"{backend_name}: worst max abs logit diff {worst:.2e}")
    assert worst <= TOLERANCE
    # the adapter really moves the logits (the test would pass vacuously otherwise)
    assert float(np.abs(base_row - refs[0](torch.tensor([prompts[0]])).logits[0, -1].detach().numpy()).max()) > 0.1
