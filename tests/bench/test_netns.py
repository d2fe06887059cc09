# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The benchmark's emulated link (``bench/netns.py``): a namespace whose loopback is shaped to a
rate delivers that rate (±20%) while the host's loopback stays as it was and much faster, and
the namespace is gone after a normal exit, an exception, SIGTERM or SIGINT, and when a stale one
was left by a dead process. The namespace tests need root, ``ip`` and ``tc``; they are skipped
with ``netns.unavailable_reason()`` otherwise. Rate parsing runs everywhere.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import netns  # noqa: E402

REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no shaped namespace: {REASON}")
# A prefix of our own, so the stale-namespace test never meets a concurrent benchmark's namespaces.
PREFIX = "zero3muon-test"

RATE = 40e6  # 40 Mbit/s = 5 MB/s
NBYTES = 8_000_000  # 1.6 s at RATE: tbf's 128 KiB bucket is under 2% of it


def host_lo_qdisc():
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], stdout=subprocess.PIPE, text=True,
                          check=True).stdout


def ours():
    return [n for n in netns.list_namespaces() if n.startswith(PREFIX + "-")]


@needs_netns
def test_shaped_rate_is_delivered_and_host_loopback_untouched():
    host_before = host_lo_qdisc()
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    with netns.shaped_namespace(RATE, PREFIX) as prefix:
        inside = subprocess.run(prefix + ["tc", "qdisc", "show", "dev", "lo"], stdout=subprocess.PIPE, text=True,
                                check=True).stdout
        assert "tbf" in inside and "rate 40Mbit" in inside, inside
        assert host_lo_qdisc() == host_before
        shaped = netns.measure_throughput(prefix, NBYTES)
    host = netns.measure_throughput([], 5 * NBYTES)
    print(f"asked {netns.describe_rate(RATE)}, measured {netns.describe_rate(shaped)}; "
          f"host loopback {netns.describe_rate(host)}")
    assert shaped == pytest.approx(RATE, rel=0.2)
    assert host > 5 * shaped
    assert host_lo_qdisc() == host_before
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert ours() == []


@needs_netns
def test_namespace_removed_after_exception():
    with pytest.raises(KeyError):
        with netns.shaped_namespace(RATE, PREFIX) as prefix:
            assert prefix[-1] in netns.list_namespaces()
            raise KeyError("boom")
    assert prefix[-1] not in netns.list_namespaces()


# The holder restores Python's SIGINT handler: a process started in the background by a
# non-interactive shell (as CI runs the suite) inherits SIGINT ignored, and shaped_namespace leaves
# an ignored signal ignored.
HOLDER = r"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, sys.argv[1])
import netns
with netns.shaped_namespace(40e6, sys.argv[2]) as prefix:
    print(prefix[-1], flush=True)
    time.sleep(60)
"""


@needs_netns
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_namespace_removed_when_holder_is_signalled(signum):
    """SIGTERM (default action) kills the holder by the signal; SIGINT raises KeyboardInterrupt in it,
    which Python ends by the signal too."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(ROOT / "bench"), PREFIX], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert name in netns.list_namespaces(), proc.stderr.read() if not name else name
        proc.send_signal(signum)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    stderr = proc.stderr.read()
    assert proc.returncode == -signum, stderr
    assert ("KeyboardInterrupt" in stderr) == (signum == signal.SIGINT), stderr
    assert name not in netns.list_namespaces()


@needs_netns
def test_stale_namespace_of_dead_process_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{PREFIX}-{dead.pid}-0"
    alive = f"{PREFIX}-{os.getpid()}-999"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", alive], check=True)
    try:
        with netns.shaped_namespace(RATE, PREFIX) as prefix:
            names = netns.list_namespaces()
            assert stale not in names and alive in names and prefix[-1] in names
    finally:
        subprocess.run(["ip", "netns", "delete", stale], stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "netns", "delete", alive], stderr=subprocess.DEVNULL)
    assert ours() == []


@pytest.mark.parametrize("text, bits", [("1gbit", 1e9), ("400mbit", 4e8), ("40mbit", 4e7), ("2.5gbit", 2.5e9),
                                        ("100kbit", 1e5), ("1500", 1500.0), ("40Mbit", 4e7), ("10mbps", 8e7),
                                        ("1kibit", 1024.0)])
def test_parse_rate(text, bits):
    assert netns.parse_rate(text) == bits


@pytest.mark.parametrize("bits", [1e9, 4e8, 4e7, 2.5e9, 1e5, 1500.0, 39.2e6, 123456789.0, 1.5, 3.6e12])
def test_format_rate_round_trips(bits):
    text = netns.format_rate(bits)
    assert netns.parse_rate(text) == bits, text


def test_format_rate_is_short():
    assert [netns.format_rate(b) for b in (4e7, 2.5e9, 1e5, 1500)] == ["40mbit", "2.5gbit", "100kbit", "1.5kbit"]


@pytest.mark.parametrize("text", ["", "fast", "40 mbitz", "-40mbit", "0mbit", "1.2.3mbit", "mbit"])
def test_parse_rate_rejects_naming_the_text(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        netns.parse_rate(text)


def test_link_check_says_missed_outside_tolerance():
    assert netns.link_check(40e6, 39.2e6) == "link: asked 40 Mbit/s, measured 39.2 Mbit/s (-2.0%, within ±20%)"
    assert netns.link_check(89628189.84613663, 90.5e6).startswith("link: asked 89.6 Mbit/s, measured 90.5 Mbit/s")
    assert netns.link_check(40e6, 20e6).endswith("MISSED")
    assert netns.link_check(40e6, 49e6, tolerance=0.2).endswith("MISSED")


def test_shaped_namespace_rejects_non_positive_rate():
    with pytest.raises(ValueError, match="must be positive"):
        with netns.shaped_namespace(0.0, PREFIX):
            pass
