"""``Landing``: whether a transport may still write into a pull's destination (every transport and
the engine's quarantine read it)."""

from __future__ import annotations

import threading

import pytest

from transports import Landing


def test_busy_from_the_first_begin_to_the_last_end_and_callbacks_run_then() -> None:
    landing, ran = Landing(), []
    assert not landing.busy
    landing.when_idle(lambda: ran.append("at once"))  # idle: runs now
    assert ran == ["at once"]
    landing.begin()
    landing.begin()  # two receives into one destination (chunks, several sources)
    landing.when_idle(lambda: ran.append("idle"))
    assert landing.busy and ran == ["at once"]
    landing.end()
    assert landing.busy and ran == ["at once"]  # one receive may still write
    landing.end()
    assert not landing.busy and ran == ["at once", "idle"]
    landing.begin()
    landing.end()
    assert ran == ["at once", "idle"]  # a callback runs once


def test_an_end_without_a_begin_is_a_bug_not_a_silent_count() -> None:
    landing = Landing()
    with pytest.raises(RuntimeError):
        landing.end()
    assert not landing.busy


def test_busy_is_read_from_another_thread_without_the_lock() -> None:
    landing = Landing()
    landing.begin()
    seen: list[bool] = []
    with landing._lock:  # held by the loop thread: a reader elsewhere must not wait for it
        t = threading.Thread(target=lambda: seen.append(landing.busy))
        t.start()
        t.join(5)
    assert seen == [True]
    landing.end()
