"""What the ``lmcache-mp`` backend believes L1 holds (:class:`L1Residency`): LMCache's
removals, which name chunk hashes, turned back into the chunk keys of warmed sessions.
Pure bookkeeping: no server."""

from __future__ import annotations

import pytest

from kvprefetch.agents.lmcache.l1_residency import L1Residency


def _keys(session: str, n: int, tail: bool = False) -> list[str]:
    keys = [f"acme/{session}/{i}" for i in range(n)]
    return [*keys, f"acme/{session}/{n}.7"] if tail else keys


def _hashes(*names: str) -> list[bytes]:
    return [name.encode().ljust(32, b"\0") for name in names]


def test_a_removed_chunk_takes_the_rest_of_the_session_with_it() -> None:
    book = L1Residency()
    keys = _keys("s1", 4, tail=True)
    assert book.add("acme/s1", keys, _hashes("a", "b", "c", "d")) == []
    # A lookup stops at the first chunk L1 lacks: c, d and the tail are of no use.
    assert sorted(book.removed(_hashes("c"))) == sorted(keys[2:])
    assert book.holds(keys) == [True, True, False, False, False]
    assert book.keys() == tuple(keys[:2])
    # The trimmed session no longer answers for c (a second removal of it reports nothing).
    assert book.removed(_hashes("c", "d")) == []
    assert book.removed(_hashes("a")) == keys[:2]
    assert len(book) == 0 and book.stats().chunks == 0


def test_a_shared_prefix_chunk_reports_every_session_that_holds_it() -> None:
    book = L1Residency()
    one, two, other = _keys("s1", 3), _keys("s2", 2), _keys("s3", 2)
    book.add("acme/s1", one, _hashes("p", "q", "x"))
    book.add("acme/s2", two, _hashes("p", "q"))
    book.add("acme/s3", other, _hashes("u", "v"))
    assert sorted(book.removed(_hashes("q"))) == sorted(one[1:] + two[1:])
    assert book.holds(one + two + other) == [True, False, False, True, False, True, True]


def test_forget_and_a_new_warm_replace_what_was_known() -> None:
    book = L1Residency()
    book.add("acme/s1", _keys("s1", 2), _hashes("a", "b"))
    book.forget("acme/s1")
    assert book.removed(_hashes("a", "b")) == []
    book.add("acme/s1", _keys("s1", 2), _hashes("a", "b"))
    book.add("acme/s1", _keys("s1", 3), _hashes("a", "b", "c"))
    assert book.stats().chunks == 3
    assert book.removed(_hashes("c")) == ["acme/s1/2"]


def test_a_removal_that_overtook_the_warm_is_not_recorded_as_warm() -> None:
    book = L1Residency()
    since = book.mark()
    book.removed(_hashes("b"))  # LMCache dropped b while the warm ran
    keys = _keys("s1", 3)
    assert book.add("acme/s1", keys, _hashes("a", "b", "c"), since=since) == keys[1:]
    assert book.keys() == (keys[0],)
    # A warm that starts after the removal records everything.
    assert book.add("acme/s1", keys, _hashes("a", "b", "c"), since=book.mark()) == []
    assert book.holds(keys) == [True, True, True]


def test_withdraw_all_forgets_and_returns_every_key() -> None:
    book = L1Residency()
    book.add("acme/s1", _keys("s1", 2), _hashes("a", "b"))
    book.add("acme/s2", _keys("s2", 1), [])  # warmed while no events were followed
    assert sorted(book.withdraw_all()) == sorted(_keys("s1", 2) + _keys("s2", 1))
    assert book.keys() == () and book.removed(_hashes("a")) == []
    assert book.stats().withdrawn_sessions == 2


def test_the_bound_drops_the_sessions_warmed_longest_ago_and_returns_them() -> None:
    book = L1Residency(max_chunks=4)
    book.add("acme/s1", _keys("s1", 2), _hashes("a1", "a2"))
    book.add("acme/s2", _keys("s2", 2), _hashes("b1", "b2"))
    # A trim keeps the session's age: s1 is still the oldest.
    assert book.removed(_hashes("a2")) == ["acme/s1/1"]
    assert book.add("acme/s3", _keys("s3", 3), _hashes("c1", "c2", "c3")) == [
        "acme/s1/0", "acme/s2/0", "acme/s2/1"]
    stats = book.stats()
    assert (stats.sessions, stats.chunks, stats.dropped_sessions) == (1, 3, 2)


def test_more_hashes_than_keys_is_refused() -> None:
    with pytest.raises(ValueError, match="2 chunk hashes for 1 chunk keys"):
        L1Residency().add("acme/s1", ["acme/s1/0"], _hashes("a", "b"))
