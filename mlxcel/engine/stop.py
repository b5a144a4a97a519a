"""Stop strings matched on decoded text, safe for streaming.

Text that could still turn into a stop string is withheld until the next piece decides
it, so the concatenation of streamed pieces always equals the non-streamed text. The
earliest match in the text wins; among matches at the same position, the first string
in the request's list.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopResult:
    text: str  # text that may be released now
    matched: str | None = None  # the stop string that ended generation, if any


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, piece: str) -> StopResult:
        buf = self._held + piece
        if not self.stops:
            self._held = ""
            return StopResult(buf)
        best: tuple[int, int] | None = None
        for order, s in enumerate(self.stops):
            pos = buf.find(s)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, order)
        if best is not None:
            self._held = ""
            return StopResult(buf[: best[0]], self.stops[best[1]])
        hold = self._partial_suffix(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return StopResult(buf[: len(buf) - hold])

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of `buf` that begins some stop string."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), longest, -1):
                if s.startswith(buf[-k:]):
                    longest = k
                    break
        return longest
