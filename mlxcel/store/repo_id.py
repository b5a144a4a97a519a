"""Repository identifiers: the `owner/name` spelling the store and the hub share.

The accepted character set is the hub's: letters, digits, `-`, `_`, `.`, not starting with
`-` or `.`, no `..` and no `--`, at most 96 characters per part. Anything else (a path
fragment, a `..`, a third component) is refused, which is also what keeps a name from
escaping the store root.
"""

from __future__ import annotations

import re

_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,95}$")


class InvalidRepoId(ValueError):
    pass


def valid_part(part: str) -> bool:
    return bool(_PART.match(part)) and ".." not in part and "--" not in part and not part.endswith(".")


def parse_repo_id(repo_id: str) -> tuple[str, str]:
    """`owner/name` -> (owner, name), or InvalidRepoId naming the value."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(valid_part(p) for p in parts):
        raise InvalidRepoId(
            f"{repo_id!r} is not a repository id: expected owner/name "
            "(letters, digits, '-', '_', '.'), e.g. HuggingFaceTB/SmolLM2-135M-Instruct"
        )
    return parts[0], parts[1]


def expand(ref: str, default_org: str) -> str:
    """A bare `name` becomes `default_org/name`; `owner/name` is returned unchanged."""
    return ref if "/" in ref else f"{default_org}/{ref}"
