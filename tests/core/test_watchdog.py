"""The watchdog (layer/device/watchdog.py) on CPU, over status words written by hand.

A CPU InputStatus behaves as the pinned CUDA one does, minus the asynchrony: ``word`` is what the
kernels record into, ``publish()`` is the end of a forward (clear what was reported, copy to the
host). Shown: a problem is reported once two polls agree, at ERROR, naming layer, token and value,
counted, rate-limited per layer and problem; reported once whoever sees it first (the watchdog or
the eager check); cleared by the next publish so the next problem is seen; a peer timeout ends the
process (a real child process: exit status and log line), or under MEGA_ON_PEER_TIMEOUT=raise is
logged once and raised by the eager check; the thread polls on its own, stops, and never keeps an
interpreter from exiting.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megamoe_backend.layer.device.status import BAD_EXPERT_ID, NONFINITE_INPUT, PEER_TIMEOUT, InputStatus
from megamoe_backend.layer.device.process_end import EXIT_STATUS
from megamoe_backend.layer.device.watchdog import Watchdog, process_watchdog, watch
from megamoe_backend.transport import PeerTimeoutError

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def lines():
    """The ERROR lines the 'megamoe' logger emits during the test."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.ERROR:
                records.append(record.getMessage())

    log = logging.getLogger("megamoe")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield records
    log.removeHandler(handler)
    log.setLevel(level)


def status(on_peer_timeout="exit"):
    return InputStatus(torch.device("cpu"), 16, rank=1, timeout_s=3.0, layer_names={0: "layer 0", 1: "layer 7"},
                       on_peer_timeout=on_peer_timeout)


def record(st, code, layer, value, row):
    """What a kernel's _record does: first problem wins."""
    if int(st.word[0]) == 0:
        st.word.copy_(torch.tensor([code, layer, value, row]))


def test_a_bad_id_is_logged_once_counted_and_cleared_by_the_next_publish(lines):
    st, dog = status(), Watchdog(clock=Clock())
    dog.watch(st)
    record(st, BAD_EXPERT_ID, 1, 999, 3)
    st.publish()
    dog.poll()
    assert lines == []  # one sighting: the copy could still be landing
    dog.poll()
    assert len(lines) == 1 and "layer 7: topk_ids holds 999 at token 3" in lines[0] and "0..15" in lines[0]
    assert dog.counts == {("layer 7", "bad_expert_id"): 1}
    dog.poll()  # still in the word until the next publish: not reported again
    assert len(lines) == 1 and sum(dog.counts.values()) == 1
    st.publish()  # the end of the next forward: the word is cleared in stream order
    assert st.word.tolist() == [0, 0, 0, 0] and st.snapshot()[0] == 0
    record(st, BAD_EXPERT_ID, 1, 998, 5)  # the next problem is recorded and seen
    st.publish()
    dog.poll(), dog.poll()
    assert dog.counts == {("layer 7", "bad_expert_id"): 2}
    assert len(lines) == 1  # rate-limited: within RATE_LIMIT_S of the last line for (layer 7, bad id)


def test_rate_limit_is_per_layer_and_problem_and_says_what_it_folded(lines):
    clock = Clock()
    st, dog = status(), Watchdog(clock=clock, rate_limit_s=10.0)
    dog.watch(st)

    def report(code, layer, value, row):
        record(st, code, layer, value, row)
        st.publish()
        dog.poll(), dog.poll()
        st.publish()

    report(BAD_EXPERT_ID, 1, 999, 0)
    report(BAD_EXPERT_ID, 1, 999, 1)  # folded
    report(NONFINITE_INPUT, 1, 0, 2)  # another problem: its own line
    report(BAD_EXPERT_ID, 0, 999, 0)  # another layer: its own line
    clock.now = 11.0
    report(BAD_EXPERT_ID, 1, 999, 4)
    assert len(lines) == 4
    assert "hidden_states row 2 holds NaN/Inf" in lines[1] and "layer 0: topk_ids" in lines[2]
    assert "token 4" in lines[3] and "(+1 more reports of this since the last line)" in lines[3]
    assert dog.counts == {("layer 7", "bad_expert_id"): 3, ("layer 7", "nonfinite_input"): 1,
                          ("layer 0", "bad_expert_id"): 1}


def test_a_torn_copy_is_not_acted_on(lines):
    st, dog = status(), Watchdog()
    dog.watch(st)
    st.host.copy_(torch.tensor([BAD_EXPERT_ID, 0, 0, 0]))  # the code landed, the details not yet
    dog.poll()
    st.host.copy_(torch.tensor([BAD_EXPERT_ID, 1, 999, 3]))
    dog.poll()
    assert lines == []
    dog.poll()
    assert len(lines) == 1 and "layer 7: topk_ids holds 999 at token 3" in lines[0]


def test_each_problem_is_reported_once_by_the_eager_check_or_the_watchdog(lines):
    st, dog = status(), Watchdog()
    dog.watch(st)
    record(st, BAD_EXPERT_ID, 1, 999, 3)
    st.publish()
    dog.poll()
    with pytest.raises(ValueError, match="topk_ids holds 999 at token 3"):
        st.raise_if_bad()  # the eager check came first: it raises ...
    dog.poll(), dog.poll()
    assert lines == [] and not dog.counts  # ... and the watchdog stays silent
    record(st, BAD_EXPERT_ID, 1, 7, 2)
    st.publish()
    dog.poll(), dog.poll()
    assert len(lines) == 1  # the watchdog came first: it logs ...
    st.raise_if_bad()  # ... and the eager check does not raise it again, but clears it
    assert st.word.tolist() == [0, 0, 0, 0] and st.host.tolist() == [0, 0, 0, 0]


def test_a_peer_timeout_ends_the_process_unless_raise(lines):
    ended: list[str] = []
    st, dog = status(), Watchdog(end_process=ended.append)
    dog.watch(st)
    record(st, PEER_TIMEOUT, 1, 0, 0)
    st.publish()
    dog.poll(), dog.poll(), dog.poll()
    assert len(ended) == 1 and "layer 7: ep_rank 1 waited more than MEGA_P2P_TIMEOUT_S=3s for ep_rank 0" in ended[0]
    assert "dispatch (its token rows) barrier" in ended[0]
    with pytest.raises(PeerTimeoutError):  # an eager forward racing the exit does not go on either
        st.raise_if_bad()

    st, dog = status("raise"), Watchdog(end_process=ended.append)
    dog.watch(st)
    record(st, PEER_TIMEOUT, 0, 1, 1)
    st.publish()
    for _ in range(4):
        dog.poll()
    assert len(ended) == 1 and len(lines) == 1  # logged once, the process goes on
    assert "combine (its expert rows) barrier" in lines[0] and "the next eager forward raises it" in lines[0]
    with pytest.raises(PeerTimeoutError, match="layer 0: ep_rank 1 waited"):
        st.raise_if_bad()


def test_the_eager_check_ends_the_process_on_a_timeout_under_exit():
    ended: list[str] = []
    st = status()
    st.end_process = ended.append
    record(st, PEER_TIMEOUT, 1, 0, 1)
    st.publish()
    with pytest.raises(PeerTimeoutError):
        st.raise_if_bad()
    assert len(ended) == 1 and "for ep_rank 0 at the combine" in ended[0]


def test_the_thread_polls_on_its_own_and_stops(lines):
    st, dog = status(), Watchdog(period_s=0.01)
    dog.watch(st)
    dog.start()
    try:
        record(st, BAD_EXPERT_ID, 0, 999, 1)
        st.publish()
        deadline = time.monotonic() + 5.0  # a loaded CI machine; it takes ~2 periods
        while not (dog.counts and lines) and time.monotonic() < deadline:  # counted, then logged
            time.sleep(0.01)
        assert dog.counts == {("layer 0", "bad_expert_id"): 1} and len(lines) == 1
    finally:
        dog.stop()
    assert not dog.running


def test_the_process_watchdog_is_one_thread_and_forgets_dead_words():
    dog = process_watchdog()
    assert process_watchdog() is dog and dog.running
    st = status()
    watch(st)
    assert any(w.status() is st for w in dog._watched)
    del st
    dog.poll()
    assert all(w.status() is not None for w in dog._watched)


def _child(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env=env)


def test_a_peer_timeout_really_ends_a_process_with_the_exit_status():
    done = _child("""
        import logging, sys, time, torch
        logging.basicConfig(level=logging.INFO)
        from megamoe_backend.layer.device.status import InputStatus, PEER_TIMEOUT
        from megamoe_backend.layer.device.watchdog import Watchdog
        st = InputStatus(torch.device("cpu"), 16, rank=0, timeout_s=2.0, layer_names={0: "layer 3"}, on_peer_timeout="exit")
        dog = Watchdog(period_s=0.01)
        dog.watch(st)
        dog.start()
        st.word.copy_(torch.tensor([PEER_TIMEOUT, 0, 1, 0]))
        st.publish()
        start = time.monotonic()
        time.sleep(30)
        print("still alive", time.monotonic() - start)
    """)
    assert done.returncode == EXIT_STATUS, (done.returncode, done.stdout, done.stderr)
    assert "still alive" not in done.stdout
    assert "layer 3: ep_rank 0 waited more than MEGA_P2P_TIMEOUT_S=2s for ep_rank 1" in done.stderr
    assert f"Ending this process (exit status {EXIT_STATUS}" in done.stderr


def test_a_running_watchdog_never_holds_the_interpreter_at_exit():
    start = time.monotonic()
    done = _child("""
        from megamoe_backend.layer.device.watchdog import process_watchdog
        assert process_watchdog().running
        print("bye")
    """)
    assert done.returncode == 0 and "bye" in done.stdout, done.stderr
    assert time.monotonic() - start < 60
