"""The set of open tracker issues, for the manifest validator's `--check-issues-open` gate.

Two sources, in this order: an explicit list (`--open-issues 3,4,5`, what CI passes when it
has no tracker client), or the project's `issues` command line tool (`issues list` prints one
line per open issue, `# issue N: ... · open`). When neither is available the gate cannot be
evaluated, and that is an error the caller reports: it never quietly passes.

The gate itself: a `deferred` entry, the one state that promises further work, must point at an
open issue (the spec's gate: "a deferred entry pointing at a closed issue fails"). The other
states keep their issue as provenance: `supported` and `aliased` are served, `not_applicable`
has no equivalent to build, and `by_design` is closed to further work by definition.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterable

GATED_STATES = ("deferred",)
TRACKER_COMMAND = ("issues", "list")
# `# issue 4: filed by a session · open`; the state word after the last `·` is optional.
_ISSUE_LINE = re.compile(r"^#\s*issue\s+(\d+)\s*:(?P<rest>.*)$")


class OpenIssuesUnavailable(Exception):
    """The open issue set could not be determined; the message says what to pass instead."""


def parse_issue_list(text: str) -> set[int]:
    """Issue numbers from `--open-issues` text: comma- or space-separated positive integers."""
    numbers = set()
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        if not item.isdigit() or int(item) <= 0:
            raise OpenIssuesUnavailable(f"--open-issues: {item!r} is not an issue number")
        numbers.add(int(item))
    return numbers


def parse_tracker_listing(output: str) -> set[int]:
    """Open issue numbers from `issues list` output; other lines (quoted titles) are skipped."""
    numbers = set()
    recognised = False
    for line in output.splitlines():
        m = _ISSUE_LINE.match(line.strip())
        if not m:
            continue
        recognised = True
        rest = m.group("rest")
        state = rest.rsplit("·", 1)[1].strip().lower() if "·" in rest else "open"
        if state == "open":
            numbers.add(int(m.group(1)))
    if output.strip() and not recognised:
        raise OpenIssuesUnavailable(
            f"`{' '.join(TRACKER_COMMAND)}` printed no line of the form '# issue N: ...'; "
            "its output format is not understood: pass --open-issues N,N,... instead")
    return numbers


def open_issues_from_tracker(which: Callable[[str], str | None] = shutil.which,
                             run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                             ) -> set[int]:
    exe = which(TRACKER_COMMAND[0])
    if exe is None:
        raise OpenIssuesUnavailable(
            "--check-issues-open needs the open issue set: pass --open-issues N,N,... or run "
            f"where the `{TRACKER_COMMAND[0]}` command is on PATH (it is not)")
    try:
        proc = run([exe, *TRACKER_COMMAND[1:]], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise OpenIssuesUnavailable(f"`{' '.join(TRACKER_COMMAND)}` could not run ({e}); "
                                    "pass --open-issues N,N,... instead") from e
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise OpenIssuesUnavailable(
            f"`{' '.join(TRACKER_COMMAND)}` exited {proc.returncode}"
            + (f": {detail[-1]}" if detail else "") + "; pass --open-issues N,N,... instead")
    return parse_tracker_listing(proc.stdout)


def resolve_open_issues(explicit: str | None, **tracker) -> tuple[set[int], str]:
    """(open set, where it came from); raises OpenIssuesUnavailable when there is none."""
    if explicit is not None:
        return parse_issue_list(explicit), "--open-issues"
    return open_issues_from_tracker(**tracker), f"`{' '.join(TRACKER_COMMAND)}`"


def closed_issue_problems(entries: Iterable[tuple[str, dict]], open_issues: set[int]) -> list[str]:
    """One line per gated entry whose issue is not open; `entries` is (shard file, entry)."""
    lines = []
    shown = ", ".join(f"#{n}" for n in sorted(open_issues)) or "none"
    for filename, entry in entries:
        state, issue = entry.get("state"), entry.get("issue")
        if state not in GATED_STATES or not isinstance(issue, int) or issue in open_issues:
            continue
        lines.append(f"{filename}: {entry.get('id')}: {_article(state)} {state} entry points "
                     f"at issue #{issue}, which is not open (open: {shown}); re-home it to the open issue that "
                     "owns the remaining work")
    return lines


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"
