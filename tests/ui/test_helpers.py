"""The UI's pure helpers: word diff, config parsing, redirect safety."""

from __future__ import annotations

from services.api.routes.ui import _safe_next, parse_config, readable, word_diff


def test_word_diff_marks_changed_words_only() -> None:
    chunks = word_diff("the target is 2, so decrease", "the target is 4, so increase")
    assert ("del", "2") in chunks and ("ins", "4") in chunks
    assert ("del", "decrease") in chunks and ("ins", "increase") in chunks
    assert "".join(t for op, t in chunks if op != "ins") == "the target is 2, so decrease"
    assert "".join(t for op, t in chunks if op != "del") == "the target is 4, so increase"


def test_json_thoughts_read_as_key_lines() -> None:
    assert readable('{"cards": [1, 2], "thoughts": "add"}') == "cards: [1, 2]\nthoughts: add"
    assert readable("plain text") == "plain text"
    assert word_diff('{"a": 1}', '{"a": 1}') == [("eq", "a: 1")]


def test_parse_config_names_bad_fields() -> None:
    config, errors = parse_config('task = "numberline"\n[train]\nnum_envs = 2')
    assert config is not None and config.train.num_envs == 2 and not errors
    config, errors = parse_config('{"task": "chess"}')
    assert config is None and errors[0].startswith("task:")
    assert parse_config("task = ")[1][0].startswith("not valid TOML")
    assert parse_config("  ")[1] == ["the config is empty: paste a TOML or JSON run config"]


def test_login_redirects_stay_on_site() -> None:
    assert _safe_next("/runs/3?x=1") == "/runs/3?x=1"
    for bad in ("//evil.example", "https://evil.example", "/\\evil", None, ""):
        assert _safe_next(bad) == "/runs"


def test_word_diff_is_bounded_and_lossless_on_long_texts() -> None:
    """Long, unrelated texts fall back to lines, then to one deletion and one insertion; a small
    change in a long text stays a small chunk (the common head and tail are cut off first)."""
    import random

    rng = random.Random(0)
    words = ["the", "target", "is", "current", "number", "so", "I", "go", ".", ","]
    a = " ".join(rng.choice(words) for _ in range(5000))
    b = " ".join(rng.choice(words) for _ in range(5000))
    for before, after in ((a, b), (a, a[:100] + "CHANGED" + a[100:]), ("x" * 25_000, "y " * 9000)):
        chunks = word_diff(before, after)
        assert "".join(t for op, t in chunks if op != "ins") == before
        assert "".join(t for op, t in chunks if op != "del") == after
    small = word_diff(a, a[:100] + "CHANGED" + a[100:])
    assert sum(len(t) for op, t in small if op != "eq") < 40
