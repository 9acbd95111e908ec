"""hard_exit: callbacks run newest first with the exit code, within one time budget, and os._exit always follows."""

import threading

import pytest

from forge.resilience import hard_exit as module


class Exited(Exception):
    """Stands in for os._exit, which would end the test process."""


@pytest.fixture
def exits(monkeypatch):
    codes: list[int] = []

    def fake_exit(code: int):
        codes.append(code)
        raise Exited

    monkeypatch.setattr(module.os, "_exit", fake_exit)
    monkeypatch.setattr(module, "_callbacks", [])
    return codes


def test_callbacks_run_newest_first_then_the_process_exits(exits):
    calls = []
    module.on_hard_exit(lambda code: calls.append(("first", code)))
    module.on_hard_exit(lambda code: calls.append(("second", code)))
    with pytest.raises(Exited):
        module.hard_exit(76)
    assert calls == [("second", 76), ("first", 76)]
    assert exits == [76]


def test_a_failing_callback_does_not_stop_the_others(exits, caplog):
    calls = []
    module.on_hard_exit(lambda code: calls.append(code))

    def broken(code):
        raise OSError("disk gone")

    module.on_hard_exit(broken)
    with pytest.raises(Exited):
        module.hard_exit(77)
    assert calls == [77] and exits == [77]
    assert "disk gone" in caplog.text


def test_a_hung_callback_is_abandoned_after_the_budget(exits):
    release = threading.Event()
    module.on_hard_exit(lambda code: release.wait(30))
    with pytest.raises(Exited):
        module.hard_exit(75, timeout_s=0.2)
    assert exits == [75]
    release.set()


def test_the_exit_happens_even_when_running_the_callbacks_breaks(exits, monkeypatch):
    def no_threads(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(module, "run_callbacks", no_threads)
    with pytest.raises(Exited):
        module.hard_exit(76)
    assert exits == [76]


def test_unregistered_callbacks_do_not_run(exits):
    calls = []
    forget = module.on_hard_exit(lambda code: calls.append(code))
    forget()
    forget()  # twice is harmless
    with pytest.raises(Exited):
        module.hard_exit(76)
    assert calls == []
