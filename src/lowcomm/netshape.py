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

Example::

    cfg = TrainConfig(algo="co2", workers=2, backend="gloo").with_paths()
    with ShapedNetwork(2, 100e6) as net:
        summary = launch_shaped(cfg, net)
    print(summary["tokens_per_s"], summary["network"]["description"])
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
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
import signal
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from lowcomm.train.config import TrainConfig

__all__ = [
    "NETEM_UNAVAILABLE",
    "NetshapeError",
    "ShapedNetwork",
    "launch_shaped",
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
_STOP_GRACE_S = 5.0
_PEER_GRACE_S = 3.0
_TAIL_LINES = 40


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


# --- a training job on it --------------------------------------------------------------------


def launch_shaped(
    cfg: TrainConfig, net: ShapedNetwork, *, timeout_s: float = 900.0
) -> dict[str, Any]:
    """Run a ``lowcomm train`` job with one worker process in each namespace of ``net``.

    Workers are ``ip netns exec NS python -m lowcomm.netshape --worker CONFIG.json`` with the
    environment of :meth:`ShapedNetwork.worker_env` (``LOCAL_RANK`` 0 and ``LOCAL_WORLD_SIZE``
    the world size, so they split this machine's cores), gloo bound to their shaped veth. Their
    output is captured; rank 0's summary gets a ``network`` entry describing the real link, in
    the returned dict and in ``<out>/summary.json``.

    Args:
        cfg: the configuration, ``name`` and ``out`` resolved (:meth:`TrainConfig.with_paths`),
            ``workers`` equal to ``net.world_size`` and no emulated ``link``; backend gloo
            (``auto`` means gloo here).
        net: an entered :class:`ShapedNetwork`.
        timeout_s: stop the workers and fail after this many seconds.

    Returns:
        Rank 0's run summary.

    Raises:
        ValueError: ``cfg`` does not fit ``net``.
        lowcomm.train.config.ConfigError: the environment checks of ``lowcomm train`` failed.
        lowcomm.train.launcher.WorkerFailed: a worker failed (the first failure is reported) or
            the job did not finish within ``timeout_s``.
    """
    from lowcomm.train.launcher import check_environment, prepare_output

    if not net.active:
        raise ValueError(
            "launch_shaped needs an entered network: `with ShapedNetwork(...) as net:`"
        )
    if cfg.out is None or cfg.name is None:
        raise ValueError("cfg needs its paths resolved: pass cfg.with_paths()")
    if cfg.workers != net.world_size:
        raise ValueError(
            f"cfg.workers ({cfg.workers}) must equal the network's world size ({net.world_size})"
        )
    if cfg.link is not None:
        raise ValueError(
            f"cfg.link ({cfg.link!r}) must be unset: the real network is shaped, an emulated "
            "link would add its delays on top"
        )
    if cfg.backend == "nccl":
        raise ValueError("the shaped network carries gloo traffic; use backend gloo (or auto)")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    cfg = dataclasses.replace(cfg, backend="gloo")
    check_environment(cfg)
    prepare_output(cfg)
    with tempfile.TemporaryDirectory(prefix="lowcomm-shaped-") as scratch:
        config_path = os.path.join(scratch, "config.json")
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(cfg.to_dict(), f)
        _run_workers(cfg, net, config_path, scratch, timeout_s)
    from lowcomm.train.metrics import write_json

    assert cfg.out is not None
    summary_path = os.path.join(cfg.out, "summary.json")
    try:
        with open(summary_path, encoding="utf-8") as f:
            summary: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"the workers finished but {summary_path} cannot be read: {e}") from e
    summary["network"] = {
        "shaping": "real",
        "description": net.describe(),
        "bandwidth_bps": net.bandwidth_bps,
        "latency_s": net.latency_s,
        "latency_applied": net.latency_applied,
    }
    write_json(summary_path, summary)
    return summary


def _run_workers(
    cfg: TrainConfig, net: ShapedNetwork, config_path: str, scratch: str, timeout_s: float
) -> None:
    """Start one worker per namespace, wait for all; raise ``WorkerFailed`` on a failure."""
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[str] = []
    try:
        for rank in range(net.world_size):
            env = {
                **os.environ,
                **net.worker_env(rank),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": str(net.world_size),
            }
            worker = ["-m", "lowcomm.netshape", "--worker", config_path, "--failure-dir", scratch]
            cmd = [*net.exec_prefix(rank), sys.executable, *worker]
            log_path = os.path.join(scratch, f"worker-rank{rank}.log")
            logs.append(log_path)
            with open(log_path, "wb") as log:
                # A session of its own: the worker and anything it starts are stopped together.
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        outcome, failed_rank = _wait(procs, time.monotonic() + timeout_s)
    finally:
        _stop(procs)
    if outcome == "ok":
        return
    _raise_failure(cfg, procs, logs, scratch, failed_rank=failed_rank, timeout_s=timeout_s)


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float) -> tuple[str, int | None]:
    """``("ok", None)`` when all exited 0; ``("failed", rank)`` once a worker exits otherwise
    (after a short grace for the others to record their own errors); ``("timeout", None)`` at
    ``deadline``."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return "ok", None
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            grace = min(deadline, time.monotonic() + _PEER_GRACE_S)
            while time.monotonic() < grace and any(p.poll() is None for p in procs):
                time.sleep(0.05)
            return "failed", failed[0]
        if time.monotonic() >= deadline:
            return "timeout", None
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the workers still running (SIGTERM to each one's process group, then SIGKILL)."""
    running = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        running = [p for p in running if p.poll() is None]
        if not running:
            return
    for p in running:  # pragma: no cover - SIGKILL does not fail
        logger.error("netshape: worker process %d did not stop", p.pid)


def _tail(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_TAIL_LINES:])


def _raise_failure(
    cfg: TrainConfig,
    procs: list[subprocess.Popen[bytes]],
    logs: list[str],
    scratch: str,
    *,
    failed_rank: int | None,
    timeout_s: float,
) -> None:
    """Raise ``WorkerFailed`` for the root cause (:func:`~lowcomm.train.failures.root_cause`
    of the workers' records, ``failed_rank`` the first worker seen to exit with an error); a
    worker without a record is described by its exit and its output's last line, and a job
    that timed out (``failed_rank`` ``None``) without any record by the first worker that was
    still running."""
    from lowcomm.train.failures import read_failures, root_cause, save_traceback
    from lowcomm.train.launcher import WorkerFailed

    cause = root_cause(read_failures(scratch), [] if failed_rank is None else [failed_rank])
    record = cause[1] if cause is not None else None
    if record is not None:
        rank = int(record["rank"])
        path = save_traceback(record.get("traceback"), cfg.out, rank)
        raise WorkerFailed(rank, str(record["error"]), path)
    timed_out = failed_rank is None
    if failed_rank is None:
        # Stopped by _stop: the first worker that had not finished.
        stopped = [
            r for r, p in enumerate(procs) if p.returncode in (-signal.SIGTERM, -signal.SIGKILL)
        ]
        rank = stopped[0] if stopped else 0
        error = f"did not finish within {timeout_s:g} s and was stopped"
    else:
        rank = failed_rank
        code = procs[rank].returncode
        assert code is not None
        if code < 0:
            error = f"killed by signal {-code} ({signal.Signals(-code).name})"
        else:
            error = f"exited with code {code}"
    tail = _tail(logs[rank])
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    if last and not timed_out:
        error = f"{error}: {last}"
    path = save_traceback(tail, cfg.out, rank)
    raise WorkerFailed(rank, error, path)


# --- worker entry point ----------------------------------------------------------------------


def _worker_main(argv: list[str] | None = None) -> int:
    """``python -m lowcomm.netshape --worker CONFIG.json [--failure-dir DIR]``: one worker of
    :func:`launch_shaped`, set up from the environment it is given."""
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.worker import run_worker

    parser = argparse.ArgumentParser(prog="python -m lowcomm.netshape")
    parser.add_argument("--worker", required=True, metavar="CONFIG_JSON")
    parser.add_argument("--failure-dir", default=None)
    args = parser.parse_args(argv)
    with open(args.worker, encoding="utf-8") as f:
        cfg = config_from_dict(json.load(f), source=args.worker)
    run_worker(cfg, False, args.failure_dir)
    return 0


if __name__ == "__main__":
    code = _worker_main()
    # The run is over and its files are written. Skip the interpreter's finalization: objects
    # of gloo's C++ threads released there can abort (SIGABRT) a worker whose run succeeded.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
