"""An environment for a subprocess in which some top-level packages are not installed.

A sitecustomize wraps every meta-path finder so the named packages and their submodules are not
found: what a machine without their wheels looks like (importlib.util.find_spec returns None,
`import` raises ModuleNotFoundError), not a stub. Used by the e2e tests of the MLX path without
torch and of the torch path without MLX.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.fixtures import REPO_ROOT, models_dir

_HIDE = '''
import sys

_HIDDEN = {names!r}

class _Hide:
    def __init__(self, inner):
        self._inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _HIDDEN:
            return None
        return self._inner.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self._inner, attr)

sys.meta_path[:] = [_Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''


def env_without(site: Path, *names: str) -> dict[str, str]:
    """os.environ for a subprocess that cannot import `names`; `site` is a scratch folder."""
    (site / "sitecustomize.py").write_text(_HIDE.format(names=tuple(names)))
    return {**os.environ, "MLXCEL_MODELS_DIR": str(models_dir()), "PYTHONPATH": f"{site}:{REPO_ROOT}"}
