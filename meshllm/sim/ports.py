"""Network ports and zone links as FIFO servers (the simulator's side of cost.py's link model).

- Every device has two servers, tx and rx (full duplex), each at its `network_mbps`.
- A link between two different zones is one server per direction at its `bandwidth_mbps`,
  shared by every transfer that crosses it; a link within a zone caps each flow only.
- A transfer a -> b of n bytes queues n / rate on a's tx, on b's rx and (between zones) on
  the link, each independently (switches buffer), and is complete when all of them are, plus
  rtt/2. Its wait is that end minus the end it would have had on idle servers.
Servers are booked in event order; `free` holds, per server, when its queued work ends (s).
"""

from __future__ import annotations

from collections.abc import Iterable

from meshllm.partition.cost import transfer_s
from meshllm.partition.dp import Member, Net

TX, RX = "tx", "rx"


class PortBook:
    def __init__(self, net: Net):
        self.net = net
        self.free: dict[tuple, float] = {}  # (node, "tx"|"rx") or (zone_a, zone_b) -> end of queued work
        self._paths: dict[tuple[str, str], list[tuple[tuple, float]]] = {}
        self._half_rtt: dict[tuple[str, str], float] = {}

    def path(self, a: Member, b: Member) -> tuple[list[tuple[tuple, float]], float]:
        """[(server, seconds per byte)], rtt/2 of a transfer a -> b; a within-zone link's cap is a
        pseudo-server of its own (never shared) keyed by the pair."""
        key = (a.id, b.id)
        got = self._paths.get(key)
        if got is None:
            rtt, mbps = self.net.rtt_mbps(a.zone, b.zone)
            got = [((a.id, TX), transfer_s(1, a.device.network_mbps)), ((b.id, RX), transfer_s(1, b.device.network_mbps))]
            if mbps is not None:
                server = (a.zone, b.zone) if a.zone != b.zone else key
                got.append((server, transfer_s(1, mbps)))
            self._paths[key], self._half_rtt[key] = got, rtt / 2000.0
        return got, self._half_rtt[key]

    def _book(self, servers, nbytes: float, now: float, into: dict, shared: bool) -> float:
        """Queue one transfer on its servers in `into` (over the real bookings if `shared`)."""
        end = now
        for server, per_byte in servers:
            busy = into.get(server, self.free.get(server, 0.0) if shared else 0.0)
            into[server] = done = max(now, busy) + nbytes * per_byte
            end = max(end, done)
        return end

    def transfers(self, flows: Iterable[tuple[Member, Member, float]], now: float,
                  commit: bool, alone: dict | None = None) -> tuple[float, float]:
        """Transfers started together (e.g. the KV of every stage of one request): (when the last
        one is complete, when it would be had no other request's transfer been queued). Booked
        only if `commit`; an estimate otherwise. `alone`: the same request's own earlier transfers
        (kept in it), which its ideal end does queue behind."""
        booked: dict = {}
        alone = {} if alone is None else alone
        end = ideal = now
        for a, b, nbytes in flows:
            servers, half = self.path(a, b)
            end = max(end, self._book(servers, nbytes, now, booked, True) + half)
            ideal = max(ideal, self._book(servers, nbytes, now, alone, False) + half)
        if commit:
            self.free.update(booked)
        return end, ideal

    def transfer(self, a: Member, b: Member, nbytes: float, now: float, commit: bool = True) -> tuple[float, float]:
        return self.transfers(((a, b, nbytes),), now, commit)

    def shared_links(self, flows: Iterable[tuple[Member, Member, float]]) -> dict[tuple, float]:
        """{zone link: seconds of `flows` on it} for the links between zones they cross (shared
        by every flow on them; a within-zone link caps each flow only, so it is left out)."""
        out: dict[tuple, float] = {}
        for a, b, nbytes in flows:
            if a.zone != b.zone:
                for server, per_byte in self.path(a, b)[0][2:]:  # past the two ports: the zone link
                    out[server] = out.get(server, 0.0) + nbytes * per_byte
        return out

    def link_wait_s(self, links: Iterable[tuple], now: float) -> float:
        """Seconds until the busiest of `links` (zone links, as `shared_links` keys them) has sent
        what is queued on it."""
        return max((max(self.free.get(server, 0.0) - now, 0.0) for server in links), default=0.0)

    def wait_s(self, node: str, direction: str, now: float) -> float:
        """Seconds until `node`'s port in `direction` has sent / received what is queued."""
        return max(self.free.get((node, direction), 0.0) - now, 0.0)
