"""The request router: earliest finish, with waiting weighted ROUTE_WAIT_WEIGHT times. One
implementation for the simulator and the live gateway (pure: no sockets, no clocks; time is
passed in).

API (what a gateway calls with its live view of the replicas):

    reps   = from_plan(inp, plan)                      # sim/replica.py: timing per replica
    router = Router(reps, PortBook(inp.net))           # ports: sim/ports.py (empty = estimates)
    loads  = {r.id: ReplicaLoad(max_batch=r.max_batch()) for r in reps}   # kept up to date by the caller
    rid = router.pick_prefill(loads, n_in, n_out, now)          # a prefill or mixed replica
    did = router.pick_decode(src_id, loads, n_in, n_out, now)   # a decode or mixed replica for its KV (on arrival)

`n_in` is the prompt's length; `n_out` the expected output length (the router does not know
the future: the simulator passes the workload's mean). `now` is seconds on any clock that the
loads' absolute times use. The module functions `pick_prefill` / `pick_decode` do the same
without keeping a Router.

Score of a candidate = estimated finish of the request + ROUTE_WAIT_WEIGHT x its estimated waiting
(queueing before the prefill, for ports, for a decode slot; on a mixed replica also the pause
its prefill imposes on the sequences decoding there, when it goes whole). The port queue of a decode
replica counts the KV already booked on its ports and the KV promised to it: requests routed
there whose prompts are still prefilling elsewhere (`kv_pending_tokens`; without it, every
request routed during a prefill saw the same idle ports and picked the same replica: on
bench-fog-40-8b at 13.3 req/s the mean wait fell from 437 to 295 ms with it); KV that crosses a
link between zones counts on that link too, all of its layers (shared by every flow crossing it,
where each port takes only its stage's share), from the prefill replica being scored or asking
(without it the fog pipelines' KV queued ~10 s a request on bench-mesh-200's 500 Mb/s link to the
cloud A100s: at 6.45 req/s tuned Splitwise's mean wait fell from 2.43 to 1.20 s with it and with
the promise held until the last prefill stage has shipped, simulator.py). Likewise the
port queue of a prefill replica counts the KV of the prompts routed there that has not left yet
(`kv_unshipped_tokens`: queued or still in its pipeline), which its ports send before this
prompt's (without it, a replica whose 1 Gb/s ports ship KV slower than its stages compute
prompts looked idle to every new prompt; with it tuned Splitwise's saturation on bench-fog-40-8b
rose from 18.2 to 19.9 req/s, bench/planner.py). Every candidate is scored to the end of the
request, so a prefill replica (prefill, then KV shipping, then the best decode replica's queue
and decode) and a mixed replica (prefill, then its own decode) compare like with like.
A prefill replica's KV goes to a decode replica or to a mixed one (which decodes it beside its own
prompts), whichever finishes the request first by the same score. Ties go to the lower replica id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshllm.defaults import DECODE_TARGETS
from meshllm.partition.cost import transfer_s
from meshllm.partition.dp import Member
from meshllm.partition.latency import ROUTE_WAIT_WEIGHT
from meshllm.sim.ports import RX, TX, PortBook
from meshllm.sim.replica import SimReplica

PROMPT_AGING_TOKENS_PER_S = 1000.0  # see prompt_priority
PROMPT_AGING_SHARE = 0.1  # see prompt_aging


def prompt_aging(prefill_tok_s: float) -> float:
    """The aging of a replica that prefills `prefill_tok_s` tokens a second: PROMPT_AGING_TOKENS_PER_S,
    at most PROMPT_AGING_SHARE of its own speed. The constant suits the simulator's GPU replicas
    (thousands of tokens a second); on a replica of small devices (the demo's prefill node: ~150
    tokens/s) a long prompt aged faster than it was prefilled, so within seconds it outranked
    every new prompt and a 1-token request waited 24 s behind a 4000-token one. At a tenth of its
    speed, a prompt of L tokens is overtaken by a waiting longer one after about 10x its own
    prefill time. (The leader's order, roles/batcher.py; the simulator keeps the constant.)"""
    return min(PROMPT_AGING_TOKENS_PER_S, PROMPT_AGING_SHARE * max(prefill_tok_s, 0.0)) or PROMPT_AGING_TOKENS_PER_S


def prompt_priority(tokens_left: int, waited_s: float, aging: float = PROMPT_AGING_TOKENS_PER_S) -> float:
    """The order in which a replica takes its queued prompts (the simulator and roles/batcher.py):
    lowest first. Fewest prompt tokens left first, so a short prompt does not queue behind a long
    one (shortest-first minimises the mean wait), with aging: every second a prompt has waited
    counts as PROMPT_AGING_TOKENS_PER_S tokens fewer, so a long prompt is never starved. On
    bench-fog-40-8b at 9.5 / 13.3 req/s it cut meshllm's mean wait by 12 % / 10 % against
    arrival order (aging 300 tokens/s: 10 % / 15 %, with a longer p99 wait)."""
    return tokens_left - aging * waited_s


def prompt_rank(tokens_left: int, arrival_s: float) -> float:
    """prompt_priority(tokens_left, now - arrival_s) + AGING x now: the same order at every `now`,
    so a queue can keep its prompts in a heap on it (the simulator's PromptQueue)."""
    return tokens_left + PROMPT_AGING_TOKENS_PER_S * arrival_s


@dataclass
class ReplicaLoad:
    """One replica's queues right now (absolute times in seconds on the caller's clock)."""

    max_batch: int = 1  # decode slots (sequences whose KV fits)
    prefill_queued_s: float = 0.0  # pipeline occupancy of the prompts queued here, not started
    prefill_queued: int = 0  # prompts queued here or being prefilled (mixed: in chunks)
    prefill_queued_tokens: int = 0  # their prompt tokens not prefilled yet
    next_prefill_at: float = 0.0  # earliest time the pipeline takes a new prompt
    active: int = 0  # sequences in the decode batch
    waiting: int = 0  # sequences sent here (KV in flight or arrived) not yet in the batch
    tokens_left: float = 0.0  # mean output tokens the active sequences still have to generate
    kv_pending_tokens: int = 0  # prompt tokens of sequences routed here whose KV has not started shipping
    kv_unshipped_tokens: int = 0  # prefill replica: prompt tokens routed here whose KV its last stage has not sent


class Router:
    def __init__(self, replicas: Sequence[SimReplica], ports: PortBook, wait_weight: float = ROUTE_WAIT_WEIGHT):
        self.reps = {r.id: r for r in replicas}
        self.ports = ports
        self.w = wait_weight
        self._flows: dict[tuple[int, int], list[tuple[Member, Member, float]]] = {}
        self._links: dict[tuple[int, int], dict[tuple, float]] = {}
        self._crossing: dict[int, tuple] = {}  # prefill replica -> the zone links its KV crosses to each target
        roles = {r.role for r in replicas}
        self.ships = "prefill" in roles and bool(roles & set(DECODE_TARGETS))  # a prefill replica's KV has somewhere to go

    def kv_flows(self, src: SimReplica, dst: SimReplica, tokens: int) -> list[tuple[Member, Member, float]]:
        """KV transfers of one prompt of `tokens` tokens: every prefill stage to every decode stage
        holding some of its layers (bytes per token cached per replica pair)."""
        key = (src.id, dst.id)
        per_token = self._flows.get(key)
        if per_token is None:
            per_token = []
            for ms, (a, b) in zip(src.members, src.ranges()):
                for md, (c, e) in zip(dst.members, dst.ranges()):
                    overlap = min(b, e) - max(a, c)
                    if overlap > 0 and ms.id != md.id:
                        per_token.append((ms, md, overlap * src.inp.mc.kv_bytes_per_token))
            self._flows[key] = per_token
        return [(a, b, per * tokens) for a, b, per in per_token]

    def pending_rx_s(self, rep: SimReplica, load: ReplicaLoad, src: SimReplica | None = None) -> float:
        """Seconds the KV already promised to `rep` (routed here, still prefilling elsewhere) will
        hold its busiest receiving port, or, coming from `src`'s zones, the busiest zone link it
        crosses (every layer's KV shares that link, where each port takes its stage's share): it
        is not on the ports yet, but arrives before ours. Where the promised KV comes from is not
        kept; the prefill replica asking stands for it."""
        if not load.kv_pending_tokens:
            return 0.0
        rx = self.pending_port_s(rep, load)
        return rx if src is None else self.pending_from(src, rep, load, rx)

    @staticmethod
    def pending_port_s(rep: SimReplica, load: ReplicaLoad) -> float:
        """pending_rx_s's busiest receiving port (0 with nothing promised)."""
        if not load.kv_pending_tokens:
            return 0.0
        per = rep.inp.mc.kv_bytes_per_token * load.kv_pending_tokens
        return max(transfer_s(per * n, m.device.network_mbps) for m, n in zip(rep.members, rep.counts))

    def pending_from(self, src: SimReplica, rep: SimReplica, load: ReplicaLoad, rx: float) -> float:
        """pending_rx_s from `src`, given its busiest receiving port's `rx` (pending_port_s)."""
        if not load.kv_pending_tokens:
            return 0.0
        return max(rx, max((per_token * load.kv_pending_tokens for per_token in self.kv_links(src, rep).values()),
                           default=0.0))

    def kv_links(self, src: SimReplica, dst: SimReplica) -> dict[tuple, float]:
        """{zone link: seconds a prompt token's KV holds it} for the links between zones that the
        KV from `src` to `dst` crosses (cached per replica pair)."""
        key = (src.id, dst.id)
        got = self._links.get(key)
        if got is None:
            got = self._links[key] = self.ports.shared_links(self.kv_flows(src, dst, 1))
        return got

    def decode_cost(self, rep: SimReplica, load: ReplicaLoad, n_out: float) -> tuple[float, float]:
        """(seconds from the KV's arrival (mixed: the prefill's end) to the last token, of which
        waiting for a slot). A mixed replica's queued prompts will hold slots too."""
        there = load.active + load.waiting + (load.prefill_queued if rep.role == "mixed" else 0)
        step = rep.decode_iter_s(min(there + 1, load.max_batch), rep.inp.mix.decode_ctx)
        queue_pos = there + 1 - load.max_batch
        # the q-th of B active sequences to finish has ~ q/B of 2 x (mean tokens left) to go
        slot_wait = max(0, queue_pos) / load.max_batch * 2 * load.tokens_left * step
        return slot_wait + max(0.0, n_out - 1) * step, slot_wait

    def pick_decode(self, src_id: int, loads: Mapping[int, ReplicaLoad], n_in: int, n_out: float,
                    now: float) -> int:
        """The decode (or mixed) replica for the KV of a prompt prefilled on `src_id` (the gateway
        and the simulator ask on arrival; the KV transfer is estimated as if it started `now`)."""
        src, best = self.reps[src_id], None
        for rep in self.reps.values():
            if rep.role not in DECODE_TARGETS:
                continue
            end, ideal = self.ports.transfers(self.kv_flows(src, rep, n_in), now, commit=False)
            end += self.pending_rx_s(rep, loads[rep.id], src)
            rest, slot_wait = self.decode_cost(rep, loads[rep.id], n_out)
            score = end + rest + self.w * (end - ideal + slot_wait)
            if best is None or score < best[0]:
                best = (score, rep.id)
        assert best is not None, "no decode or mixed replica"
        return best[1]

    def decode_targets(self, loads: Mapping[int, ReplicaLoad], n_out: float, now: float,
                       ships: bool = True) -> dict[int, tuple[SimReplica, float, float, float]]:
        """What the candidates' scores share, computed once a pick: {id: (each decode or mixed
        replica, its `decode_cost`, the wait of its busiest rx port, `pending_port_s` (both 0
        unless `ships`))}."""
        return {rep.id: (rep, *self.decode_cost(rep, loads[rep.id], n_out),
                         max(self.ports.wait_s(m.id, RX, now) for m in rep.members) if ships else 0.0,
                         self.pending_port_s(rep, loads[rep.id]) if ships else 0.0)
                for rep in self.reps.values() if rep.role in DECODE_TARGETS}

    def crossing(self, src: SimReplica) -> tuple:
        """The zone links `src`'s KV crosses to each decode or mixed replica (kv_links, in the
        replicas' order): two prefill replicas alike in this have the same best_decode_rest."""
        got = self._crossing.get(src.id)
        if got is None:
            got = self._crossing[src.id] = tuple(tuple(self.kv_links(src, rep).items()) for rep in self.reps.values()
                                                 if rep.role in DECODE_TARGETS)
        return got

    def best_decode_rest(self, src: SimReplica, loads: Mapping[int, ReplicaLoad], n_out: float, now: float,
                         targets: dict | None = None, memo: dict | None = None) -> float:
        """Scored seconds from `src`'s KV shipped to done on the best decode replica (the queues
        of its rx ports and of the zone links from `src` included); `targets`: decode_targets';
        `memo`: the figures of one pick, by `crossing` (most prefill replicas share their zones)."""
        if memo is not None:
            key = self.crossing(src)
            got = memo.get(key)
            if got is None:
                got = memo[key] = self.best_decode_rest(src, loads, n_out, now, targets)
            return got
        best = float("inf")
        targets = self.decode_targets(loads, n_out, now) if targets is None else targets
        for rep, rest, slot_wait, rx_port, pending in targets.values():
            links = self.kv_links(src, rep)
            if links:
                rx = max(rx_port, self.ports.link_wait_s(links, now))
                rx += self.pending_from(src, rep, loads[rep.id], pending)
            else:  # within its zone: the ports and the KV promised to them, whichever prefills it
                rx = rx_port + pending
            best = min(best, rest + (1 + self.w) * rx + self.w * slot_wait)
        return best

    def mixed_score(self, rep: SimReplica, load: ReplicaLoad, n_in: int, n_out: float, now: float,
                    cost: tuple[float, float] | None = None) -> float:
        """A mixed replica prefills its prompts in chunks riding along its decode steps (as many
        tokens per step as `chunk_tokens` gives), or whole (`SimReplica.goes_whole`: once as many
        prompts wait as sequences decode); either way the decoding sequences wait for the steps' extra
        time, and the prompt waits for the next micro-batch launch (`join_wait_s`)."""
        _, lat = rep.prefill_s(n_in)
        b, ctx = load.active, rep.inp.mix.decode_ctx
        tokens = load.prefill_queued_tokens + n_in
        if rep.goes_whole(b, ctx, load.prefill_queued + 1, n_in, tokens):
            ttft, pause = now + lat * tokens / n_in, b * lat
        else:
            chunk = min(tokens, rep.chunk_tokens(b, ctx, n_in, tokens, load.prefill_queued + 1))
            steps, base = tokens / chunk, rep.decode_iter_s(b, ctx)
            step = rep.decode_iter_s(b, ctx, chunk, n_in)
            ttft, pause = now + steps * step, b * steps * (step - base)
        join = rep.join_wait_s(b, ctx)  # for the next micro-batch launch
        rest, slot_wait = cost if cost is not None else self.decode_cost(rep, load, n_out)
        return ttft + join + rest + self.w * (join + max(0.0, ttft - now - lat) + slot_wait + pause)

    def prefill_score(self, rep: SimReplica, loads: Mapping[int, ReplicaLoad], n_in: int, n_out: float,
                      now: float, ships: bool = True, targets: dict | None = None, memo: dict | None = None) -> float:
        """A candidate's score for a new prompt; `ships`: a prefill replica's KV has a decode or
        mixed replica to go to (else its decode is not counted); `targets`, `memo`: shared by the
        candidates of one pick (decode_targets, best_decode_rest)."""
        load = loads[rep.id]
        if rep.role == "mixed":
            return self.mixed_score(rep, load, n_in, n_out, now, None if targets is None else targets[rep.id][1:3])
        decode_rest = self.best_decode_rest(rep, loads, n_out, now, targets, memo) if ships else 0.0
        _, lat = rep.prefill_s(n_in)
        start = max(now, load.next_prefill_at) + load.prefill_queued_s
        ttft = start + lat
        kv = rep.inp.mc.kv_bytes_per_token
        waits = [self.tx_wait_s(m, kv * n, load, now, ttft) for m, n in zip(rep.members, rep.counts)]
        ship = max(w + transfer_s(kv * n_in * n, m.device.network_mbps)
                   for w, m, n in zip(waits, rep.members, rep.counts))
        return ttft + ship + decode_rest + self.w * (start - now + max(waits))

    def tx_wait_s(self, m: Member, kv_per_token: float, load: ReplicaLoad, now: float, at: float) -> float:
        """Seconds a prefill stage's KV (`kv_per_token` bytes a token), ready at `at`, waits for
        its port: behind the KV already booked there and the KV of the prompts ahead of it on the
        replica (`kv_unshipped_tokens`, not on the port yet), which leaves no sooner than now."""
        ahead = transfer_s(kv_per_token * load.kv_unshipped_tokens, m.device.network_mbps)
        return max(0.0, self.ports.wait_s(m.id, TX, now) + ahead - (at - now))

    def pick_prefill(self, loads: Mapping[int, ReplicaLoad], n_in: int, n_out: float, now: float) -> int:
        """The prefill (or mixed) replica for a new request of `n_in` prompt tokens."""
        best, ships = None, self.ships
        targets, memo = self.decode_targets(loads, n_out, now, ships), {}  # what the candidates share, once
        for rep in self.reps.values():
            if rep.role in ("prefill", "mixed"):
                score = self.prefill_score(rep, loads, n_in, n_out, now, ships, targets, memo)
                if best is None or score < best[0]:
                    best = (score, rep.id)
        assert best is not None, "no prefill or mixed replica"
        return best[1]


def pick_prefill(replicas: Sequence[SimReplica], loads: Mapping[int, ReplicaLoad], n_in: int, n_out: float,
                 now: float, ports: PortBook | None = None) -> int:
    """`Router.pick_prefill` without keeping a Router (ports: estimated idle if None)."""
    return Router(replicas, ports or PortBook(replicas[0].inp.net)).pick_prefill(loads, n_in, n_out, now)


def pick_decode(src: int, replicas: Sequence[SimReplica], loads: Mapping[int, ReplicaLoad], n_in: int,
                n_out: float, now: float, ports: PortBook | None = None) -> int:
    """`Router.pick_decode` without keeping a Router (ports: estimated idle if None)."""
    return Router(replicas, ports or PortBook(replicas[0].inp.net)).pick_decode(src, loads, n_in, n_out, now)
