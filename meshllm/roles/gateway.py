"""The gateway: where requests enter the mesh and tokens leave it.

`Gateway` is the mesh side of the OpenAI-compatible HTTP API (roles/http_api.py serves it):
- it tokenizes, picks a prefill (or mixed) replica and, for a prefill replica, the decode
  replica it hands off to, with the earliest-finish router the simulator uses
  (meshllm/sim/router.py, one implementation), fed with what this gateway has dispatched;
- it sends GENERATE_REQ to the replica's leader and collects TOKENS (from the prefill leader,
  then from the decode leader) in order, for the HTTP stream of that request;
- a request that ends early (client gone, stop string, error) is released on its replicas;
- a replica is used only once every node of it reports the current plan loaded;
- it keeps the Prometheus metrics of `/metrics` (TTFT, ITL, end-to-end latency, queue depth).
TOKENS arrive on the I/O thread and are handed to the HTTP event loop thread-safely.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from meshllm.config import NodeConfig
from meshllm.defaults import served_name
from meshllm.mesh.membership import Membership, PeerInfo
from meshllm.mesh.protocol import Message, MsgType, check_seq, make, sampling_map
from meshllm.mesh.transport import Transport
from meshllm.roles.context import PlanContext
from meshllm.roles.coordinator import live_plan_inputs
from meshllm.roles.leader import MAX_ACTIVE_SEQS
from meshllm.roles.metrics import GatewayMetrics
from meshllm.sim.ports import PortBook
from meshllm.sim.replica import SimReplica, from_plan
from meshllm.sim.router import ReplicaLoad, Router

log = logging.getLogger("meshllm.gateway")

STALL_TIMEOUT_S = 120.0  # no token for this long (x time_scale): the request fails, not hangs
SEND_POOL_THREADS = 1


class RequestError(Exception):
    """A request the mesh cannot serve now (no replica ready, mesh re-planned, stalled)."""


@dataclass
class Stream:
    seq: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    leaders: set[str]  # addresses of the leaders that may hold it (for RELEASE)
    prefill_rid: int
    decode_rid: int
    n_in: int
    n_out: int
    started: float = field(default_factory=time.monotonic)
    next_index: int = 0
    pending: dict[int, tuple[list[int], bool, str | None]] = field(default_factory=dict)
    first_at: float | None = None
    queue_ms: float = 0.0
    spec: dict | None = None  # the session's acceptance figures (speculative decoding)
    drafter: str = ""


class Gateway:
    def __init__(self, transport: Transport, members: Membership, me: PeerInfo, cfg: NodeConfig):
        self.t, self.members, self.me_info, self.cfg = transport, members, me, cfg
        self.me, self.address, self.model_spec = me.id, me.address, cfg.model
        self.model_name = served_name(cfg.model)
        self.time_scale = cfg.time_scale
        self.stall_s = STALL_TIMEOUT_S * cfg.time_scale
        self.reps: dict[int, SimReplica] = {}  # the plan's replicas as the router sees them
        self.ctx: PlanContext | None = None
        self.local_version = 0  # plan version this node itself has loaded
        self.tokenizer = None
        self.max_context = 0
        self.vocab = 0
        self.metrics = GatewayMetrics()
        self.local_load = lambda: {}  # this node's own load (the Node wires its RoleHost in)
        self._streams: dict[int, Stream] = {}
        self._lock = threading.Lock()
        self._seq_prefix = random.SystemRandom().getrandbits(30) << 32
        self._seq_counter = itertools.count(1)
        self._decoding: dict[int, int] = {}
        self._send_pool = ThreadPoolExecutor(SEND_POOL_THREADS, thread_name_prefix=f"gw-send-{self.me}")
        self.loads: dict[int, ReplicaLoad] = {}  # replica -> what this gateway has in flight there
        transport.on(MsgType.TOKENS, self._on_tokens)

    def load_model_info(self) -> None:
        """Tokenizer and context size (the gateway holds no weights)."""
        from meshllm.engine.tokenizer import load_tokenizer
        from meshllm.engine.weights import resolve_model

        src = resolve_model(self.model_spec)
        self.tokenizer = load_tokenizer(src)
        self.max_context, self.vocab = src.args.max_seq_len, src.args.vocab_size

    # -- plan and readiness ----------------------------------------------------------------------
    def on_plan(self, ctx: PlanContext) -> None:
        """The local RoleHost applied `ctx` (called on its compute thread): the router's view of
        the new plan's replicas, from the device profiles of the nodes it names. Requests on
        replicas that did not change go on; the others are failed (their replicas dropped them,
        and a leader that died cannot say so itself)."""
        infos = {self.me: self.me_info} | {p.info.id: p.info for p in self.members.peers()}
        named = {s.node for r in ctx.plan.replicas for s in r.stages}
        inp = live_plan_inputs(self.cfg, [infos[n] for n in sorted(named) if n in infos])
        reps = {r.id: r for r in from_plan(inp, ctx.plan)} if named <= set(infos) else {}
        with self._lock:
            old = self.ctx
            keep = {rid for rid in reps if ctx.unchanged(old, rid)}
            self.ctx, self.local_version, self.reps = ctx, ctx.version, reps
            self.loads = {rid: self.loads[rid] if rid in keep and rid in self.loads else
                          ReplicaLoad(max_batch=max(1, min(r.max_batch(), MAX_ACTIVE_SEQS))) for rid, r in reps.items()}
            self._decoding = {rid: n for rid, n in self._decoding.items() if rid in keep}
            stale = [s for s in self._streams.values() if s.prefill_rid not in keep or s.decode_rid not in keep]
            for s in stale:
                self._streams.pop(s.seq, None)
        for s in stale:
            self.metrics.finished("error")
            s.loop.call_soon_threadsafe(s.queue.put_nowait, ([], True, "error", f"the mesh was re-planned "
                                        f"(plan v{ctx.version}) while this request ran; retry it"))

    def node_version(self, node: str) -> int:
        if node == self.me:
            return self.local_version
        p = self.members.get(node)
        if p is None or p.state.value != "alive":
            return -1
        v = p.load.get("plan_version")
        return v if isinstance(v, int) else -1

    def ready_replicas(self) -> list[int]:
        ctx = self.ctx
        if ctx is None:
            return []
        return [r.id for r in ctx.plan.replicas if all(self.node_version(s.node) == ctx.version for s in r.stages)]

    def ready(self) -> bool:
        """Serving: every replica of the current plan is loaded, and so is every drafter when
        speculation is on (requests are routed to what is ready before that)."""
        ctx = self.ctx
        if ctx is None or not ctx.plan.replicas:
            return False
        ready = set(self.ready_replicas())
        drafters = ctx.plan.drafters if self.cfg.speculation.mode != "off" else ()
        return ready == {r.id for r in ctx.plan.replicas} and all(
            self.node_version(d) == ctx.version for d in drafters)

    # -- routing ---------------------------------------------------------------------------------
    def route(self, n_in: int, n_out: int, pin: int | None = None) -> tuple[int, int]:
        """(prefill replica, decode replica) for a request, by the simulator's earliest-finish
        router over the ready replicas; the same id twice for a mixed replica. `pin` asks for a
        decode replica (operators, benchmarks); it must be a ready decode or mixed replica."""
        ready = set(self.ready_replicas())
        if pin is not None and (pin not in ready or self.reps.get(pin) is None
                                or self.reps[pin].role not in ("decode", "mixed")):
            raise RequestError(f"decode replica {pin} is not a ready decode replica of this plan")
        with self._lock:
            reps = [r for rid, r in self.reps.items() if rid in ready]
            if pin is not None and self.reps[pin].role == "mixed":
                return pin, pin
            if pin is not None:  # a pinned decode replica takes its prompts from a prefill replica
                reps = [r for r in reps if r.role != "mixed"]
            if not any(r.role == "decode" for r in reps):
                reps = [r for r in reps if r.role == "mixed"]  # a prefill replica needs a decode one
            if not any(r.role in ("prefill", "mixed") for r in reps):
                raise RequestError("no replica is ready (the mesh is still planning or loading)")
            router = Router(reps, PortBook(reps[0].inp.net))
            now = time.monotonic() / self.time_scale  # the router's clock: emulated device seconds
            pre = router.pick_prefill(self.loads, n_in, n_out, now)
            if router.reps[pre].role == "mixed":
                return pre, pre
            return pre, pin if pin is not None else router.pick_decode(pre, self.loads, n_in, n_out, now)

    def _book(self, s: Stream, phase: str, sign: int) -> None:
        """Keep the router's view: prompts queued for prefill, sequences decoding (and their
        remaining tokens), per replica."""
        with self._lock:
            pre, dec = self.loads.get(s.prefill_rid), self.loads.get(s.decode_rid)
            if phase == "prefill" and pre is not None and s.prefill_rid in self.reps:
                occupancy = self.reps[s.prefill_rid].prefill_s(s.n_in)[0]
                pre.prefill_queued_s = max(0.0, pre.prefill_queued_s + sign * occupancy)
            elif phase == "decode" and dec is not None:
                self._decoding[s.decode_rid] = self._decoding.get(s.decode_rid, 0) + sign
                n = self._decoding[s.decode_rid]
                dec.active, dec.waiting = min(n, dec.max_batch), max(0, n - dec.max_batch)
                dec.tokens_left = s.n_out / 2  # mean remaining of a sequence in the batch

    # -- requests ---------------------------------------------------------------------------------
    async def submit(self, ids: list[int], max_tokens: int, temperature: float, top_k: int, top_p: float,
                     seed: int, spec_mode: str | None = None, gamma: int | None = None,
                     decode_replica: int | None = None, adaptive: bool | None = None) -> Stream:
        ctx = self.ctx
        pre, dec = self.route(len(ids), max_tokens, decode_replica)
        seq = self._seq_prefix | next(self._seq_counter)
        loop = asyncio.get_running_loop()
        leaders = {ctx.leader(pre), ctx.leader(dec)}
        sp = self.cfg.speculation
        mode = spec_mode or sp.mode
        drafter = self.pick_drafter() if mode != "off" else ""
        s = Stream(seq, loop, asyncio.Queue(), leaders, pre, dec, len(ids), max_tokens, drafter=drafter)
        if drafter:
            leaders.add(ctx.address(drafter))
        with self._lock:
            self._streams[seq] = s
        self._book(s, "prefill", +1)
        self.metrics.started(len(ids))
        sampling, stop = sampling_map(temperature, top_k, top_p, seed), sorted(self.tokenizer.eos_ids)
        msgs = [(ctx.leader(pre), make(MsgType.GENERATE_REQ, seq=seq, prompt_token_ids=ids, max_tokens=max_tokens,
                                       sampling=sampling, stop_ids=stop, decode_replica=dec, gateway=self.address,
                                       drafter=drafter, plan_version=ctx.version))]
        if drafter:  # first, so that the drafter prefills the prompt while the target does
            msgs.insert(0, (ctx.address(drafter), make(
                MsgType.SESSION, seq=seq, prompt_token_ids=ids, max_tokens=max_tokens, sampling=sampling,
                stop_ids=stop, decode_replica=dec, gamma=gamma or sp.gamma,
                adaptive=sp.adaptive if adaptive is None else adaptive,
                mode=mode, gateway=self.address, plan_version=ctx.version)))
        try:
            for addr, msg in msgs:
                await loop.run_in_executor(self._send_pool, self.t.send, addr, msg)
        except (TimeoutError, OSError) as e:
            self.close_stream(s, "error", release=True)
            raise RequestError(f"the mesh did not take the request: {e}") from None
        return s

    def pick_drafter(self) -> str:
        """The ready drafter with the fewest sessions from this gateway ("" when none is ready).
        One drafter serves many sessions (one-for-many)."""
        ctx = self.ctx
        if ctx is None:
            return ""
        ready = [d for d in ctx.plan.drafters if self.node_version(d) == ctx.version]
        if not ready:
            return ""
        with self._lock:
            mine = Counter(s.drafter for s in self._streams.values())
        return min(ready, key=lambda d: (mine[d], d))

    async def tokens(self, s: Stream):
        """Yield (token ids, finish_reason or None) in output order until the sequence ends."""
        while True:
            try:
                item = await asyncio.wait_for(s.queue.get(), self.stall_s)
            except asyncio.TimeoutError:
                raise RequestError(f"no token for {self.stall_s:g} s; the mesh stalled") from None
            toks, finished, reason, error = item
            if error:
                raise RequestError(error)
            yield toks, (reason if finished else None)
            if finished:
                return

    def _on_tokens(self, msg: Message, reply: Any) -> None:
        """I/O thread: order TOKENS by output index and hand them to the request's event loop."""
        seq = check_seq(msg["seq"])
        with self._lock:
            s = self._streams.get(seq)
        if s is None:
            return  # finished or abandoned already
        idx, toks = msg["index"], [int(t) for t in msg["token_ids"]]
        err = msg.fields.get("error") if msg["finish_reason"] == "error" else None
        if err is not None:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, ([], True, "error", str(err)))
            return
        if isinstance(msg.fields.get("queue_ms"), (int, float)):
            s.queue_ms += msg["queue_ms"]
        if isinstance(msg.fields.get("spec"), dict):
            s.spec = msg["spec"]
        if not toks:
            return
        if self.ctx is not None and msg.src in self.ctx.addresses:
            s.leaders.add(self.ctx.addresses[msg.src])  # a session that moved is released where it is now
        s.pending[idx] = (toks, msg["finished"], msg["finish_reason"])
        while s.next_index in s.pending:  # in order, each index once (a duplicate is overwritten)
            toks, fin, reason = s.pending.pop(s.next_index)
            if s.next_index == 0:
                self._book(s, "prefill", -1)
                self._book(s, "decode", +1)
            s.next_index += len(toks)
            s.loop.call_soon_threadsafe(s.queue.put_nowait, (toks, fin, reason, None))
            if fin:
                s.pending.clear()
                break

    def close_stream(self, s: Stream, status: str, release: bool = False) -> None:
        """The request is over (done, failed, or abandoned: then free it on its replicas)."""
        with self._lock:
            known = self._streams.pop(s.seq, None) is not None
        if not known:
            return
        self._book(s, "decode" if s.next_index > 0 else "prefill", -1)
        self.metrics.finished(status, s.spec)
        if release:
            for addr in s.leaders:
                self.t.send(addr, make(MsgType.RELEASE, seq=s.seq, reason=f"gateway: {status}"))

    def mesh_view(self) -> dict[str, Any]:
        """Every node's state and its last heartbeat load (this node's own load included)."""
        nodes = {p.info.id: {"state": p.state.value, "address": p.info.address, "zone": p.info.zone,
                             "load": p.load} for p in self.members.peers()}
        nodes[self.me] = {"state": "alive", "address": self.address, "zone": self.me_info.zone,
                          "load": self.local_load()}
        return {"node": self.me, "plan_version": self.ctx.version if self.ctx else 0, "nodes": nodes}

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def close(self) -> None:
        self._send_pool.shutdown(wait=False, cancel_futures=True)
