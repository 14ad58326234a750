"""The prefill driver's bootstrap look-ups: a stalled server holds up only its own look-ups."""

from __future__ import annotations

import queue
import socket
import threading
import time

import pytest
from live_helpers import HOST, wait_until

from transfer.core.prefill import LookUpParallel, LookUpRoute
from transfer.drive.prefill import LOOKUP_THREADS, _LookUps

pytestmark = pytest.mark.live

STALL_S = 60.0  # how long a look-up waits for the stalled server


def test_a_look_up_submitted_behind_a_stalled_one_is_answered_while_a_thread_was_idle(server):
    answers: queue.Queue = queue.Queue()
    lookups = _LookUps("epd-test-boot", STALL_S, time.monotonic, answers.put, 4)
    with socket.socket() as silent:  # accepts connections and never answers
        silent.bind((HOST, 0))
        silent.listen(16)
        stalled = f"{HOST}:{silent.getsockname()[1]}"
        try:
            lookups.submit(LookUpParallel(server.address))
            assert answers.get(timeout=10.0)[1] == server.address
            assert wait_until(lambda: lookups._idle == 1, 10.0)  # one thread, waiting for work
            lookups.submit(LookUpParallel(stalled))
            lookups.submit(LookUpParallel(server.address))
            answer = answers.get(timeout=10.0)
            assert answer[1] == server.address, answer
        finally:
            silent.close()  # the stalled look-up's connection is reset: it ends now
            lookups.close(10.0)


def test_a_stalled_server_with_a_look_up_for_every_thread_leaves_one_to_the_other_servers(server):
    """Look-ups of as many routes as there are threads, at a server that accepts and never answers (its sizes
    answered, then it hung): they hold all but one thread, and another server's look-up is answered on that
    one meanwhile, not once theirs time out; the stalled server's last look-up waits for one of its own."""
    answers: queue.Queue = queue.Queue()
    lookups = _LookUps("epd-test-boot", STALL_S, time.monotonic, answers.put, LOOKUP_THREADS)
    with socket.socket() as silent:
        silent.bind((HOST, 0))
        silent.listen(16)
        stalled = f"{HOST}:{silent.getsockname()[1]}"
        try:
            for group in range(LOOKUP_THREADS):
                lookups.submit(LookUpRoute((stalled, group, 0)))
            assert wait_until(lambda: len(lookups._busy) >= LOOKUP_THREADS - 1, 10.0), lookups._busy
            lookups.submit(LookUpParallel(server.address))
            answer = answers.get(timeout=10.0)
            assert answer[1] == server.address, answer
            assert [job.bootstrap_addr for job in lookups._jobs] == [stalled]
        finally:
            silent.close()
            lookups.close(10.0)


def test_a_host_name_the_resolver_never_answers_holds_a_look_up_thread_only_for_the_look_up_timeout(server,
                                                                                                    monkeypatch):
    """getaddrinfo() takes no timeout: a name whose resolver does not answer fails its look-up at the
    look-up timeout, and the one look-up thread goes on to the next server's."""
    answers: queue.Queue = queue.Queue()
    unanswered = threading.Event()
    resolve = socket.getaddrinfo

    def stalling_resolver(host, *args, **kwargs):
        if host == "resolver-stalls.example":
            unanswered.wait(STALL_S)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", stalling_resolver)
    lookups = _LookUps("epd-test-boot", 0.5, time.monotonic, answers.put, 1)
    try:
        lookups.submit(LookUpParallel("resolver-stalls.example:8998"))
        lookups.submit(LookUpParallel(server.address))
        kind, address, _, detail, _ = answers.get(timeout=10.0)
        assert (kind, address) == ("failed", "resolver-stalls.example:8998")
        assert "looking up the host name 'resolver-stalls.example' did not answer within 0.5s" in detail, detail
        answer = answers.get(timeout=10.0)  # the server's answer (no encode rank registered there)
        assert answer[1] == server.address and "incomplete parallel info" in answer[3], answer
    finally:
        unanswered.set()
        lookups.close(10.0)
