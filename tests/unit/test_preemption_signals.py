"""Preemption signals in one process: the handler only takes note, the
previous handlers come back, the settings refuse bad values, SLURM's job
to requeue, and the watchdog that ends a rank stuck after a signal."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from keras_torch_distribution import Preempted
from keras_torch_distribution import _env
from keras_torch_distribution._preemption import requeue
from keras_torch_distribution._preemption import signals


@pytest.fixture
def caught(monkeypatch):
    monkeypatch.setenv("KTD_PREEMPTION_WAIT", "0")
    before = {n: signal.getsignal(n) for n in (signal.SIGTERM, signal.SIGUSR1)}
    assert signals.catch()
    yield before
    signals.release()


def test_the_handler_only_takes_note_of_the_first_signal(caught):
    assert signals.received() == 0
    signal.raise_signal(signal.SIGUSR1)
    signal.raise_signal(signal.SIGTERM)
    assert signals.received() == signal.SIGUSR1  # the first one counts
    assert signals.seconds_since_signal() >= 0


def test_release_puts_the_previous_handlers_back(caught):
    signals.release()
    for number, handler in caught.items():
        assert signal.getsignal(number) is handler
    assert signals.received() == 0
    signals.release()  # twice is harmless


def test_preempted_exits_with_128_plus_the_signal():
    preempted = Preempted(signal.SIGTERM, "preempted by SIGTERM")
    assert isinstance(preempted, SystemExit)
    assert preempted.code == 143 and str(preempted) == "preempted by SIGTERM"
    assert Preempted(signal.SIGUSR1, "").code == 138


@pytest.mark.parametrize(
    "text,expected",
    [
        (None, (signal.SIGTERM, signal.SIGUSR1)),
        ("none", ()),
        ("SIGTERM", (signal.SIGTERM,)),
        ("term, usr2", (signal.SIGTERM, signal.SIGUSR2)),
    ],
)
def test_preemption_signals_setting(monkeypatch, text, expected):
    if text is None:
        monkeypatch.delenv("KTD_PREEMPTION_SIGNALS", raising=False)
    else:
        monkeypatch.setenv("KTD_PREEMPTION_SIGNALS", text)
    assert _env.preemption_signals() == expected


@pytest.mark.parametrize("text", ["SIGKILL", "SIGNOPE", "15"])
def test_preemption_signals_setting_refuses_what_cannot_be_caught(
    monkeypatch, text
):
    monkeypatch.setenv("KTD_PREEMPTION_SIGNALS", text)
    with pytest.raises(
        ValueError, match=f"KTD_PREEMPTION_SIGNALS='{text}'.*SIGTERM,SIGUSR1"
    ):
        _env.preemption_signals()


def test_preemption_wait_and_requeue_settings_refuse_bad_values(monkeypatch):
    monkeypatch.setenv("KTD_PREEMPTION_WAIT", "-1")
    with pytest.raises(ValueError, match="KTD_PREEMPTION_WAIT='-1'.*20"):
        _env.preemption_wait()
    monkeypatch.setenv("KTD_SLURM_REQUEUE", "yes")
    with pytest.raises(ValueError, match="KTD_SLURM_REQUEUE='yes'.*auto"):
        _env.slurm_requeue()


@pytest.mark.parametrize(
    "environ,setting,number,expected",
    [
        ({}, "auto", signal.SIGUSR1, None),  # not under SLURM
        ({"SLURM_JOB_ID": "7"}, "auto", signal.SIGUSR1, "7"),
        ({"SLURM_JOB_ID": "7"}, "auto", signal.SIGTERM, None),
        ({"SLURM_JOB_ID": "7"}, "1", signal.SIGTERM, "7"),
        ({"SLURM_JOB_ID": "7"}, "0", signal.SIGUSR1, None),
        (
            {
                "SLURM_JOB_ID": "9",
                "SLURM_ARRAY_JOB_ID": "7",
                "SLURM_ARRAY_TASK_ID": "2",
            },
            "auto",
            signal.SIGUSR1,
            "7_2",
        ),
    ],
)
def test_job_to_requeue(monkeypatch, environ, setting, number, expected):
    monkeypatch.setenv("KTD_SLURM_REQUEUE", setting)
    assert requeue.job_to_requeue(number, environ) == expected


def test_a_failed_requeue_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    assert "the requeue failed" in requeue.requeue("7")


WATCHDOG = textwrap.dedent(
    """
    import os, signal, time
    from keras_torch_distribution._preemption import signals
    assert signals.catch()
    print("ready", flush=True)
    while True:  # never reaches a step boundary
        time.sleep(0.05)
    """
)


def test_the_watchdog_ends_a_rank_that_reaches_no_boundary():
    env = dict(os.environ, KTD_PREEMPTION_WAIT="1", KERAS_BACKEND="torch")
    process = subprocess.Popen(
        [sys.executable, "-c", WATCHDOG],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, stderr
    assert "SIGTERM received 1 s ago" in stderr
    assert "exiting with 143 without saving" in stderr
