"""The gateway: where requests enter the mesh and tokens leave it.

`Gateway` is the mesh side of the OpenAI-compatible HTTP API (roles/http_api.py serves it):
- it tokenizes, picks a prefill (or mixed) replica and, for a prefill replica, the decode
  replica it hands off to, with the earliest-finish router the simulator uses
  (meshllm/sim/router.py, one implementation), fed with what this gateway has dispatched
  (`RouterView`, roles/route_view.py: the replicas, their loads, the KV shipped on a model of their ports);
- it sends GENERATE_REQ to the replica's leader and collects TOKENS (from the prefill leader,
  then from the decode leader) in order, for the HTTP stream of that request;
- it holds requests back, first come first served, while no decode replica has KV room left
  for them (roles/kv_book.py: the leaders' rooms, this gateway's and the other gateways' claims),
  and asks the chosen decode replica's leader for the room before it sends one (KV_RESERVE);
- a request that ends early (client gone, stop string, error) is released on its replicas;
- a replica is used only once every node of it reports the current plan loaded;
- it keeps the Prometheus metrics of `/metrics` (TTFT, ITL, end-to-end latency, queue depth).
TOKENS arrive on the I/O thread and are handed to the HTTP event loop thread-safely.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from meshllm.defaults import DECODE_TARGETS, served_name
from meshllm.mesh.fields import check_int_list, check_seq, sampling_map
from meshllm.mesh.membership import Membership, PeerInfo
from meshllm.mesh.protocol import Message, MsgType, ProtocolError, make
from meshllm.mesh.transport import Transport
from meshllm.node_config import NodeConfig
from meshllm.roles.admission import Admission
from meshllm.roles.batcher import decode_charge
from meshllm.roles.context import PlanContext
from meshllm.roles.coordinator import live_plan_inputs
from meshllm.roles.kv_book import KvBook, KvDenied
from meshllm.roles.metrics import GatewayMetrics, summed
from meshllm.roles.model_info import ModelInfo
from meshllm.roles.readiness import Readiness
from meshllm.roles.route_view import PIN_GONE, RequestError, RouterView, Stream, kv_fit
from meshllm.sim.replica import from_plan

log = logging.getLogger("meshllm.gateway")

STALL_TIMEOUT_S = 60.0  # no token nor keepalive (roles/leader.py) for this long (x time_scale): resumed, then fails
MAX_ATTEMPTS = 5  # a request is resumed at most 4 times (a partition may cost two re-plans)
RESUME_WAIT_S = 60.0  # x time_scale: how long a resumed request waits for a ready replica
RESUME_POLL_S = 0.2  # a request waiting for a ready replica looks again this often, and at once on news (`wake`)
READY_WAIT_S = 15.0  # x time_scale: a new request waits this long for a ready replica, then 503
DEATH_CHECK_S = 0.25  # how often the I/O thread looks for requests on replicas with a node seen dead
SEND_POOL_THREADS = 1
MAX_PENDING = 4096  # TOKENS held out of order per request (and token ids per TOKENS message)
SEQ_COUNTER_MASK = (1 << 32) - 1  # a sequence id: this gateway's random prefix | a counter below it



async def within(aw, timeout: float):
    """`await aw`, or asyncio.TimeoutError after `timeout` s. Not asyncio.wait_for: before Python
    3.12 it drops a cancellation that comes in the step its awaitable completes (CPython
    gh-86296), and aiohttp cancels a handler once, when its client leaves: a non-streamed request
    whose tokens kept coming then ran to max_tokens for nobody, holding its slot, counted "ok"."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout)
    except BaseException:  # cancelled: so is what it waited for
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise asyncio.TimeoutError
    return task.result()

class Gateway(Readiness):
    def __init__(self, transport: Transport, members: Membership, me: PeerInfo, cfg: NodeConfig):
        self.t, self.members, self.me_info, self.cfg = transport, members, me, cfg
        self.me, self.address, self.model_spec = me.id, me.address, cfg.model
        self.model_name = served_name(cfg.model)
        self.time_scale = cfg.time_scale
        self.stall_s = STALL_TIMEOUT_S * cfg.time_scale
        self.view = RouterView(cfg.time_scale)  # what the router knows of the replicas
        self.kv = KvBook(self)  # KV admission: the decode replicas' rooms, the requests' claims
        self.ctx: PlanContext | None = None
        self.local_version = 0  # plan version this node itself has loaded
        self.model = ModelInfo(self.me, self.model_name)  # tokenizer, context, shape (Node.start loads it)
        self.metrics = GatewayMetrics()
        self.local_load = lambda: {}  # this node's own load (the Node wires its RoleHost in)
        self._streams: dict[int, Stream] = {}
        self._refused: dict[str, float] = {}  # node -> when it refused a request of this gateway's plan
        self.admission = Admission(cfg.max_concurrent)  # requests the API holds (`admitted`), per client
        self.closing: str | None = None  # why every request left ends now (the drain's deadline: `shut`)
        self._lock = threading.Lock()
        self._seq_prefix = random.SystemRandom().getrandbits(30) << 32  # this life's requests (no other's)
        self._seq_counter = itertools.count(1)
        self._send_pool = ThreadPoolExecutor(SEND_POOL_THREADS, thread_name_prefix=f"gw-send-{self.me}")
        self._waiting: list[asyncio.Future] = []  # requests waiting for a ready replica (`_until_news`)
        transport.on(MsgType.TOKENS, self._on_tokens)
        transport.every(DEATH_CHECK_S, self.on_deaths)

    # -- plan and readiness ----------------------------------------------------------------------
    def on_plan(self, ctx: PlanContext) -> None:
        """The local RoleHost applied `ctx` (called on its compute thread): the router's view of
        the new plan's replicas, from the device profiles of the nodes it names. Requests whose
        replicas did not change go on (the prefill replica counts until the attempt's first token:
        Stream.replicas); the others are failed (their replicas dropped them, and a leader that
        died cannot say so itself)."""
        infos = {self.me: self.me_info} | {p.info.id: p.info for p in self.members.peers()}
        named = {s.node for r in ctx.plan.replicas for s in r.stages}
        inp = live_plan_inputs(self.cfg, [infos[n] for n in sorted(named) if n in infos], self.model.shape())
        reps = {r.id: r for r in from_plan(inp, ctx.plan)} if named <= set(infos) else {}
        keep = {rid for rid in reps if ctx.unchanged(self.ctx, rid)}
        self.view.replan(reps, inp, keep)
        with self._lock:
            self.ctx, self.local_version = ctx, ctx.version
            # (each with the attempt it is about, by its key: the attempt may move on meanwhile)
            stale = [(seq, s) for seq, s in self._streams.items() if not s.replicas() <= keep]
        for seq, s in stale:  # a replica they need changed: resume them on the new plan (tokens() does it)
            self._fail(s, f"the mesh was re-planned (plan v{ctx.version}) while this request ran", seq)
        self.wake()

    def on_deaths(self) -> None:
        """I/O thread: a request whose replica lost a node (its peers saw it dead) is resumed at
        once, on whatever is ready, not after the STALL_TIMEOUT_S without a token (a re-plan does it
        too, but a mesh that can no longer plan sends none: its requests waited 60 s, then 60 more).
        The prefill replica counts until the attempt's first token; the decode replica always."""
        ctx = self.ctx
        if ctx is None:
            return
        dead = self.dead_nodes()
        if not dead:
            return
        nodes = {r.id: {st.node for st in r.stages} for r in ctx.plan.replicas}
        hit = []
        with self._lock:
            for seq, s in self._streams.items():
                if s.dead_seen == seq:
                    continue
                gone = set().union(*(nodes.get(rid, set()) for rid in s.replicas())) & dead
                if gone:
                    s.dead_seen = seq
                    hit.append((seq, s, min(gone)))
        for seq, s, node in hit:
            self._fail(s, f"node {node} of its replica died", seq)

    def wake(self) -> None:
        """Any thread: news that may make a replica ready (a plan applied here, a peer's heartbeat
        saying which plan it has loaded): requests waiting for one look again at once, not at
        their next RESUME_POLL_S (on average 0.1 s of every resume's pause)."""
        with self._lock:
            if not self._waiting:
                return
            waiting, self._waiting = self._waiting, []
        for fut in waiting:
            with contextlib.suppress(RuntimeError):  # its loop has closed: no one waits any more
                fut.get_loop().call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))

    async def _until_news(self) -> None:
        """Wait for `wake` or RESUME_POLL_S, whichever comes first."""
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiting.append(fut)
        try:
            await within(fut, RESUME_POLL_S)
        except asyncio.TimeoutError:
            with self._lock:
                if fut in self._waiting:
                    self._waiting.remove(fut)

    # -- requests ---------------------------------------------------------------------------------
    async def submit(self, ids: list[int], max_tokens: int, temperature: float, top_k: int, top_p: float,
                     seed: int, spec_mode: str | None = None, gamma: int | None = None,
                     decode_replica: int | None = None, adaptive: bool | None = None,
                     resume: Sequence[int] = ()) -> Stream:
        """Send a request into the mesh; `resume`: output tokens the client already has (from a
        gateway that died): the request goes on after them, as a resumed attempt does."""
        sp = self.cfg.speculation
        settings = {"sampling": sampling_map(temperature, top_k, top_p, seed), "mode": spec_mode or sp.mode,
                    "gamma": gamma or sp.gamma, "adaptive": sp.adaptive if adaptive is None else adaptive,
                    "pin": decode_replica}
        s = Stream(0, asyncio.get_running_loop(), asyncio.Queue(), set(), -1, -1, len(ids), max_tokens,
                   prompt=list(ids), settings=settings, emitted=list(resume), next_index=len(resume))
        self.metrics.started(len(ids))
        status = "abandoned"  # the client went away (the handler cancelled) before it was sent
        try:
            await self.kv.wait_for_room(s)
            deadline = time.monotonic() + READY_WAIT_S * self.time_scale
            while True:  # a mesh that is re-planning (a node died) gets a moment before a 503
                if self.closing:  # the drain is over: not after READY_WAIT_S
                    raise RequestError(self.closing, "shutting_down")
                try:
                    await self._dispatch(s)
                    status = "sent"
                    return s
                except KvDenied:  # another gateway's requests took the room first: wait for it again
                    await self.kv.wait_for_room(s, again=True)
                    deadline = time.monotonic() + READY_WAIT_S * self.time_scale
                except RequestError as e:  # (no plan yet, too: a gateway that has just started gets one soon)
                    if e.code == PIN_GONE:  # pinned to a replica this plan lacks: no wait brings it back
                        raise
                    if time.monotonic() > deadline:
                        raise RequestError(self.unservable() or str(e)) from None
                    await self._until_news()
        except RequestError:
            status = "error"
            raise
        finally:
            if status != "sent":
                self.close_stream(s, status, release=True, count=False)  # a _dispatch cut short had sent it
                self.metrics.not_sent(status)

    async def _dispatch(self, s: Stream) -> None:
        """Start an attempt: route, then SESSION to a drafter (if any) and GENERATE_REQ to the
        prefill leader. A resumed attempt's prompt is the request's prompt plus its output so
        far, and its token indices continue from there."""
        ids, left = s.prompt + s.emitted, s.n_out - len(s.emitted)
        ctx, st = self.ctx, s.settings
        if ctx is None:
            raise RequestError("this gateway has no plan yet (the mesh is forming, or this node has just started)")
        pin = st["pin"]
        if pin is not None and pin not in (decoders := ctx.decoders()):
            raise RequestError(f"decode replica {pin} is not a decode replica of plan v{ctx.version} (its decode "
                               f"replicas: {decoders})", PIN_GONE)  # no wait brings it back (a resumed attempt's plan lost it)
        drafter = self.pick_drafter() if st["mode"] != "off" else ""
        ready = set(self.ready_replicas())
        s.kv_charge = decode_charge(len(ids), left, bool(drafter), self.model.max_context)
        if st["pin"] is None:  # not to a replica whose KV room left cannot hold the request (roles/batcher.py)
            rooms = self.kv.rooms()
            ready = kv_fit(ready, {r.id: str(r.role) for r in ctx.plan.replicas}, self.kv.left(rooms), s.kv_charge,
                           rooms)
        pre, dec = self.view.route(ready, len(ids), left, st["pin"])
        seq = self._seq_prefix | next(self._seq_counter)
        s.seq, s.prefill_rid, s.decode_rid, s.drafter = seq, pre, dec, drafter
        s.offset_at_dispatch, s.pending = len(s.emitted), {}
        s.leaders = {ctx.leader(pre), ctx.leader(dec)} | ({ctx.address(drafter)} if drafter else set())
        with self._lock:
            self._streams[seq] = s
        self.view.book(s, "prefill", +1)  # before any wait: the next request's route sees this one
        if st["pin"] is None and s.attempts == 1:  # the decode leader's word on its room, not only the heartbeats'
            try:
                await self.kv.reserve(s, ctx.leader(dec), ctx.version)
            except RequestError as e:  # (a client gone meanwhile: submit releases it, a grant included)
                self.close_stream(s, "error", release=not isinstance(e, KvDenied), count=False)
                raise
        stop = sorted(self.model.tokenizer.eos_ids)
        msgs = [(ctx.leader(pre), make(MsgType.GENERATE_REQ, seq=seq, prompt_token_ids=ids, max_tokens=left,
                                       sampling=st["sampling"], stop_ids=stop, decode_replica=dec,
                                       gateway=self.address, drafter=drafter, plan_version=ctx.version,
                                       offset=len(s.emitted)))]
        if drafter:  # first, so that the drafter prefills the prompt while the target does
            msgs.insert(0, (ctx.address(drafter), make(
                MsgType.SESSION, seq=seq, prompt_token_ids=ids, max_tokens=left, sampling=st["sampling"],
                stop_ids=stop, decode_replica=dec, gamma=st["gamma"], adaptive=st["adaptive"], mode=st["mode"],
                gateway=self.address, plan_version=ctx.version, offset=len(s.emitted))))
        try:
            for addr, msg in msgs:
                await s.loop.run_in_executor(self._send_pool, self.t.send, addr, msg)
        except (TimeoutError, OSError) as e:
            self.close_stream(s, "error", release=True, count=False)
            raise RequestError(f"the mesh did not take the request: {e}") from None

    async def _resume(self, s: Stream, why: str) -> None:
        """Re-run a failed attempt on the current plan from the committed output (the client sees
        a pause, not an error). Bounded: MAX_ATTEMPTS attempts, each waiting at most RESUME_WAIT_S
        for a replica to be ready."""
        if s.attempts >= MAX_ATTEMPTS:
            raise RequestError(f"{why}; gave up after {s.attempts} attempts")
        log.warning("request seq %d: %s; resuming from %d committed tokens", s.seq, why, len(s.emitted))
        if s.emitted:  # a recovery gap: from its last token to the next (before any, the pause is its TTFT's)
            s.gap_from = s.gap_from or s.last_token_at or s.started
        self.close_stream(s, "resumed", release=True, count=False)
        s.attempts += 1
        s.spec_before = s.spec  # what the ended attempts verified stays the request's
        self.metrics.resumes.inc()
        t0 = time.monotonic()
        deadline = t0 + RESUME_WAIT_S * self.time_scale
        while True:
            if self.closing:
                self.metrics.finished("error")
                raise RequestError(self.closing, "shutting_down")
            try:
                await self._dispatch(s)
                log.info("request resumed as seq %d on replicas %d -> %d after %.2f s", s.seq, s.prefill_rid,
                         s.decode_rid, time.monotonic() - t0)
                return
            except RequestError as e:
                if time.monotonic() > deadline or e.code == PIN_GONE:  # (a pin the new plan lacks: at once)
                    self.metrics.finished("error")  # this request left the books with its last attempt
                    raise RequestError(f"{why}; no replica could take the request again: "
                                       f"{self.unservable() or e}", e.code) from None
                await self._until_news()

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
        """Yield (token ids, finish_reason or None) in output order until the sequence ends; a
        failed attempt is resumed (`_resume`) without the caller noticing, but for the pause."""
        while True:
            try:
                item = await within(s.queue.get(), self.stall_s)
            except asyncio.TimeoutError:
                await self._resume(s, f"no token for {self.stall_s:g} s")
                continue
            toks, finished, reason, error, seq = item
            if not toks and not finished and not error:  # a keepalive: the replica works on it
                continue
            if error and self.closing:
                raise RequestError(self.closing, "shutting_down")
            if error and seq != s.seq:  # about an attempt already resumed (news queued while it resumed:
                continue  # each re-plan and death notice cost an attempt, up to MAX_ATTEMPTS)
            if error:
                await self._resume(s, error)
                continue
            now = time.monotonic()
            if s.gap_from is not None:  # the first token after a resume (one gap however many attempts)
                s.gaps_ms.append(round(1000 * (now - s.gap_from), 3))
                s.gap_from = None
            s.last_token_at = now
            yield toks, (reason if finished else None)
            if finished:
                return

    @staticmethod
    def _fail(s: Stream, why: str, seq: int | None = None) -> None:
        """Any thread: tell `s`'s reader that its attempt `seq` (the current one) failed: it resumes
        the request, once per attempt (news about an attempt already resumed is dropped)."""
        s.loop.call_soon_threadsafe(s.queue.put_nowait, ([], True, "error", why, s.seq if seq is None else seq))

    def _on_tokens(self, msg: Message, reply: Any) -> None:
        """I/O thread: order TOKENS by output index and hand them to the request's event loop."""
        seq = check_seq(msg["seq"])
        with self._lock:
            s = self._streams.get(seq)
        if s is None:  # finished or abandoned already; or a request of this gateway's earlier life
            if seq & ~SEQ_COUNTER_MASK != self._seq_prefix and self.ctx is not None and msg.src in self.ctx.addresses:
                # (a restart at the same address): no one reads it, so its replica stops running it
                self.t.send(self.ctx.addresses[msg.src], make(MsgType.RELEASE, seq=seq, reason="gateway: restarted"))
            return
        idx = msg["index"]
        toks = check_int_list(msg["token_ids"], "token_ids", 0, self.model.vocab - 1 if self.model.vocab else None, MAX_PENDING)
        err = msg.fields.get("error") if msg["finish_reason"] == "error" else None
        if err is not None and msg.fields.get("refused") == "stale_plan" and self.ctx and msg.src in self.ctx.addresses:
            self._refused[msg.src] = time.monotonic()  # not ready until its next heartbeat says so
        if err is not None:
            self._fail(s, str(err), seq)
            return
        if isinstance(msg.fields.get("queue_ms"), (int, float)):
            s.queue_ms += msg["queue_ms"]
        if isinstance(msg.fields.get("spec"), dict):  # the attempt's figures so far
            s.spec = summed(s.spec_before, msg["spec"])
        if "moved_to" in msg.fields and s.next_index > s.offset_at_dispatch:
            self._follow(s, msg["moved_to"])
        if not toks:
            if idx == s.next_index and not msg["finished"] and "moved_to" not in msg.fields:  # a keepalive:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, ([], False, None, None, seq))  # queued or prefilling
            return
        if self.ctx is not None and msg.src in self.ctx.addresses:
            s.leaders.add(self.ctx.addresses[msg.src])  # a session that moved is released where it is now
        if idx < s.next_index:
            return  # a duplicate, or tokens of an earlier attempt
        if s.next_index > s.offset_at_dispatch:  # decoding: from the leader of the replica it decodes on
            led = self.ctx.plan.replica_of(msg.src) if self.ctx is not None else None
            if led is not None and led[1] == 0:
                self._follow(s, led[0].id)
        if len(s.pending) >= MAX_PENDING:
            raise ProtocolError(f"seq {seq}: {len(s.pending)} TOKENS messages ahead of index {s.next_index}")
        s.pending[idx] = (toks, msg["finished"], msg["finish_reason"])
        while s.next_index in s.pending:  # in order, each index once (a duplicate is overwritten)
            toks, fin, reason = s.pending.pop(s.next_index)
            if s.next_index == s.offset_at_dispatch:  # this attempt's first token: its prefill is done
                self.view.book(s, "prefill", -1)
                self.view.book(s, "decode", +1)
                self.view.ship(s)
            s.next_index += len(toks)
            s.emitted.extend(toks)
            s.loop.call_soon_threadsafe(s.queue.put_nowait, (toks, fin, reason, None, seq))
            if fin:
                s.pending.clear()
                break

    def _follow(self, s: Stream, rid: Any) -> None:
        """A decode leader moves sessions to a replica with capacity (roles/decode.py) and says so
        (`moved_to` in an empty TOKENS); tokens from another decode replica's leader say it too:
        the request decodes on replica `rid` now, so a re-plan that changes that replica resumes
        it (it kept the replica it was sent to, and a death or restart there left it waiting for
        the 60 s stall timeout)."""
        ctx = self.ctx
        if (type(rid) is int and rid != s.decode_rid and ctx is not None and ctx.has_replica(rid)
                and str(ctx.replica(rid).role) in DECODE_TARGETS):
            self.view.book(s, "decode", -1)
            s.decode_rid = rid
            self.view.book(s, "decode", +1)

    def close_stream(self, s: Stream, status: str, release: bool = False, count: bool = True) -> None:
        """The request (or, with count=False, one attempt of it) is over: done, failed, or abandoned
        (then free it on its replicas)."""
        with self._lock:
            known = self._streams.pop(s.seq, None) is not None
        if not known:
            return
        self.view.book(s, "decode" if s.next_index > s.offset_at_dispatch else "prefill", -1)
        if count:
            self.metrics.finished(status, s.spec)
        targets = set(s.leaders) if release else set()
        if s.drafter and self.ctx is not None and s.drafter in self.ctx.addresses:
            targets.add(self.ctx.addresses[s.drafter])  # a session that ended at its first token, too
        for addr in targets:
            self.t.send(addr, make(MsgType.RELEASE, seq=s.seq, reason=f"gateway: {status}"))

    def mesh_view(self) -> dict[str, Any]:
        """Every node's state and its last heartbeat load (this node's own load included)."""
        nodes = {p.info.id: {"state": p.state.value, "address": p.info.address, "zone": p.info.zone,
                             "load": p.load} for p in self.members.peers()}
        nodes[self.me] = {"state": "alive", "address": self.address, "zone": self.me_info.zone,
                          "load": self.local_load()}
        return {"node": self.me, "plan_version": self.ctx.version if self.ctx else 0, "nodes": nodes}

    def in_flight(self) -> int:
        """Requests this gateway holds, from admission to the response's end: in the mesh, waiting
        for KV room or for a ready replica (a re-plan), or between a failed attempt and the next
        (max_concurrent bounds them all; a drain waits for them all)."""
        return self.admission.total

    @contextlib.contextmanager
    def admitted(self, client: str) -> Iterator[str | None]:
        """A slot for one request of `client` (its address) while the block runs (the API's handler,
        admission to response): the block gets None, or why there is none (a 429; nothing is held)."""
        why = self.admission.try_admit(client, time.monotonic())
        try:
            yield why
        finally:
            if why is None:
                self.admission.release(client)

    def shut(self, why: str) -> None:
        """End every request in flight now (a stopping gateway's drain is over): each one's reader
        gets a RequestError with code "shutting_down", and its sequence is released where it runs."""
        self.closing = why
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            self._fail(s, why)

    def close(self) -> None:
        self.model.close()
        self._send_pool.shutdown(wait=False, cancel_futures=True)
        self.kv.ask_pool.shutdown(wait=False, cancel_futures=True)
