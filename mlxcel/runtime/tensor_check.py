"""A checkpoint's tensors checked against the model before it is served: every tensor's shape
against what the family's module expects, and every floating value for NaN / Inf.

Shapes: the MLX family module is built as loading builds it (mlxcel's layout seam, the
checkpoint's quantization), with its weights left lazy so nothing is read, and every parameter
is compared with the checkpoint's (after the family's own `sanitize`): missing, unexpected and
mismatched names are all reported, not only the first. Values: store/tensor_scan.py, one tensor
at a time. `mlxcel inspect --check-tensors` prints the report; the server's --check-tensors
refuses to start on any problem.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from mlxcel.store.tensor_scan import BadValues, scan_all


@dataclass
class TensorReport:
    tensors: int = 0
    shape_problems: list[str] = field(default_factory=list)
    bad_values: list[BadValues] = field(default_factory=list)
    shapes_unchecked: str | None = None  # why the shapes could not be checked

    @property
    def ok(self) -> bool:
        return not self.shape_problems and not self.bad_values

    def lines(self) -> list[str]:
        out = [f"shape: {p}" for p in self.shape_problems] + [f"values: {b}" for b in self.bad_values]
        if self.shapes_unchecked:
            out.append(f"shapes not checked: {self.shapes_unchecked}")
        return out


def shape_problems(path: Path, limit: int = 20) -> list[str]:
    """Every parameter the family's module expects that the checkpoint lacks, holds in another
    shape, or that the module has no place for (at most `limit`, then a count)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from mlxcel.backends.mlx.backend import _get_classes
    from mlxcel.models.checkpoint_config import mlx_overrides

    found: list[str] = []

    def classes(config: dict):
        model_cls, args_cls = _get_classes(config)

        class Checked(model_cls):
            def load_weights(self, weights, strict: bool = True):
                expected = dict(tree_flatten(self.parameters()))
                given = dict(weights)
                for name in sorted(expected.keys() - given.keys()):
                    found.append(f"{name}: missing from the checkpoint (expected {tuple(expected[name].shape)})")
                for name in sorted(given.keys() - expected.keys()):
                    found.append(f"{name}: the model has no such parameter")
                for name in sorted(expected.keys() & given.keys()):
                    if tuple(expected[name].shape) != tuple(given[name].shape):
                        found.append(f"{name}: shape {tuple(given[name].shape)}, the model expects "
                                     f"{tuple(expected[name].shape)}")
                return super().load_weights(weights, strict=False)

        Checked.__name__ = model_cls.__name__
        return Checked, args_cls

    raw = json.loads((Path(path) / "config.json").read_text())
    load_model(Path(path), lazy=True, strict=False, get_model_classes=classes, model_config=mlx_overrides(raw) or None)
    if len(found) > limit:
        found[limit:] = [f"... and {len(found) - limit} more"]
    return found


def check_tensors(path: Path) -> TensorReport:
    report = TensorReport()
    if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
        report.shapes_unchecked = "MLX is not installed (its family modules state the expected shapes)"
    else:
        from mlxcel.models.registry import UnsupportedModelType

        try:
            report.shape_problems = shape_problems(path)
        except UnsupportedModelType as e:  # not a family MLX builds: its values are still scanned
            report.shapes_unchecked = str(e)
        except (ValueError, KeyError, TypeError) as e:
            report.shape_problems = [f"the model cannot be built from this checkpoint: {e}"]
    report.tensors, report.bad_values = scan_all(path)
    return report
