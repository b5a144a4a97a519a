"""Text to Kokoro phonemes, offline: sentences, espeak-ng G2P through misaki, chunks the model takes.

Kokoro reads phonemes in its own alphabet (IPA with one letter per diphthong and affricate).
misaki makes them: its English G2P (`misaki.en`) needs spaCy's `en_core_web_sm`, which spaCy
downloads from outside PyPI on first use, so it cannot run offline; misaki's espeak-ng path
(`misaki.espeak`, espeak-ng bundled by the `espeakng-loader` wheel) needs nothing else and is
what the worker uses for every language: `EspeakFallback` (Kokoro's English mapping) for American
and British voices, `EspeakG2P` for the others. A voice's first letter names its language, as
Kokoro's voice packs do (af_heart: American English, female).

The model takes at most 510 phonemes at a time (its ALBERT context, less two pads), so the text is
cut into sentences, each phonemised, and a sentence past the limit is cut at word boundaries (a
single word past it at the limit). Each chunk is one model call and one streamed piece of audio.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from types import SimpleNamespace

MAX_PHONEMES = 510

# voice prefix -> (espeak-ng language, English mapping?); Japanese (j) and Mandarin (z) need
# misaki's dictionary G2Ps, which are not installed, so their voices are not served
LANGUAGES = {"a": ("en-us", True), "b": ("en-gb", True), "e": ("es", False), "f": ("fr-fr", False),
             "h": ("hi", False), "i": ("it", False), "p": ("pt-br", False)}

_SENTENCE_END = re.compile(r"(?<=[.!?…;:])\s+|\n+")


def language_of(voice: str) -> str | None:
    """The voice's language code (its first letter) when this worker can phonemise it."""
    return voice[:1] if voice[:1] in LANGUAGES and len(voice) > 1 else None


def phonemizer(code: str) -> Callable[[str], str]:
    """text -> phonemes for one language code (a key of LANGUAGES)."""
    from misaki import espeak

    language, english = LANGUAGES[code]
    if english:
        g2p = espeak.EspeakFallback(british=code == "b")
        return lambda text: g2p(SimpleNamespace(text=text))[0] or ""
    g2p = espeak.EspeakG2P(language=language)
    return lambda text: g2p(text)[0] or ""


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]


def fit(phonemes: str, limit: int = MAX_PHONEMES) -> Iterator[str]:
    """`phonemes` in pieces of at most `limit`, cut at spaces where a space is in reach."""
    rest = phonemes.strip()
    while len(rest) > limit:
        cut = rest.rfind(" ", 0, limit + 1)
        cut = cut if cut > 0 else limit
        yield rest[:cut].strip()
        rest = rest[cut:].strip()
    if rest:
        yield rest


def chunks(text: str, g2p: Callable[[str], str]) -> Iterator[str]:
    """The phoneme chunks of `text`, each at most MAX_PHONEMES, in order."""
    for sentence in sentences(text):
        yield from fit(g2p(sentence))
