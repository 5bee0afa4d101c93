"""A request's cancel whose answer is already in when its callback is added (the engine thread that
called cancel was preempted between the two) must not deadlock that thread on the request's lock."""

from __future__ import annotations

import concurrent.futures
import threading

from kvbroker_client.adapter import Phase, ReceivingRequest


class AnsweredAtOnceLink:
    """The part of an EngineLink a cancel uses; its loop runs each task to its end before spawn returns."""

    engine_id = "decode-0/tp0"
    is_open = True

    def spawn(self, coro, *, name: str) -> concurrent.futures.Future:
        coro.close()
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)
        return done


def test_a_cancel_answered_before_its_callback_is_added_ends_the_request_without_deadlock():
    request = ReceivingRequest(AnsweredAtOnceLink(), "r-1")
    request.offered = True
    ended = threading.Event()
    request.when_ended(lambda _: ended.set())

    def engine_thread() -> None:
        request.fail("the decode server ended the request")  # terminal, then its cancel: answered at once
        request.cancel("again")  # nothing more to do

    caller = threading.Thread(target=engine_thread, daemon=True)
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "the engine thread deadlocked on the request's lock"
    assert ended.is_set() and request.phase is Phase.FAILED and not request.cancelling
