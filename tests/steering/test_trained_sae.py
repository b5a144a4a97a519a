"""Steering a trained SAE feature moves SmolLM2's next-token logits the way the feature points.

Measurement: pick the feature most active at the prompt's last position (layer 15 output);
its promoted tokens are the 10 vocabulary entries with the largest logit-lens score
W_U · W_dec[f] (W_U = the tied embedding matrix). The score is the mean logit of those
tokens minus the mean logit over the whole vocabulary, at the last position. Steering that
feature as a cluster (authored strength S) must raise the score, and the dial λ in
{0, 0.5, 1, 2} must raise it monotonically.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.backends.base import ForwardRow
from mlxcel.steering.manager import SteeringManager
from mlxcel.steering.store import Profile
from tests.fixtures import DEFAULT_MODEL, SAE_TRAINED, available, fixture_path, sae_available

pytestmark = pytest.mark.skipif(not (available(DEFAULT_MODEL) and sae_available(SAE_TRAINED)),
                                reason="run scripts/fixtures/build_all.py")


def _load(backend: str, path):
    """The backend at fp32, and its (tied) embedding matrix as numpy."""
    if backend == "mlx":
        from mlxcel.backends.mlx.backend import MLXBackend

        be = MLXBackend(path, dtype="float32")
        return be, np.array(be.model.model.embed_tokens.weight)
    from mlxcel.backends.torch.backend import TorchBackend

    be = TorchBackend(path, dtype="float32")
    return be, be.model.get_input_embeddings().weight.detach().float().numpy()


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_steering_a_trained_feature_raises_its_promoted_tokens_monotonically_in_lambda(backend):
    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(DEFAULT_MODEL)
    be, W_U = _load(backend, path)
    ids = Tokenizer(path).encode("The weather today is", add_special_tokens=False)
    m = SteeringManager(be.info.config["hidden_size"], be.info.num_layers)
    sae = m.attach(str(fixture_path(SAE_TRAINED))).sae
    seen = {}

    def forward(steering=None):
        seq = be.new_sequence()
        capture = {sae.layer: lambda toks, pre, post: seen.update(pre=pre)}
        out = be.forward([ForwardRow(ids, seq, steering, capture)])[0].copy()
        seq.release()
        return out

    base = forward()
    resid = seen["pre"][-1]
    f = int(np.argmax(sae.encode(resid[None])[0]))
    promoted = np.argsort(-(W_U @ sae.W_dec[f]))[:10]

    def score(logits):
        return float(logits[promoted].mean() - logits.mean())

    strength = min(float(np.linalg.norm(resid)), 90.0)  # about the residual's size; 2x stays under the ±200 clamp
    cluster = Profile(name="f", steering={f: strength}, sae_id=sae.sae_id, kind="cluster", intensity_min=0.0,
                      intensity_max=2.0)
    scores = [score(base)]
    for lam in (0.5, 1.0, 2.0):
        scores.append(score(forward(m.resolve(cluster, lam).steering)))
    assert scores[0] < scores[1] < scores[2] < scores[3], scores
