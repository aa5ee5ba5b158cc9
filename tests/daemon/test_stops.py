"""Tests of daemon.stops: the one stop-string scanner of the detokenizer and the synthetic engine."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ringstream.daemon.common.stops import StopScanner


def feed(scanner: StopScanner, deltas: list[str]) -> list[str]:
    return [scanner.add(delta) for delta in deltas]


def test_no_stops_passes_text_through():
    scanner = StopScanner(())
    assert feed(scanner, ["ab", "", "c"]) == ["ab", "", "c"]
    assert scanner.flush() == "" and scanner.stop_string is None


def test_a_stop_across_deltas_is_cut_and_never_sent():
    scanner = StopScanner(["END"])
    assert feed(scanner, ["one E", "N", "D two"]) == ["one ", "", ""]
    assert scanner.stop_string == "END"
    assert scanner.add("more") == "" and scanner.flush() == ""


def test_a_possible_prefix_is_held_then_released():
    scanner = StopScanner(["abx"])
    assert feed(scanner, ["xa", "b", "c"]) == ["x", "", "abc"]
    assert scanner.add("zab") == "z"
    assert scanner.flush() == "ab" and scanner.stop_string is None


def test_the_earliest_stop_wins_and_empty_stops_are_ignored():
    scanner = StopScanner(["", "four", "two", "e t"])
    assert scanner.add("one two three four") == "on"
    assert scanner.stop_string == "e t"


def test_of_two_stops_starting_at_one_place_the_first_given_wins():
    scanner = StopScanner(["ab", "abc"])
    assert scanner.add("xabc") == "x" and scanner.stop_string == "ab"


ALPHABET = st.sampled_from(list("ab c") + ["ё", "🙂"])


@given(pieces=st.lists(st.text(ALPHABET, max_size=5), max_size=10),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3))
def test_the_output_ends_right_before_a_stop_and_holds_none(pieces, stops):
    text = "".join(pieces)
    scanner = StopScanner(stops)
    sent = "".join(feed(scanner, pieces)) + scanner.flush()
    if not any(stop in text for stop in stops):
        assert sent == text and scanner.stop_string is None
        return
    assert text.startswith(sent + scanner.stop_string)
    assert not any(stop in sent for stop in stops), "text holding a stop string was sent"
