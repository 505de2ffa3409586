"""The OpenAI-compatible HTTP API of a gateway node (aiohttp, in a thread of its own).

    POST /v1/completions        prompt (string, [string] or [token ids]); stream or not
    POST /v1/chat/completions   messages rendered with the model's chat template
    GET  /v1/models             the served model (GET /v1/models/NAME: its card, or 404)
    GET  /health                200 when every replica of the current plan is loaded, else 503
    GET  /metrics               Prometheus text (TTFT / ITL / latency histograms, queue depth, tokens)
    GET  /v1/plan               meshllm extension: the plan being served and its version
    GET  /v1/mesh               meshllm extension: every node's state and load (memory, layers, traffic)

Request fields: model, max_tokens (or max_completion_tokens), temperature, top_p, seed, stop
(string or up to 4), stream, stream_options.include_usage, n (1 only); the OpenAI fields this API
does not implement (penalties, logprobs, logit_bias, echo, tools, ...: `api_params.NO_OP`) are a 400 unless
at their no-op value, never silently ignored; `top_k` is accepted as an extension, and so is `meshllm`: {"speculation": "async" |
"sync" | "off", "gamma": 1-16, "adaptive": bool, "decode_replica": id, "resume_token_ids": [ids]} (per-request
controls for operators and benchmarks; by default the cluster's settings and the router decide;
`resume_token_ids`: the output a client already has from a gateway that died mid-stream, which
this gateway goes on from instead of starting over: only the tokens after them are sent). Every choice carries `token_ids` (extension)
so clients can compare against `--reference`. Bad input is a 4xx with an OpenAI-style JSON
error (`{"error": {"message", "type", "param", "code"}}`) and the node keeps serving. A client
that disconnects mid-stream has its sequence released on every node that holds it.

With an API token (`gateway: {api_token: FILE}` in the node file) every path but /health
needs `Authorization: Bearer <token>` (compared in constant time); anything else is a 401
with an OpenAI-style error (code "invalid_api_key"). /health stays open for load balancers
and readiness probes: it tells only whether the plan's replicas are loaded (why the mesh cannot
serve, which names the model, nodes and roles, only with the token).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid

from aiohttp import web

from meshllm.defaults import GATEWAY_DRAIN_S, HTTP_IDLE_S
from meshllm.roles.api_params import ApiError, Params, json_body, parse_params
from meshllm.roles.gateway import Gateway, within
from meshllm.roles.route_view import RequestError, Stream
from meshllm.roles.text_stream import TextStream

log = logging.getLogger("meshllm.http")


def _not_an_answered_body_error(record: logging.LogRecord) -> bool:
    """aiohttp reads what is left of a body after the handler has answered, and logs a traceback
    ("Unhandled exception") when that body cannot be decoded (Content-Encoding: gzip on a body that
    is not): the client already has its 400 (`invalid_body`), so that record is noise."""
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, web.RequestPayloadError)


server_log = logging.getLogger("meshllm.http.server")  # aiohttp's per-connection logger, as ours
server_log.addFilter(_not_an_answered_body_error)

MAX_BODY_BYTES = 4 * 1024 * 1024
BODY_IDLE_FACTOR = 4  # a request body must arrive within 4 x HTTP_IDLE_S (60 s: 4 MiB at 0.6 Mbit/s)


def _chunk(kind: str, rid: str, model: str, text: str, ids: list[int], finish: str | None, first: bool) -> dict:
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, "token_ids": ids}
        return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None, "token_ids": ids}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}


async def _generate(request: web.Request, gw: Gateway, chat: bool, body_s: float) -> web.StreamResponse:
    try:  # a body trickled in (slowloris) holds a connection and a handler no longer than body_s
        raw = await within(request.read(), body_s)
        body = json_body(raw, request.charset)
    except asyncio.TimeoutError:
        resp = ApiError(408, f"the request body did not arrive within {body_s:g} s", None,
                        "request_timeout").response()
        resp.force_close()
        return resp
    except web.RequestPayloadError as e:  # Content-Encoding: gzip on a body that is not
        resp = ApiError(400, f"the request body cannot be read: {e}", None, "invalid_body").response()
        resp.force_close()  # the rest of the stream is not a request
        return resp
    except ConnectionError as e:  # the client left mid-body: it was an ERROR with two tracebacks each time
        resp = ApiError(400, f"the connection closed before the whole body came: {e}", None,
                        "invalid_body").response()
        resp.force_close()  # aiohttp's write of it to a closed connection is only a debug line
        return resp
    except ApiError as e:
        return e.response()
    try:  # a lone surrogate escape ("\ud800") is valid JSON but no text: the tokenizer cannot take it
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return ApiError(400, "the request body is not valid Unicode text (a lone surrogate escape such as "
                             "\\ud800)", None, "invalid_json").response()
    try:  # off the event loop: a long prompt's tokenizing would stall every other request's stream
        p = await asyncio.get_running_loop().run_in_executor(None, parse_params, body, gw, chat)
    except ApiError as e:
        return e.response()
    # held from here to the response's end, whatever it waits for meanwhile (roles/admission.py)
    with gw.admitted(request.remote or "") as refused:
        if refused is not None:
            resp = ApiError(429, f"{refused}; retry later, or at another gateway", None, "overloaded").response()
            resp.headers["Retry-After"] = "1"
            gw.metrics.requests.labels(status="rejected").inc()  # meshllm_requests_total{status="rejected"}
            return resp
        try:
            s = await gw.submit(p.prompt_ids, p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed,
                                spec_mode=p.spec_mode, gamma=p.gamma, decode_replica=p.decode_replica,
                                adaptive=p.adaptive, resume=p.resume)
        except RequestError as e:
            return ApiError(503, str(e), None, e.code).response()
        kind, rid = ("chat", f"chatcmpl-{uuid.uuid4().hex}") if chat else ("text", f"cmpl-{uuid.uuid4().hex}")
        run = Run(gw, s, p, kind, rid)
        return await (run.stream(request) if p.stream else run.whole())


class Run:
    """One request's life after it entered the mesh: tokens in, text out, metrics, release."""

    def __init__(self, gw: Gateway, s: Stream, p: Params, kind: str, rid: str):
        self.gw, self.s, self.p, self.kind, self.rid = gw, s, p, kind, rid
        self.text = TextStream(gw.model.tokenizer, p.stop, p.resume)
        self.ids: list[int] = []  # the tokens of this response (after any the client resumed from)
        self.last_at: float | None = None

    async def events(self):
        """(text delta, token ids, finish_reason) as tokens arrive; records TTFT and ITL."""
        async for toks, finish in self.gw.tokens(self.s):
            now = time.monotonic()
            if self.last_at is None:
                self.gw.metrics.first_token(now - self.s.started)
                self.s.first_at = now
            else:
                self.gw.metrics.itl.observe(now - self.last_at)
            self.last_at = now
            self.ids.extend(toks)
            delta = self.text.push(toks, finish is not None)
            if self.text.stopped:
                if self.text.excess:  # tokens after the stop string's (a verified block's)
                    toks = toks[:len(toks) - self.text.excess]
                    del self.ids[len(self.ids) - self.text.excess:]
                self.gw.metrics.generation_tokens.inc(len(toks))
                yield delta, toks, "stop"
                return
            self.gw.metrics.generation_tokens.inc(len(toks))
            yield delta, toks, finish
            if finish is not None:
                return

    def extension(self) -> dict:
        """meshllm's per-request figures: queueing and, with speculation, acceptance."""
        out = {"queue_ms": round(self.s.queue_ms, 3)}
        if self.p.temperature > 0:  # the seed it drew with (a fresh one when none was given): to resume or repeat it
            out["seed"] = self.p.seed
        if self.s.spec:
            out["spec"] = self.s.spec
        if self.s.attempts > 1:
            out["attempts"], out["recovery_gaps_ms"] = self.s.attempts, self.s.gaps_ms
        return out

    def _end(self, status: str) -> None:
        early = status != "ok" or self.text.stopped
        if self.s.first_at is None:
            self.gw.metrics.waiting.dec()
        self.gw.metrics.e2e.observe(time.monotonic() - self.s.started)
        self.gw.metrics.queue_wait.observe(self.s.queue_ms / 1000)
        self.gw.close_stream(self.s, status, release=early)

    async def whole(self) -> web.Response:
        status, parts, finish = "error", [], None
        try:
            async for delta, _, f in self.events():
                parts.append(delta)
                finish = f or finish
            status = "ok"
        except RequestError as e:
            return ApiError(503, str(e), None, e.code).response()
        except asyncio.CancelledError:  # the client went away (it was counted as an error)
            status = "abandoned"
            log.info("request %s: the client went away; releasing its sequence", self.rid)
            raise
        finally:
            self._end(status)
        text = "".join(parts)
        choice = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": self.ids}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({
            "id": self.rid, "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": self.gw.model_name, "choices": [choice],
            "usage": self.usage(), "meshllm": self.extension()})

    def usage(self) -> dict:
        return {"prompt_tokens": self.s.n_in, "completion_tokens": len(self.ids),
                "total_tokens": self.s.n_in + len(self.ids)}

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        status = "abandoned"
        try:
            await resp.prepare(request)
            first = True
            async for delta, toks, finish in self.events():
                chunk = _chunk(self.kind, self.rid, self.gw.model_name, delta, toks, finish, first)
                if finish is not None:
                    chunk["meshllm"] = self.extension()
                await resp.write(_sse(chunk))
                first = False
            if self.p.include_usage:  # OpenAI's last chunk: no choices, the usage
                await resp.write(_sse({"id": self.rid, "object": chunk["object"], "created": int(time.time()),
                                       "model": self.gw.model_name, "choices": [], "usage": self.usage()}))
            status = "ok"
        except RequestError as e:
            status = "error"
            await resp.write(_sse({"error": {"message": str(e), "type": "server_error", "code": e.code}}))
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("request %s: the client went away; releasing its sequence", self.rid)
            raise
        finally:
            self._end(status)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


TOKEN_SHOWN = web.RequestKey("token_shown", bool)  # set by bearer_check where a token is wanted


def bearer_check(token: str | None):
    """aiohttp middleware: a 401 for any request but /health without `Authorization: Bearer <token>`."""
    want = f"Bearer {token}".encode() if token else b""

    @web.middleware
    async def check(request: web.Request, handler):
        if want:
            got = request.headers.get("Authorization", "").encode("utf-8", "replace")
            request[TOKEN_SHOWN] = hmac.compare_digest(got, want)
            if not request[TOKEN_SHOWN] and request.path != "/health":
                resp = ApiError(401, "missing or wrong API token: send 'Authorization: Bearer <token>'", None,
                                "invalid_api_key").response()
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
        return await handler(request)

    return check


# aiohttp's own 4xx (no such route, wrong method, body too large) -> the API's error codes
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


@web.middleware
async def json_errors(request: web.Request, handler):
    """aiohttp middleware: the errors aiohttp raises itself come back as the API's JSON error
    body, as every other error does (they were plain text, which OpenAI clients cannot parse)."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = f"{request.method} {request.path}: {e.reason}"
        if e.status == 413:
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
        resp = ApiError(e.status, message, None, _HTTP_CODES.get(e.status, "http_error")).response()
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp


def build_app(gw: Gateway, token: str | None = None, idle_s: float = HTTP_IDLE_S) -> web.Application:
    """The API's routes; a request's body must arrive within BODY_IDLE_FACTOR x idle_s."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_errors, bearer_check(token)])
    body_s = BODY_IDLE_FACTOR * idle_s

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _generate(request, gw, False, body_s)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _generate(request, gw, True, body_s)

    def model_card() -> dict:
        return {"id": gw.model_name, "object": "model", "created": 0, "owned_by": "meshllm"}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card()]})

    async def model(request: web.Request) -> web.Response:  # the OpenAI SDK's models.retrieve
        name = request.match_info["name"]
        if name != gw.model_name:
            return ApiError(404, f"model {name!r} is not served here; this mesh serves {gw.model_name!r}", "model",
                            "model_not_found").response()
        return web.json_response(model_card())

    async def health(request: web.Request) -> web.Response:
        ctx = gw.ctx
        ready, why = gw.ready(), gw.unservable()
        body = {"status": "ok" if ready else "unavailable" if why else "starting",
                "plan_version": ctx.version if ctx else 0,
                "replicas_ready": len(gw.ready_replicas()), "replicas": len(ctx.plan.replicas) if ctx else 0,
                "in_flight": gw.in_flight(), **({"error": why} if why else {})}
        if why and not request.get(TOKEN_SHOWN, True):  # why names the model, nodes and roles: not for anyone
            body["error"] = "the mesh cannot serve now (send the API token to see why)"
        return web.json_response(body, status=200 if ready else 503)

    async def metrics(request: web.Request) -> web.Response:
        gw.metrics.replicas_ready.set(len(gw.ready_replicas()))
        data, ctype = gw.metrics.render()
        return web.Response(body=data, headers={"Content-Type": ctype})

    async def plan(request: web.Request) -> web.Response:
        ctx = gw.ctx
        if ctx is None:
            return ApiError(503, "no plan yet", None, "unavailable").response()
        return web.json_response({"version": ctx.version, "plan": ctx.plan.to_json()})

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name:.+}", model)  # a name may hold '/' (a model served by its path)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    async def mesh(request: web.Request) -> web.Response:
        view = gw.mesh_view()
        st = gw.metrics.spec
        view["speculation"] = {"acceptance_rate": st.rate, "mean_acceptance_length": st.mean_length, **st.to_json()}
        return web.json_response(view)

    app.router.add_get("/v1/plan", plan)
    app.router.add_get("/v1/mesh", mesh)
    return app


class ApiServer:
    """Runs the app on HOST:PORT in a daemon thread with its own event loop."""

    def __init__(self, gw: Gateway, listen: str, token: str | None = None, drain_s: float = GATEWAY_DRAIN_S,
                 idle_s: float = HTTP_IDLE_S):
        self.gw, self.listen, self.token, self.drain_s, self.idle_s = gw, listen, token, drain_s, idle_s
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gateway-http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        if not self._started.wait(timeout_s) or self._error is not None:
            raise OSError(f"the gateway cannot listen on {self.listen}: {self._error}")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        host, _, port = self.listen.rpartition(":")
        try:
            self._runner = web.AppRunner(build_app(self.gw, self.token, self.idle_s), handler_cancellation=True,
                                         access_log=None, logger=server_log,
                                         shutdown_timeout=self.drain_s + 5,  # our deadline comes first
                                         keepalive_timeout=self.idle_s)  # from the connection's start too
            self.loop.run_until_complete(self._runner.setup())
            self.loop.run_until_complete(web.TCPSite(self._runner, host.strip("[]"), int(port)).start())
        except OSError as e:
            self._error = e
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    def close(self) -> None:
        """Stop listening, let the requests in flight finish (up to the node file's
        gateway.drain_s), end those left with a "shutting_down" error (their sequences released
        where they run), then stop. New connections are refused meanwhile (a client goes to
        another gateway)."""
        if self._runner is not None and self.loop.is_running():
            drain = self.drain_s
            if self.gw.in_flight():
                log.info("gateway: draining %d request(s) in flight (up to %g s)", self.gw.in_flight(), drain)
            fut = asyncio.run_coroutine_threadsafe(self._drain(drain), self.loop)
            try:
                fut.result(timeout=drain + 10)
            except Exception as e:  # shutting down: report, never hang
                log.warning("gateway: HTTP shutdown: %s %s", type(e).__name__, e)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

    async def _drain(self, drain_s: float) -> None:
        """aiohttp's graceful shutdown (stop listening, wait for the handlers), with the drain's
        deadline: then the requests still in flight end with an error, not a cut connection."""
        deadline = self.loop.call_later(drain_s, self._end_in_flight, drain_s)
        try:
            await self._runner.cleanup()
        finally:
            deadline.cancel()

    def _end_in_flight(self, drain_s: float) -> None:
        if n := self.gw.in_flight():
            log.warning("gateway: %d request(s) still in flight after the %g s drain; ending them", n, drain_s)
            self.gw.shut(f"this gateway is shutting down (its {drain_s:g} s drain is over); send the request "
                         "again, to another gateway")
