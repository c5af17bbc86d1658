"""`log_text`: whatever a client sends, what reaches a log line is one line, escaped, and
bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ember.server.log_text import MAX_LOG_TEXT_CHARS, log_text, log_texts

_any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=300)


@settings(max_examples=300, database=None)
@given(_any_text)
def test_any_text_becomes_one_bounded_printable_line(text):
    logged = log_text(text)
    assert logged.isprintable() and logged.encode()  # no newline, no escape, valid UTF-8
    assert len(logged) <= 10 * MAX_LOG_TEXT_CHARS + 30  # an escape takes 10 at most: \UNNNNNNNN


def test_control_characters_are_escaped():
    assert log_text("a\nb\x1b[31m\ud800") == "'a\\nb\\x1b[31m\\ud800'"


def test_long_text_is_cut_and_says_how_long_it_was():
    logged = log_text("x" * 5000)
    assert logged == repr("x" * MAX_LOG_TEXT_CHARS) + "... (5000 chars)"


def test_many_texts_show_the_first_and_count_the_rest():
    assert log_texts(["a", "b", "c"], limit=2) == "'a', 'b' and 1 more"
    assert log_texts(["a", "b"], limit=2) == "'a', 'b'"
