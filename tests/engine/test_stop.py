"""Stop strings: streamed pieces concatenate to the non-streamed text; earliest match wins."""

from mlxcel.engine.stop import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        r = m.feed(p)
        out.append(r.text)
        if r.matched is not None:
            return "".join(out), r.matched
    out.append(m.flush())
    return "".join(out), None


def test_stop_straddling_pieces():
    assert run(["END"], ["hello E", "N", "D tail"]) == ("hello ", "END")


def test_partial_candidate_is_withheld_then_released():
    m = StopMatcher(["</s>"])
    assert m.feed("abc<").text == "abc"
    assert m.feed("/x").text == "</x"
    assert m.flush() == ""


def test_earliest_match_wins_then_list_order():
    assert run(["world", "o w"], ["hello world"]) == ("hell", "o w")
    assert run(["ab", "a"], ["xab"]) == ("x", "ab")


def test_no_stops_passes_through():
    assert run([], ["a", "b"]) == ("ab", None)


def test_every_split_gives_same_text():
    text = "The quick brown fox jumps STOP over"
    for cut in range(1, len(text)):
        assert run(["STOP"], [text[:cut], text[cut:]]) == ("The quick brown fox jumps ", "STOP")
