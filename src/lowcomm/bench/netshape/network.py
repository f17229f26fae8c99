"""Real link shaping on Linux, to check the emulated link against a real shaped network.

:class:`~lowcomm.link.EmulatedLink` models a slow link; this module builds one. Each worker gets
its own network namespace, joined to the others by a Linux bridge in a switch namespace::

    worker ns 0                         switch ns                          worker ns 1
    [veth w0] --tbf (upload)-->   [veth b0]--bridge--[veth b1]   <--tbf (upload)-- [veth w1]
              <--tbf (download)--                               --tbf (download)-->

Every worker-side veth is shaped by ``tc``'s token bucket filter (``tbf``) on its egress (the
worker's upload) and every bridge-side veth on its egress towards the worker (its download), so
each worker has ``bandwidth_bps`` each way, as the emulator's link has.

Token bucket parameters (:func:`tbf_parameters`):

* ``burst`` = max(1 ms of traffic at the rate, 16 KiB). tbf holds packets back with a
  high-resolution timer, so the bucket need not cover a whole jiffy (the old "rate / HZ" rule);
  16 KiB is ten 1500-byte frames. A larger bucket lets that much through at once after an idle
  spell, which makes each transfer look faster than the rate by burst / rate (here at most about
  1 ms, or 16 KiB / rate on slow links). Packets larger than the bucket (veth's 64 KiB GSO
  frames) are segmented by tbf, not dropped.
* ``limit`` (the queue, in bytes) = max(100 ms of traffic at the rate, 256 KiB). The emulator
  never drops; a queue that overflowed would make throughput depend on TCP's loss recovery
  rather than on the link. A sender in a worker namespace keeps its own queue short (TCP small
  queues), and the download side only ever receives what another worker's shaped upload lets
  through, so the queue stays far from full; its depth bounds the queueing delay a burst can
  add.

Latency: :class:`~lowcomm.link.LinkModel` takes ``latency_s`` as the one-way latency of the
link. A packet from one worker to another crosses two shaped veths (the sender's upload and the
receiver's download), so each gets ``netem delay latency_s / 2``: worker to worker is
``latency_s`` one way and ``2 * latency_s`` round trip. (The emulator charges the latency once
per collective; a real ring all-reduce pays it at each of its ``2 (N - 1)`` steps, one of the
differences this comparison shows.) ``netem`` is not built into every kernel; where it is
missing the links are shaped to the bandwidth only, :attr:`ShapedNetwork.latency_applied` is
``False`` and :meth:`ShapedNetwork.describe` says so (:data:`NETEM_UNAVAILABLE`).

Requirements: Linux, root (namespaces and qdiscs need ``CAP_NET_ADMIN``), iproute2 (``ip``,
``tc``), the ``tbf`` qdisc, veth and bridge support; ``netem`` optional.
:func:`unavailable_reason` says in one line what is missing and how to fix it.

Addresses and cleanup: the addresses are on a private ``10.x.y.0/24`` subnet that overlaps no
route of the host nor a live network of another ``ShapedNetwork``, and they exist only inside
the namespaces the network creates, so nothing is visible from, or routed to, the host. Leaving
the ``with`` block (normally, on an exception or on Ctrl-C) deletes every namespace it created,
which removes their interfaces and qdiscs, and checks that none is left; an ``atexit`` hook does
the same if the block is never left. Names carry a random token, so concurrent networks do not
collide.

Example (a training job on the network: :func:`lowcomm.bench.netshape.launch_shaped`)::

    with ShapedNetwork(2, 100e6, latency_s=0.01) as net:
        ping = [*net.exec_prefix(0), "ping", "-c", "3", net.addresses[1]]
        subprocess.run(ping, check=True)  # about 20 ms round trip where netem is available
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import ipaddress
import json
import logging
import math
import os
import random
import secrets
import shlex
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

__all__ = [
    "NETEM_UNAVAILABLE",
    "NetshapeError",
    "ShapedNetwork",
    "netem_available",
    "tbf_parameters",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

NETEM_UNAVAILABLE = (
    "the netem qdisc is not available on this kernel (CONFIG_NET_SCH_NETEM / sch_netem), so the "
    "real links are shaped to the bandwidth only, with no added latency (their round trip is "
    "that of veth and a bridge, tens of microseconds)"
)
"""Why a :class:`ShapedNetwork` asked for latency has none (``latency_applied`` is ``False``)."""

_NS_PREFIX = "lowcomm-"
_COMMAND_TIMEOUT_S = 20.0
_MAX_WORKERS = 250  # hosts .1 to .250 of a /24
_BURST_MIN_BYTES = 16 * 1024
_BURST_TIME_S = 1e-3
_QUEUE_MIN_BYTES = 256 * 1024
_QUEUE_TIME_S = 0.1
_DEFAULT_PORT = 29500


class NetshapeError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message holds the command and its error, one line."""


# --- commands --------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _run(cmd: list[str], *, timeout: float = _COMMAND_TIMEOUT_S) -> str:
    """Run ``cmd``; its stdout, or :class:`NetshapeError` naming the command and its stderr."""
    logger.debug("netshape: %s", shlex.join(cmd))
    try:
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise NetshapeError(f"`{cmd[0]}` not found: install iproute2") from None
    except subprocess.CalledProcessError as e:
        detail = _one_line(e.stderr or e.stdout or "") or "no output"
        raise NetshapeError(f"`{shlex.join(cmd)}` failed (exit {e.returncode}): {detail}") from None
    except subprocess.TimeoutExpired:
        raise NetshapeError(f"`{shlex.join(cmd)}` did not finish within {timeout:g} s") from None
    return proc.stdout


def _ip(ns: str, *args: str) -> str:
    """``ip -n NS ARGS...``"""
    return _run(["ip", "-n", ns, *args])


def _tc(ns: str, *args: str) -> str:
    """``tc -n NS ARGS...``"""
    return _run(["tc", "-n", ns, *args])


def _list_namespaces() -> list[str]:
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _delete_namespaces(names: list[str]) -> list[str]:
    """Delete the namespaces ``names``; those still listed afterwards (empty when all went)."""
    for _ in range(2):  # a second pass for one that was busy the first time
        live = set(_list_namespaces())
        left = [n for n in names if n in live]
        if not left:
            return []
        for name in left:
            try:
                _run(["ip", "netns", "delete", name])
            except NetshapeError as e:
                logger.warning("netshape: %s", e)
    live = set(_list_namespaces())
    return [n for n in names if n in live]


# --- availability ----------------------------------------------------------------------------

_FALLBACK = "or use the emulated link (--link)"


@dataclasses.dataclass(frozen=True)
class _Probe:
    reason: str | None
    netem: bool


@functools.lru_cache(maxsize=1)
def _probe() -> _Probe:
    """Try every kind of object a :class:`ShapedNetwork` creates, in a throwaway namespace."""
    if not sys.platform.startswith("linux"):
        return _Probe(
            f"real link shaping needs Linux network namespaces, not {sys.platform}; "
            f"use the emulated link (--link)",
            False,
        )
    if os.geteuid() != 0:
        return _Probe(
            "real link shaping creates network namespaces and qdiscs, which needs root; "
            f"run as root {_FALLBACK}",
            False,
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return _Probe(
            f"real link shaping needs {' and '.join(f'`{t}`' for t in missing)}, not found; "
            f"install iproute2 {_FALLBACK}",
            False,
        )
    token = secrets.token_hex(3)
    ns = f"{_NS_PREFIX}probe-{token}"
    veth_a, veth_b = f"lcp{token}a", f"lcp{token}b"
    # (what is tried, how to get it, the attempt)
    steps: list[tuple[str, str, Callable[[], object]]] = [
        (
            "create a network namespace",
            "use a kernel with network namespaces (CONFIG_NET_NS) and CAP_SYS_ADMIN",
            lambda: _run(["ip", "netns", "add", ns]),
        ),
        (
            "create a veth pair",
            "enable veth (CONFIG_VETH)",
            lambda: _ip(ns, "link", "add", veth_a, "type", "veth", "peer", "name", veth_b),
        ),
        (
            "create a Linux bridge",
            "enable bridges (CONFIG_BRIDGE)",
            lambda: _ip(ns, "link", "add", f"lcp{token}br", "type", "bridge"),
        ),
        (
            "add a tbf qdisc",
            "enable tbf (CONFIG_NET_SCH_TBF, module sch_tbf)",
            lambda: _tc(ns, "qdisc", "add", "dev", veth_a, "root", *_tbf_args(100e6)),
        ),
    ]
    try:
        for what, fix, step in steps:
            try:
                step()
            except NetshapeError as e:
                return _Probe(
                    f"real link shaping cannot {what} here ({e}); {fix} {_FALLBACK}", False
                )
        try:
            _tc(ns, "qdisc", "add", "dev", veth_b, "root", "netem", "delay", "1ms")
            netem = True
        except NetshapeError as e:
            logger.debug("netshape: netem unavailable: %s", e)
            netem = False
        return _Probe(None, netem)
    finally:
        try:
            left = _delete_namespaces([ns])
        except NetshapeError as e:
            left = [f"{ns} ({e})"]
        if left:
            logger.warning("netshape: could not delete the probe namespace %s", left[0])


def unavailable_reason() -> str | None:
    """``None`` when real link shaping can run here, else one line saying why not and the fix.

    Checks Linux, root and iproute2, then creates a throwaway namespace with a veth pair, a
    bridge and a ``tbf`` qdisc and deletes it again. The result is cached for the process.
    """
    return _probe().reason


def netem_available() -> bool:
    """Whether the ``netem`` qdisc can add latency here (probed once per process; ``False``
    wherever :func:`unavailable_reason` is not ``None``). See :data:`NETEM_UNAVAILABLE`."""
    return _probe().netem


def tbf_parameters(bandwidth_bps: float) -> tuple[int, int]:
    """``(burst, limit)`` in bytes of the ``tbf`` qdiscs for a link of ``bandwidth_bps`` bits/s.

    ``burst`` = max(1 ms at the rate, 16 KiB); ``limit`` = max(100 ms at the rate, 256 KiB).
    The module docstring explains the choice.
    """
    rate = bandwidth_bps / 8.0
    burst = max(math.ceil(rate * _BURST_TIME_S), _BURST_MIN_BYTES)
    limit = max(math.ceil(rate * _QUEUE_TIME_S), _QUEUE_MIN_BYTES, 2 * burst)
    return burst, limit


def _tbf_args(bandwidth_bps: float) -> list[str]:
    burst, limit = tbf_parameters(bandwidth_bps)
    rate = f"{round(bandwidth_bps)}bit"
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]


def _fmt_rate(bps: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


# --- the network -----------------------------------------------------------------------------


def _taken_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks in use: the host's routes (all tables, but default routes) and the
    addresses of live lowcomm namespaces."""
    taken: list[ipaddress.IPv4Network] = []

    def add(text: str | None) -> None:
        if not text or text == "default":
            return
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            return
        if isinstance(net, ipaddress.IPv4Network) and net.prefixlen > 0:
            taken.append(net)

    for route in json.loads(_run(["ip", "-4", "-j", "route", "show", "table", "all"]) or "[]"):
        add(route.get("dst"))
    for ns in _list_namespaces():
        if not ns.startswith(_NS_PREFIX):
            continue
        try:
            links = json.loads(_run(["ip", "-n", ns, "-4", "-j", "addr", "show"]) or "[]")
        except NetshapeError:  # deleted meanwhile
            continue
        for link in links:
            for addr in link.get("addr_info", []):
                add(f"{addr.get('local')}/{addr.get('prefixlen', 32)}")
    return taken


def _pick_subnet(token: str) -> ipaddress.IPv4Network:
    """A ``10.x.y.0/24`` (x in 200..254) that overlaps no network in use, drawn from ``token``."""
    taken = _taken_networks()
    rng = random.Random(token)
    for _ in range(512):
        candidate = ipaddress.IPv4Network(f"10.{rng.randint(200, 254)}.{rng.randint(0, 255)}.0/24")
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
    raise NetshapeError(
        "no free 10.x.y.0/24 subnet (x in 200..254) found for the shaped network; "
        "the host's routes cover them all"
    )


class ShapedNetwork:
    """A real network of ``world_size`` workers, each link shaped to ``bandwidth_bps`` each way.

    A context manager: entering builds the namespaces, bridge, veths, addresses and qdiscs;
    leaving (also on an exception or Ctrl-C) deletes all of it. See the module docstring.

    Args:
        world_size: workers, one network namespace each (1 to 250).
        bandwidth_bps: each worker's bandwidth in bits per second, per direction (> 0).
        latency_s: one-way latency between two workers in seconds (≥ 0), as in
            :class:`~lowcomm.link.LinkModel`; applied only where ``netem`` is available.
        port: ``MASTER_PORT`` in :meth:`worker_env`; the namespaces are fresh, so any port is
            free in them.

    Attributes:
        namespaces: the worker namespace of each rank.
        switch_namespace: the namespace holding the bridge.
        addresses: the IPv4 address of each rank.
        interfaces: the worker-side veth of each rank (its ``GLOO_SOCKET_IFNAME``).
        subnet: the private ``10.x.y.0/24`` the addresses are on.
        latency_applied: whether ``latency_s`` > 0 was added with ``netem``.
    """

    def __init__(
        self,
        world_size: int,
        bandwidth_bps: float,
        latency_s: float = 0.0,
        *,
        port: int = _DEFAULT_PORT,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise ValueError(f"world_size must be an integer, got {world_size!r}")
        if not 1 <= world_size <= _MAX_WORKERS:
            raise ValueError(f"world_size must be between 1 and {_MAX_WORKERS}, got {world_size}")
        if not (math.isfinite(bandwidth_bps) and bandwidth_bps >= 8e3):
            raise ValueError(
                f"bandwidth must be a finite number >= 8000 bits/s, got {bandwidth_bps!r}"
            )
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency must be a finite number >= 0 s, got {latency_s!r}")
        if not 1 <= port <= 65535:
            raise ValueError(f"port must be between 1 and 65535, got {port}")
        self.world_size = world_size
        self.bandwidth_bps = float(bandwidth_bps)
        self.latency_s = float(latency_s)
        self.port = port
        self.namespaces: list[str] = []
        self.switch_namespace: str | None = None
        self.addresses: list[str] = []
        self.interfaces: list[str] = []
        self.subnet: ipaddress.IPv4Network | None = None
        self.latency_applied = False
        self._created: list[str] = []
        self._active = False

    @property
    def active(self) -> bool:
        """Whether the network exists (inside the ``with`` block)."""
        return self._active

    # --- context manager -------------------------------------------------------------------

    def __enter__(self) -> ShapedNetwork:
        if self._active or self._created:
            raise RuntimeError("this ShapedNetwork is already in use; create another one")
        reason = unavailable_reason()
        if reason is not None:
            raise NetshapeError(reason)
        atexit.register(self._atexit_teardown)
        try:
            self._build()
        except BaseException:
            self._teardown(raise_on_leftover=False)
            raise
        self._active = True
        logger.info(
            "netshape: %d worker namespaces on %s: %s",
            self.world_size,
            self.subnet,
            self.describe(),
        )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # With an exception already on its way, a cleanup failure is logged, not raised over it.
        self._teardown(raise_on_leftover=exc_type is None)

    def _build(self) -> None:
        token = secrets.token_hex(3)  # 6 hex digits: interface names stay <= 15 characters
        self.namespaces, self.addresses, self.interfaces = [], [], []
        self.subnet = _pick_subnet(token)
        hosts = self.subnet.hosts()
        self.switch_namespace = sw = f"{_NS_PREFIX}{token}-sw"
        bridge = f"lc{token}br"
        self._add_namespace(sw)
        _ip(sw, "link", "add", bridge, "type", "bridge", "stp_state", "0")
        _ip(sw, "link", "set", bridge, "up")
        use_netem = self.latency_s > 0 and netem_available()
        if self.latency_s > 0 and not use_netem:
            logger.warning(
                "netshape: latency %g s not applied: %s", self.latency_s, NETEM_UNAVAILABLE
            )
        for rank in range(self.world_size):
            ns = f"{_NS_PREFIX}{token}-w{rank}"
            worker_if, bridge_if = f"lc{token}w{rank}", f"lc{token}b{rank}"
            address = str(next(hosts))
            self._add_namespace(ns)
            peer = ("peer", "name", worker_if, "netns", ns)
            _ip(sw, "link", "add", bridge_if, "type", "veth", *peer)
            _ip(sw, "link", "set", bridge_if, "master", bridge)
            _ip(sw, "link", "set", bridge_if, "up")
            _ip(ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", worker_if)
            _ip(ns, "link", "set", worker_if, "up")
            self._shape(ns, worker_if, use_netem)  # upload
            self._shape(sw, bridge_if, use_netem)  # download
            self.namespaces.append(ns)
            self.interfaces.append(worker_if)
            self.addresses.append(address)
        self.latency_applied = use_netem

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _ip(name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str, use_netem: bool) -> None:
        """Shape the egress of ``dev`` in ``ns``: tbf, under netem's delay when ``use_netem``."""
        tbf = _tbf_args(self.bandwidth_bps)
        if not use_netem:
            _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
            return
        # netem delays each packet, then its child tbf paces what has served its delay. netem's
        # own limit (in packets, small ones counted) must hold everything in flight during the
        # delay plus tbf's queue, or it would drop what the emulator never does.
        _, limit = tbf_parameters(self.bandwidth_bps)
        delay_s = self.latency_s / 2
        packets = math.ceil((self.bandwidth_bps / 8 * delay_s + limit) / 512)
        netem = ["netem", "delay", f"{max(1, round(delay_s * 1e6))}us", "limit", str(packets)]
        _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem)
        _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)

    def _teardown(self, *, raise_on_leftover: bool) -> None:
        self._active = False
        atexit.unregister(self._atexit_teardown)
        if not self._created:
            return
        try:
            left = _delete_namespaces(list(reversed(self._created)))
        except NetshapeError as e:
            left, error = list(self._created), str(e)
        else:
            error = ""
        if not left:
            logger.debug("netshape: deleted namespaces %s", ", ".join(self._created))
            self._created = []
            return
        message = (
            f"could not delete network namespaces {', '.join(left)}"
            + (f" ({error})" if error else "")
            + "; delete them with `ip netns delete NAME`"
        )
        self._created = left
        if raise_on_leftover:
            raise NetshapeError(message)
        logger.error("netshape: %s", message)

    def _atexit_teardown(self) -> None:
        self._teardown(raise_on_leftover=False)

    # --- using it --------------------------------------------------------------------------

    def describe(self) -> str:
        """One line for reports, e.g. ``real tc tbf 100 Mbit/s per direction, no added
        latency``."""
        text = f"real tc tbf {_fmt_rate(self.bandwidth_bps)} per direction"
        if self.latency_s <= 0:
            return f"{text}, no added latency"
        # Before entering: what entering will build.
        if self.latency_applied or (not self._active and netem_available()):
            return f"{text}, netem {self.latency_s * 1e3:g} ms one-way latency"
        return f"{text}, no added latency (netem unavailable)"

    def _check_rank(self, rank: int) -> None:
        if not self._active:
            raise RuntimeError("the network exists only inside `with ShapedNetwork(...) as net:`")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")

    def exec_prefix(self, rank: int) -> list[str]:
        """The command prefix that runs a command in ``rank``'s namespace."""
        self._check_rank(rank)
        return ["ip", "netns", "exec", self.namespaces[rank]]

    def worker_env(self, rank: int) -> dict[str, str]:
        """The ``torch.distributed`` environment of ``rank``: ``RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR`` (rank 0's address), ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` (its veth,
        so gloo uses the shaped link)."""
        self._check_rank(rank)
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.addresses[0],
            "MASTER_PORT": str(self.port),
            "GLOO_SOCKET_IFNAME": self.interfaces[rank],
        }

    def __repr__(self) -> str:
        state = f"on {self.subnet}" if self._active else "not entered"
        return f"ShapedNetwork({self.world_size} workers, {self.describe()}, {state})"
