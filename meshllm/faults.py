"""Faults injected into an emulated mesh while its workload runs (`--cluster ... --kill NODE@S
--restart NODE@S --pause NODE@S1-S2 --partition ZA:ZB@S1-S2`): a node's whole process group
killed with SIGKILL, killed so and started again at once from its node file (a crash that a
supervisor restarts before the failure timeout: its peers see a new incarnation at the same
address, not a death), stopped with SIGSTOP for a while and continued (a node that does not run:
a swap storm, a paused VM; its peers see it die and come back as the same incarnation), or two
zones cut apart for a while (a FAULT control message to every live node at once: each drops the
other zone's traffic until it ends; a node this injector has stopped cannot take it and is told
the rest of the partition when continued, if before its end). Times count from the workload's
first request; every fault is checked against the cluster file before anything starts (exit 2),
and `FaultInjector.done` lists what ran, for the report, with the times it ran (measured: a
pause's until_s is when its SIGCONT went, the workload's end if that came first), and
`FaultInjector.not_run` the faults the workload ended before (with a warning). After a pause or a
partition the injector watches the mesh heal: from the last one's end it polls the gateway's
live plan until every node the plan used before the faults (and still alive) is in use again, or
a node of its kind in its place, at most HEAL_TIMEOUT_S (x the cluster's time_scale), and
reports the seconds that took (`healed_after_s`; null if it did not within the bound, with a
warning). A node still stopped when the workload ends is continued.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

from meshllm.config import ClusterConfig
from meshllm.errors import InputError
from meshllm.mesh.node import send_control
from meshllm.mesh.protocol import MsgType, make
from meshllm.partition.plan import Plan, PlanError

if TYPE_CHECKING:
    from meshllm.emulate import EmulatedCluster

log = logging.getLogger("meshllm.emulate")

HEAL_TIMEOUT_S = 30.0  # after a partition ends: the live plan uses every node again by then, or the report says not
HEAL_POLL_S = 0.1
SEND_TIMEOUT_S = 3.0  # a node's answer to a partition's FAULT (each node's own thread: none waits for another)


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # "kill" | "restart" | "pause" | "partition"
    at_s: float  # after the workload's first request
    node: str = ""
    zones: tuple[str, str] = ("", "")
    until_s: float = 0.0


def parse_faults(cfg: ClusterConfig, kills: list[str], partitions: list[str], gateways: list[str],
                 restarts: list[str] = (), pauses: list[str] = ()) -> list[Fault]:
    """`--kill NODE@S`, `--restart NODE@S`, `--pause NODE@S1-S2` and `--partition ZA:ZB@S1-S2`,
    checked against the cluster file (exit 2); `gateways`: the nodes whose APIs the workload's
    client talks to (not every one may be killed: the client goes to the next when one goes away)."""
    ids, zones, out = {n.id for n in cfg.nodes}, {n.zone for n in cfg.nodes}, []
    for kind, given in (("kill", kills), ("restart", restarts)):
        for k in given:
            node, _, at = k.rpartition("@")
            if "@" not in k:
                raise InputError(f"--{kind} {k!r}: expected NODE@S (S: seconds after the workload's first request)")
            if node not in ids:
                raise InputError(f"--{kind} {k!r}: no node {node!r} in {cfg.source} (nodes: {', '.join(sorted(ids))})")
            out.append(Fault(kind, _seconds(at, f"--{kind} {k!r}"), node=node))
    for k in pauses:
        node, _, span = k.rpartition("@")
        if "@" not in k:
            raise InputError(f"--pause {k!r}: expected NODE@S1-S2 (seconds after the workload's first request)")
        if node not in ids:
            raise InputError(f"--pause {k!r}: no node {node!r} in {cfg.source} (nodes: {', '.join(sorted(ids))})")
        s1, s2 = _span(span, f"--pause {k!r}")
        out.append(Fault("pause", s1, node=node, until_s=s2))
    _refuse_overlapping([f for f in out if f.kind == "pause"])
    _refuse_faults_on_a_dead_node(out)
    if gateways and set(gateways) <= {f.node for f in out if f.kind == "kill"}:
        raise InputError(f"--kill: {', '.join(gateways)} run{'s' if len(gateways) == 1 else ''} every gateway the "
                         "workload's client talks to (name another node's roles `gateway` in the cluster file)")
    for p in partitions:
        pair, _, span = p.rpartition("@")
        za, _, zb = pair.partition(":")
        if za not in zones or zb not in zones or za == zb:
            raise InputError(f"--partition {p!r}: expected ZONE_A:ZONE_B@S1-S2 with two zones of "
                             f"{cfg.source} ({', '.join(sorted(zones))})")
        s1, s2 = _span(span, f"--partition {p!r}")
        out.append(Fault("partition", s1, zones=(za, zb), until_s=s2))
    _refuse_overlapping([f for f in out if f.kind == "partition"])
    return sorted(out, key=lambda f: f.at_s)


def _refuse_faults_on_a_dead_node(faults: list[Fault]) -> None:
    """A node's faults, in time order, must find it running: nothing after a `--kill` but a
    `--restart` (which starts it again), and no kill or restart inside one of its pauses. Those ran
    on a dead or stopped node and were reported as done (a pause of a killed node listed with
    its times; a pause that a restart cut short listed with the end it never reached)."""
    def flag(f: Fault) -> str:
        return f"--pause {f.node}@{f.at_s:g}-{f.until_s:g}" if f.kind == "pause" else f"--{f.kind} {f.node}@{f.at_s:g}"

    by_node: dict[str, list[Fault]] = {}
    for f in faults:
        by_node.setdefault(f.node, []).append(f)
    for group in by_node.values():
        group.sort(key=lambda f: (f.at_s, f.kind != "kill"))
        killed = None
        for f in group:
            if killed is not None and f.kind != "restart":
                raise InputError(f"{flag(f)} comes after {flag(killed)}, which leaves the node dead: nothing "
                                 "would run (a --restart brings it back)")
            killed = f if f.kind == "kill" else None if f.kind == "restart" else killed
        for p in (f for f in group if f.kind == "pause"):
            for f in group:
                if f.kind != "pause" and p.at_s <= f.at_s <= p.until_s:
                    raise InputError(f"{flag(f)} falls within {flag(p)}: a node is killed or restarted only "
                                     "while it runs (end the pause first)")


def _refuse_overlapping(spans: list[Fault]) -> None:
    """Two pauses of one node, or two partitions of one zone pair, that overlap or touch are bad
    input. A stopped node is continued at the first pause's end and the second's end finds
    nothing to continue; a zone pair is healed at the first partition's end, cutting the second
    short (either way the report listed a span that did not happen)."""
    by_target: dict[Hashable, list[Fault]] = {}
    for f in spans:
        by_target.setdefault(f.node if f.kind == "pause" else frozenset(f.zones), []).append(f)
    for group in by_target.values():
        group.sort(key=lambda f: f.at_s)
        for a, b in zip(group, group[1:]):
            if b.at_s <= a.until_s:
                what = a.node if a.kind == "pause" else ":".join(a.zones)
                flag, whose = ("--pause", "one node's pauses") if a.kind == "pause" else \
                    ("--partition", "partitions of one zone pair")
                raise InputError(f"{flag} {what}@{a.at_s:g}-{a.until_s:g} and {flag} "
                                 f"{b.node or ':'.join(b.zones)}@{b.at_s:g}-{b.until_s:g} overlap: {whose} "
                                 f"must not overlap or touch (give one span, "
                                 f"{what}@{a.at_s:g}-{max(a.until_s, b.until_s):g})")


def _span(span: str, what: str) -> tuple[float, float]:
    """`S1-S2` -> (S1, S2), S2 after S1 (as Fault's at_s and until_s)."""
    start, dash, end = span.partition("-")
    if not dash:
        raise InputError(f"{what}: expected a span of seconds S1-S2 after the @")
    s1, s2 = _seconds(start, what), _seconds(end, what)
    if s2 <= s1:
        raise InputError(f"{what}: the end {s2:g} s must come after the start {s1:g} s")
    return s1, s2


def short_of(want: set[str], in_use: set[str], kinds: Mapping[str, Hashable]) -> set[str]:
    """The nodes of `want` that are not in use and whose kind has fewer nodes in use than in
    `want` (a new plan may keep a twin where the node was: partition/stable.py)."""
    def kind(n: str) -> Hashable:
        return kinds.get(n, n)

    need, have = Counter(kind(n) for n in want), Counter(kind(n) for n in in_use)
    return {n for n in want - in_use if have[kind(n)] < need[kind(n)]}


def _seconds(v: str, what: str) -> float:
    try:
        s = float(v)
    except ValueError:
        s = -1.0
    if not 0 <= s <= 3600:
        raise InputError(f"{what}: {v!r} is not a number of seconds in [0, 3600]")
    return s


class FaultInjector:
    """Runs the faults on schedule from the workload's first request (a thread; bounded), then
    watches the mesh heal after a pause or a partition. `live_plan`: the gateway's plan JSON now;
    `in_use`: the nodes the plan used before the faults."""

    def __init__(self, cluster: EmulatedCluster, faults: list[Fault], live_plan: Callable[[], Any] | None = None,
                 in_use: set[str] | None = None, heal_timeout_s: float = HEAL_TIMEOUT_S,
                 kinds: Mapping[str, Hashable] | None = None):
        self.cluster, self.faults, self.done = cluster, faults, []
        self.not_run: list[dict] = []  # the faults the workload ended before, with why (the report's faults_not_run)
        self.live_plan, self.in_use, self.heal_timeout_s = live_plan, set(in_use or ()), heal_timeout_s
        self.kinds = dict(kinds or {})  # node -> its kind (a twin in use in its place counts: stable.py)
        self._stop = threading.Event()  # the workload is done, or the run cut short
        self._halted = threading.Event()  # the run cut short: not even a heal is watched
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()  # the workload's first request, once started
        # under _lock (the faults thread, the caller's stop() and the partitions' senders):
        self._paused: dict[str, dict] = {}  # node stopped with SIGSTOP, not continued yet -> its entry in done
        self._cuts: list[tuple[dict, tuple[str, str], float]] = []  # partitions: (entry, zones, monotonic end)
        self._senders: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        if self.faults and self._thread is None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="faults", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """The workload is done: no fault still pending runs (each is listed in `not_run`); a heal
        being watched is waited for, and so are the partitions' messages still unanswered."""
        self._stop.set()
        self._resume_all("the workload is done")
        if self._thread is None:
            self._skip(self.faults, "the workload never started")
        else:
            spans = [d for d in self.done if "until_s" in d]
            if self._thread.is_alive() and spans:
                log.info("workload done; watching the mesh heal after the %s (at most %.0f s after it ends)",
                         spans[-1]["kind"], self.heal_timeout_s)
            ends = [d["until_s"] for d in spans if d.get("until_s") is not None]  # a partition still in force:
            left = max(0.0, self._t0 + max(ends, default=0.0) - time.monotonic())  # the heal watch starts at its end
            self._thread.join(timeout=left + self.heal_timeout_s + SEND_TIMEOUT_S + 10)
        with self._lock:
            senders = list(self._senders)
        for t in senders:
            t.join(timeout=SEND_TIMEOUT_S + 1)

    def _now(self) -> float:
        return round(time.monotonic() - self._t0, 3)

    def _run(self) -> None:
        events = sorted([(f.at_s, 0, f) for f in self.faults] + [(f.until_s, 1, f) for f in self.faults
                                                                 if f.kind == "pause"], key=lambda e: e[:2])
        for i, (when, end, f) in enumerate(events):
            if self._stop.wait(max(0.0, self._t0 + when - time.monotonic())):
                self._skip([e[2] for e in events[i:] if not e[1]],
                           f"the workload ended at {self._now():.1f} s, before it was due")
                break
            if end:
                self._resume(f.node)
            else:
                self._inject(f, self._now())
        self._resume_all("the workload is done")  # stop() may be at it too: whichever comes first
        spans = [d for d in self.done if "until_s" in d]  # pauses and partitions
        if spans and self.live_plan is not None and not self._halted.is_set():
            last = max(spans, key=lambda d: d["until_s"])
            self._watch_heal(last, self._t0 + last["until_s"])

    def halt(self) -> None:
        """The run is cut short (an error, Ctrl-C): no fault runs from now on, no heal is watched
        (a kill or restart fired during the teardown, a SIGSTOP 0.3 s after the Ctrl-C)."""
        with self._lock:
            self._halted.set()
            self._stop.set()

    def _inject(self, f: Fault, at: float) -> None:
        with self._lock:  # serialized with stop() and halt(): no fault after either
            if self._stop.is_set():
                self._skip([f], f"the workload ended at {at:.1f} s, before it was due")
                return
            if f.kind == "pause":
                entry = {"kind": "pause", "node": f.node, "at_s": at, "until_s": None}  # until_s: when continued
                self._paused[f.node] = entry
                self.cluster.pause(f.node)
            elif f.kind == "kill":
                self.cluster.kill(f.node)
            elif f.kind == "restart":
                self.cluster.restart(f.node)
        if f.kind == "pause":
            log.warning("fault: stopped %s (SIGSTOP) at %.1f s for %.1f s", f.node, at, f.until_s - f.at_s)
            self.done.append(entry)
        elif f.kind == "kill":
            log.warning("fault: killed %s at %.1f s", f.node, at)
            self.done.append({"kind": "kill", "node": f.node, "at_s": at})
        elif f.kind == "restart":
            log.warning("fault: killed %s at %.1f s and started it again", f.node, at)
            self.done.append({"kind": "restart", "node": f.node, "at_s": at})
        else:
            self._partition(f, at)

    def _skip(self, faults: list[Fault], why: str) -> None:
        """Faults that never ran: in `not_run`, with a warning (a failure drill's report must not
        look as if its schedule ran when the workload ended first)."""
        for f in faults:
            where = {"node": f.node} if f.kind in ("kill", "restart", "pause") else {"zones": list(f.zones)}
            span = {"until_s": f.until_s} if f.kind in ("pause", "partition") else {}
            self.not_run.append({"kind": f.kind, **where, "at_s": f.at_s, **span, "reason": why})
        if faults:
            log.warning("fault: %d fault(s) not run, %s: %s", len(faults), why, ", ".join(
                f"--{f.kind} {f.node or ':'.join(f.zones)}@{f.at_s:g}" + (f"-{f.until_s:g}" if f.until_s else "")
                for f in faults))

    def _resume_all(self, why: str) -> None:
        with self._lock:
            paused = sorted(self._paused)
        for node in paused:
            self._resume(node, f" ({why})")

    def _resume(self, node: str, why: str = "") -> None:
        """SIGCONT, its time (measured) the pause's until_s; a partition it missed is told now."""
        with self._lock:
            entry = self._paused.pop(node, None)
            if entry is None:
                return
            entry["until_s"] = self._now()
            self.cluster.resume(node)
        log.warning("fault: continued %s (SIGCONT) at %.1f s%s", node, entry["until_s"], why)
        self._tell_late(node)

    def _partition(self, f: Fault, at: float) -> None:
        """Every live node is told at once (a thread each): told one at a time, a node that did not
        answer (one this injector stopped cannot) held the others and every later fault up to 3 s
        each, while the report gave the scheduled times. A stopped node is told when continued."""
        seconds = f.until_s - f.at_s
        entry = {"kind": "partition", "zones": list(f.zones), "at_s": at, "until_s": round(at + seconds, 3)}
        dead = self.cluster.dead()
        with self._lock:
            stopped = sorted(n for n in self._paused if n not in dead)
            self._cuts.append((entry, f.zones, time.monotonic() + seconds))
            if stopped:  # until told, if continued before the partition's end (_tell_late)
                entry["not_told"] = {n: "stopped (--pause) until the partition's end" for n in stopped}
        for nid in self.cluster.addresses:
            if nid not in dead and nid not in stopped:
                self._send(nid, entry, f.zones, seconds)
        log.warning("fault: partition %s:%s from %.1f s for %.1f s%s", *f.zones, at, seconds,
                    f"; not told {', '.join(stopped)} (stopped), told when continued if before its end"
                    if stopped else "")
        self.done.append(entry)

    def _tell_late(self, node: str) -> None:
        """A node continued while a partition it missed (stopped) is in force is told the rest."""
        now = time.monotonic()
        with self._lock:
            due = [(e, z, end - now) for e, z, end in self._cuts if node in e.get("not_told", {}) and end - now > 0.01]
        if not due or node in self.cluster.dead():  # killed while stopped: nobody to tell
            return
        for entry, zones, left in due:
            with self._lock:
                del entry["not_told"][node]
                if not entry["not_told"]:  # the report names only the nodes never told
                    del entry["not_told"]
                entry.setdefault("told_late", {})[node] = self._now()
            log.warning("fault: told %s, continued, the rest of the partition %s:%s (%.1f s)", node, *zones, left)
            self._send(node, entry, zones, left)

    def _send(self, nid: str, entry: dict, zones: tuple[str, str], seconds: float) -> None:
        """The partition's FAULT to one node on a thread of its own; a node that does not answer
        within SEND_TIMEOUT_S is named in the entry's not_told (it may have dropped the message)."""
        def send() -> None:
            try:
                send_control(self.cluster.target(nid), make(MsgType.FAULT, zones=list(zones), seconds=seconds),
                             timeout_s=SEND_TIMEOUT_S, keys=self.cluster.keys)
            except Exception as e:  # noqa: BLE001 - a thread's last word: the report names the node not told
                why = f"no answer within {SEND_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
                with self._lock:
                    entry.setdefault("not_told", {})[nid] = why
                log.warning("fault: %s was not told the partition %s:%s: %s", nid, *zones, why)

        t = threading.Thread(target=send, name=f"fault-{nid}", daemon=True)
        with self._lock:
            self._senders.append(t)
        t.start()

    def _watch_heal(self, entry: dict, end: float) -> None:
        """From the last pause's or partition's end, poll the live plan until it uses every node it
        used before the faults that is still alive, or a twin of it (a node of the same kind); record
        the seconds that took in `entry`."""
        if self._halted.wait(max(0.0, end - time.monotonic())):
            return
        deadline, missing = end + self.heal_timeout_s, set()
        while not self._halted.is_set():
            want = self.in_use - self.cluster.dead()
            try:
                missing = short_of(want, Plan.from_json(self.live_plan()).nodes_in_use(), self.kinds)
            except (PlanError, OSError, ValueError) as e:  # the gateway busy re-planning: ask again
                missing = {f"(no plan: {e})"}
            if not missing or time.monotonic() >= deadline:
                break
            self._halted.wait(HEAL_POLL_S)
        if self._halted.is_set():  # cut short: no heal was seen, nor its absence
            return
        entry["healed_after_s"] = None if missing else round(max(0.0, time.monotonic() - end), 3)
        if missing:
            log.warning("fault: the mesh did not heal within %.0f s of the %s's end: %s not in use again",
                        self.heal_timeout_s, entry["kind"], ", ".join(sorted(missing)))
        else:
            log.info("fault: the mesh healed %.1f s after the %s ended (every node in use again)",
                     entry["healed_after_s"], entry["kind"])
