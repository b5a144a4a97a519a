"""MLX forward vs transformers on torch (fp32), per family, through prefill and 16 cached
decode steps. One row per family: a new family adds a row to FAMILY_FIXTURES, not a test.

Tolerance: max |logit difference| <= 1e-3 at every step (both sides fp32 from the same
safetensors), and the greedy tokens are identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.models.registry import FAMILIES
from tests import fixtures
from tests.conftest import fixture_path
from tests.models.reference import load_reference

FAMILY_FIXTURES = {
    "llama": fixtures.DEFAULT_MODEL,
    "gemma3_text": fixtures.GEMMA3,
    "qwen2": fixtures.QWEN2_TINY,
    "qwen3": fixtures.QWEN3_TINY,
}
TOLERANCE = 1e-3
DECODE_STEPS = 16
PROMPT = "The history of the city of Paris begins"


def test_every_registered_family_has_a_parity_fixture():
    # vision-language families (no mlx-lm module: mlx-vlm's on MLX) are held to transformers in
    # tests/models/test_vlm_torch.py and test_vlm_mlx.py, gemma3's text tower here too; the zoo's
    # random-weight families in tests/models/test_zoo.py
    served = {t for t, f in FAMILIES.items() if f.mlx_module is not None}
    assert served == set(FAMILY_FIXTURES) | set(fixtures.ZOO_TYPES)
    assert not set(FAMILY_FIXTURES) & set(fixtures.ZOO_TYPES)
    assert {t for t, f in FAMILIES.items() if f.mlx_module is None} == set(fixtures.VLM_TINY) - {"gemma3"}


@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
def test_mlx_matches_transformers(family):
    import torch
    from mlxcel.engine.backend import ForwardRow
    from mlxcel.backends.mlx.backend import MLXBackend
    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(FAMILY_FIXTURES[family])
    tok = Tokenizer(path)
    ids = tok.encode(PROMPT)
    backend = MLXBackend(path, dtype="float32")
    assert backend.info.model_type == family
    ref = load_reference(path)

    seq = backend.new_sequence()
    mine = backend.forward_all(ids, seq)
    with torch.no_grad():
        out = ref(torch.tensor([ids]), use_cache=True)
    theirs, past = out.logits[0].numpy(), out.past_key_values
    worst = float(np.abs(mine - theirs).max())
    assert worst <= TOLERANCE, f"prefill max abs diff {worst}"

    tokens_mine, tokens_ref = [], []
    next_mine = int(mine[-1].argmax())
    next_ref = int(theirs[-1].argmax())
    for step in range(DECODE_STEPS):
        tokens_mine.append(next_mine)
        tokens_ref.append(next_ref)
        assert next_mine == next_ref, f"greedy tokens diverge at step {step}"
        row = backend.forward([ForwardRow([next_mine], seq)])[0]
        with torch.no_grad():
            out = ref(torch.tensor([[next_ref]]), past_key_values=past, use_cache=True)
        ref_row, past = out.logits[0, -1].numpy(), out.past_key_values
        diff = float(np.abs(row - ref_row).max())
        worst = max(worst, diff)
        assert diff <= TOLERANCE, f"decode step {step}: max abs diff {diff}"
        next_mine, next_ref = int(row.argmax()), int(ref_row.argmax())
    assert tokens_mine == tokens_ref
