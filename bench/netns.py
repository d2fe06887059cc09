# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0
"""An emulated network link for the benchmark: a Linux network namespace whose loopback is
shaped to a given rate with a token-bucket filter (``tc qdisc ... tbf``).

Ranks launched through the command prefix ``shaped_namespace`` yields run inside the namespace;
gloo connects them over TCP on 127.0.0.1 there, so every collective crosses the shaped loopback.

Semantics of RATE (bits/s): all ranks share the one shaped loopback egress queue, so RATE is the
aggregate of all ranks' sends, not a per-rank link. Each payload byte crosses it once (a packet
sent on ``lo`` is received on ``lo`` without a second egress); TCP acknowledgements cross it too
but are small. To emulate W ranks each with a link of L bits/s, shape to ``W * L``.

Shaping parameters: loopback's MTU is 65536 and TCP hands it GSO packets up to 64 KiB, so the
bucket (``burst``) is at least two such packets (a smaller bucket would make tbf drop or segment
every large packet); above that it holds 10 ms at RATE. The queue (``limit``) holds 100 ms at
RATE plus the bucket. The host's loopback and every interface outside the namespace are never
touched: every ``tc``/``ip link`` command runs through ``ip netns exec NAME``.

Requires root, ``ip`` and ``tc`` (iproute2) and a kernel with network namespaces and the tbf
qdisc; ``unavailable_reason()`` says what is missing. A namespace is named
``PREFIX-PID-N`` (PID of the creating process); entering ``shaped_namespace`` deletes namespaces
with the prefix whose PID is dead (left behind by a SIGKILLed run).

CLI for manual checks::

    python bench/netns.py --rate 40mbit -- python -c "print('inside')"
    python bench/netns.py --rate 40mbit --measure 4000000
"""

import argparse
import contextlib
import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import Iterator, List, Optional, Sequence

DEFAULT_PREFIX = "zero3muon-bench"

# tc's rate units (tc(8), "RATES"): multiplier to bits/s.
_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "kibit": 2.0**10,
    "mibit": 2.0**20,
    "gibit": 2.0**30,
    "tibit": 2.0**40,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
}
_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

GSO_MAX_BYTES = 65536  # loopback MTU and the largest GSO packet TCP hands it
BUCKET_SECONDS = 0.010
QUEUE_SECONDS = 0.100

_counter = itertools.count()
_lock = threading.Lock()


def parse_rate(text) -> float:
    """A tc-style rate (``"1gbit"``, ``"400mbit"``, ``"2.5gbit"``, ``"100kbit"``, ``"10mbps"`` =
    10 MB/s; a plain number is bit/s; units are case-insensitive, decimal k/m/g/t, binary
    ki/mi/gi/ti) as bits/s (float). Raises ValueError naming the text if it is not a positive
    rate."""
    match = _RATE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or (unit and unit not in _UNITS):
        raise ValueError(f"bad rate {text!r}: expected a number with an optional tc unit "
                         f"({', '.join(_UNITS)}), e.g. '40mbit'")
    bits = float(match.group(1)) * _UNITS[unit or "bit"]
    if not bits > 0:
        raise ValueError(f"bad rate {text!r}: must be positive")
    return bits


def format_rate(bits: float) -> str:
    """bits/s as the tc-style string ``parse_rate`` reads back to the same value, in the largest
    decimal unit that keeps it short: 4e7 -> ``"40mbit"``, 2.5e9 -> ``"2.5gbit"``. Raises
    ValueError if ``bits`` is not positive."""
    if not bits > 0:
        raise ValueError(f"bad rate {bits!r}: must be positive")
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        value = bits / _UNITS[unit]
        if value >= 1:
            text = f"{value:.6g}{unit}"
            if "e" not in text and parse_rate(text) == bits:
                return text
    return f"{bits:.17g}bit" if bits != int(bits) else f"{int(bits)}bit"


def describe_rate(bits: float) -> str:
    """bits/s for people, 3 significant digits: 3.92e7 -> ``"39.2 Mbit/s"``, 3.6e12 -> ``"3600 Gbit/s"``."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3), ("bit/s", 1)):
        if bits >= scale or scale == 1:
            value = bits / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"


def link_check(asked_bits: float, measured_bits: float, tolerance: float = 0.2) -> str:
    """The benchmark's one-line check of the emulated link, e.g. ``"link: asked 40 Mbit/s, measured
    39.2 Mbit/s (-2.0%, within ±20%)"``; ends in ``MISSED`` when off by more than ``tolerance``
    (a fraction)."""
    off = measured_bits / asked_bits - 1
    line = f"link: asked {describe_rate(asked_bits)}, measured {describe_rate(measured_bits)} ({off:+.1%}, "
    return line + (f"within ±{tolerance:.0%})" if abs(off) <= tolerance else f"outside ±{tolerance:.0%}) MISSED")


def tbf_parameters(rate_bits: float) -> dict:
    """tbf's ``burst`` and ``limit`` in bytes for ``rate_bits``: burst = max(2 GSO packets, 10 ms
    at the rate); limit = burst + 100 ms at the rate."""
    rate_bytes = rate_bits / 8
    burst = max(2 * GSO_MAX_BYTES, int(rate_bytes * BUCKET_SECONDS))
    return dict(burst=burst, limit=burst + max(GSO_MAX_BYTES, int(rate_bytes * QUEUE_SECONDS)))


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)


def _check(cmd: Sequence[str]) -> str:
    proc = _run(cmd)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stdout.strip()}")
    return proc.stdout


def exec_prefix(name: str) -> List[str]:
    """The command prefix that runs a command inside namespace ``name``."""
    return ["ip", "netns", "exec", name]


def list_namespaces() -> List[str]:
    """Names of the existing network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _check(["ip", "netns", "list"]).splitlines() if line.strip()]


def _create(name: str, rate_bits: float) -> None:
    _check(["ip", "netns", "add", name])
    try:
        inside = exec_prefix(name)
        _check(inside + ["ip", "link", "set", "dev", "lo", "up"])
        p = tbf_parameters(rate_bits)
        _check(inside + [
            "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(round(rate_bits))}bit", "burst",
            str(p["burst"]), "limit",
            str(p["limit"])
        ])
    except BaseException:
        _delete(name)
        raise


def _delete(name: str) -> None:
    _run(["ip", "netns", "delete", name])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(name_prefix: str = DEFAULT_PREFIX) -> List[str]:
    """Delete the namespaces ``NAME_PREFIX-PID-N`` whose creating PID is dead; returns their
    names. (A reused PID keeps its stale namespace until that process is gone too.)"""
    pattern = re.compile(re.escape(name_prefix) + r"-(\d+)-\d+$")
    removed = []
    for name in list_namespaces():
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _delete(name)
            removed.append(name)
    return removed


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """None if this process can create a namespace and shape its loopback with tbf (tried in a
    throwaway namespace, once per process), else a one-line reason."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run as root to emulate the link)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found on PATH"
    name = f"{DEFAULT_PREFIX}-probe-{os.getpid()}"
    try:
        _create(name, 40e6)
        shown = _check(exec_prefix(name) + ["tc", "qdisc", "show", "dev", "lo"])
        if "tbf" not in shown:
            return f"tbf qdisc not in effect after adding it: {shown.strip()}"
    except (RuntimeError, OSError) as err:
        return f"cannot create a shaped namespace: {str(err).splitlines()[0]}"
    finally:
        _delete(name)
    return None


@contextlib.contextmanager
def shaped_namespace(rate_bits: float, name_prefix: str = DEFAULT_PREFIX) -> Iterator[List[str]]:
    """A fresh network namespace whose loopback (up, 127.0.0.1) is shaped to ``rate_bits`` bits/s
    (aggregate of every sender inside, see the module docstring).

    Yields the command prefix (``["ip", "netns", "exec", NAME]``) for subprocess commands to run
    inside. The namespace is deleted on exit, on an exception, and on SIGINT/SIGTERM: while the
    context is open (and this is the main thread), a handler deletes the namespace, then restores
    the previous handler and delivers the signal to it (default SIGTERM: the process dies of it;
    default SIGINT: KeyboardInterrupt). Handlers are restored on exit. Processes still running
    inside keep their (now nameless) namespace until they end.

    Raises ValueError for a non-positive rate, RuntimeError if ``ip``/``tc`` fail (see
    ``unavailable_reason()``).
    """
    if not rate_bits > 0:
        raise ValueError(f"bad rate {rate_bits!r}: must be positive")
    remove_stale(name_prefix)
    with _lock:
        name = f"{name_prefix}-{os.getpid()}-{next(_counter)}"
    removed = threading.Event()

    def remove():
        if not removed.is_set():
            removed.set()
            _delete(name)

    previous = {}

    def on_signal(signum, frame):
        remove()
        handler = previous.pop(signum)
        signal.signal(signum, handler)
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), signum)

    _create(name, rate_bits)
    try:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                handler = signal.getsignal(signum)
                if handler not in (signal.SIG_IGN, None):
                    previous[signum] = signal.signal(signum, on_signal)
        yield exec_prefix(name)
    finally:
        for signum, handler in list(previous.items()):
            signal.signal(signum, handler)
        remove()


# Receiver and sender in one process, over TCP on 127.0.0.1 in whatever namespace it runs in.
# Prints {"bytes": n, "seconds": t}: t from the receiver's accept to its last byte.
_PROBE = r"""
import json, socket, sys, threading, time
n = int(sys.argv[1])
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
out = {}
def receive():
    conn, _ = srv.accept()
    start = time.perf_counter()
    got = 0
    while got < n:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    out.update(bytes=got, seconds=time.perf_counter() - start)
    conn.close()
t = threading.Thread(target=receive)
t.start()
s = socket.create_connection(srv.getsockname())
block = b"\0" * (1 << 20)
left = n
while left > 0:
    s.sendall(block[:min(left, len(block))])
    left -= min(left, len(block))
t.join()
s.close()
print(json.dumps(out))
"""


def measure_throughput(prefix: Sequence[str], nbytes: int, timeout: float = 120.0) -> float:
    """Achieved TCP throughput in bits/s over 127.0.0.1 where ``prefix`` runs commands (``[]``:
    the host): a stdlib-socket sender and receiver in one Python process send ``nbytes`` bytes;
    the time runs from the receiver's accept to its last byte. tbf's bucket lets the first
    ``burst`` bytes through at once, so use ``nbytes`` of at least ~0.5 s at the rate. Raises
    RuntimeError if the probe fails or receives fewer bytes."""
    cmd = list(prefix) + [sys.executable, "-c", _PROBE, str(int(nbytes))]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"throughput probe failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["bytes"] != nbytes:
        raise RuntimeError(f"throughput probe received {result['bytes']} of {nbytes} bytes")
    return 8 * result["bytes"] / result["seconds"]


def _rate_argument(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run a command inside a network namespace whose loopback is "
                                     "shaped to RATE (aggregate of all senders inside). Needs root and the "
                                     "`ip` and `tc` commands (iproute2); the namespace is removed afterwards.")
    parser.add_argument("--rate", type=_rate_argument, required=True, help="tc-style rate, e.g. 40mbit, 2.5gbit")
    parser.add_argument("--measure", type=int, metavar="BYTES", default=None,
                        help="first measure TCP throughput inside with BYTES bytes and print it")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS... to run inside")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.measure is None and not command:
        parser.error("give --measure BYTES and/or -- CMD...")
    reason = unavailable_reason()
    if reason is not None:
        print(f"netns: unavailable: {reason}", file=sys.stderr)
        return 2
    with shaped_namespace(args.rate, args.prefix) as prefix:
        if args.measure is not None:
            measured = measure_throughput(prefix, args.measure)
            print(link_check(args.rate, measured), flush=True)
        if command:
            return subprocess.call(prefix + command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
