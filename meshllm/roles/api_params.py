"""An OpenAI request body (`json_body`: its bytes) -> what the mesh is asked to do (`Params`), or
the 4xx that says why not (`ApiError`). Pure checks: the served model's name, tokenizer and
context come from the gateway.
roles/http_api.py serves the API with them."""

from __future__ import annotations

import codecs
import json
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from meshllm.defaults import MAX_REQUEST_TOKENS
from meshllm.mesh.fields import MAX_TEMPERATURE

if TYPE_CHECKING:
    from meshllm.roles.gateway import Gateway

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP = 4


def _number_at(value: float):
    """A no-op check: absent, null or the number `value` (true and false are not 1 and 0 here)."""
    return lambda v: v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and v == value)


# OpenAI request fields not implemented here -> whether a value asks for nothing (else a 400)
NO_OP = {
    "presence_penalty": _number_at(0), "frequency_penalty": _number_at(0),
    "logit_bias": lambda v: not v, "top_logprobs": _number_at(0),
    "logprobs": lambda v: v is None or v is False,  # (0 == False, but logprobs 0 asks for the chosen tokens')
    "echo": lambda v: v in (None, False), "best_of": _number_at(1), "suffix": lambda v: not v,
    "tools": lambda v: not v, "functions": lambda v: not v, "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"), "response_format": lambda v: v in (None, {"type": "text"}),
    "modalities": lambda v: v in (None, ["text"]), "audio": lambda v: v is None,
    "prediction": lambda v: v is None, "reasoning_effort": lambda v: v is None, "verbosity": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    # vLLM's sampling extensions, at their defaults
    "min_tokens": _number_at(0), "ignore_eos": lambda v: v in (None, False),
    "repetition_penalty": _number_at(1), "min_p": _number_at(0),
}
# what a request may carry that asks nothing of the output (OpenAI's bookkeeping), taken and dropped
BOOKKEEPING = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
               "parallel_tool_calls"}  # (no tools are taken: how to call them does not matter)
# the fields read here, besides the prompt ("prompt" for /v1/completions, "messages" for chat)
READ = {"model", "max_tokens", "max_completion_tokens", "n", "stop", "stream", "stream_options", "temperature",
        "top_p", "top_k", "seed", "meshllm"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


@dataclass(frozen=True)
class Params:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    spec_mode: str | None = None  # meshllm extension: override the cluster's speculation mode
    gamma: int | None = None
    decode_replica: int | None = None
    adaptive: bool | None = None
    resume: tuple[int, ...] = ()  # meshllm extension: the output a client already has (from a gateway that died)


def _number(body: dict, key: str, default: float, lo: float, hi: float, integer: bool = False,
            within: str = "", above_lo: bool = False) -> Any:
    """body[key] (`default` if absent or null) in [lo, hi] ((lo, hi] with `above_lo`), else a 400
    naming it (`within`: the object it sits in, e.g. "meshllm.", so that an extension's field is
    told from a top-level one)."""
    v = body.get(key, default)
    if v is None:
        v = default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not lo <= v <= hi or (above_lo and v == lo):
        kind, span = ("an integer", f"[{lo}, {hi}]") if integer else ("a number", f"[{lo:g}, {hi:g}]")
        span = f"({span[1:]}" if above_lo else span
        raise ApiError(400, f"'{within}{key}' must be {kind} in {span}, got {v!r}", within + key, "invalid_value")
    return v


def parse_params(body: Any, gw: Gateway, chat: bool) -> Params:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_body")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required and must be a string", "model", "invalid_value")
    if model != gw.model_name:
        raise ApiError(404, f"model {model!r} is not served here; this mesh serves {gw.model_name!r}", "model",
                       "model_not_found")
    unknown = sorted(set(body) - READ - BOOKKEEPING - set(NO_OP) - {"messages" if chat else "prompt"}, key=str)
    if unknown:  # a typo, or another server's extension: ignoring it would not give what was asked
        hint = (" (chat takes 'messages')" if "prompt" in unknown else
                " (/v1/completions takes 'prompt')" if "messages" in unknown else "")
        raise ApiError(400, f"unrecognized request argument{'s' * (len(unknown) > 1)}: "
                            f"{', '.join(repr(k) for k in unknown[:8])}{hint}", unknown[0], "unknown_parameter")
    if gw.model.tokenizer is None:  # a gateway without the model file, its header not fetched yet
        raise ApiError(503, f"this gateway has no tokenizer yet: {gw.model.error}", None, "unavailable")
    ids = _chat_ids(body, gw) if chat else _prompt_ids(body, gw)
    if len(ids) >= gw.model.max_context:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context holds {gw.model.max_context}",
                       "messages" if chat else "prompt", "context_length_exceeded")
    for key, no_op in NO_OP.items():
        if not no_op(body.get(key)):
            raise ApiError(400, f"'{key}' is not supported by this server (got {body[key]!r:.80})", key,
                           "unsupported_parameter")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if key == "max_completion_tokens" and body.get("max_tokens") not in (None, body[key]):
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", key, "invalid_value")
    max_tokens = _number(body, key, DEFAULT_MAX_TOKENS if not chat else gw.model.max_context, 1, MAX_REQUEST_TOKENS,
                         integer=True)
    if not _number_at(1)(body.get("n")):
        raise ApiError(400, "only n=1 is supported", "n", "invalid_value")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP or not all(isinstance(x, str) and x for x in stop):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP}", "stop",
                       "invalid_value")
    stream = False if body.get("stream") is None else body["stream"]  # null: the default, as for every field
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream", "invalid_value")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict) or set(opts) - {"include_usage"}
                             or not isinstance(opts.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' is {include_usage: bool}, with stream: true", "stream_options",
                       "invalid_value")
    ext = {} if body.get("meshllm") is None else body["meshllm"]
    mode, gamma, pin, adaptive = _extension(ext)
    ctx = gw.ctx
    if pin is not None and ctx is not None and pin not in (decoders := ctx.decoders()):
        raise ApiError(400, f"meshllm.decode_replica {pin}: plan v{ctx.version} has no decode or mixed replica "
                            f"{pin} (those it has: {decoders})", "meshllm.decode_replica", "invalid_value")
    max_tokens = min(max_tokens, gw.model.max_context - len(ids))
    return Params(ids, max_tokens, float(_number(body, "temperature", 1.0, 0, MAX_TEMPERATURE)),
                  _number(body, "top_k", 0, 0, 1 << 31, integer=True), float(_number(body, "top_p", 1.0, 0, 1, above_lo=True)),
                  # no seed: a fresh one, so two such requests are two samples (OpenAI's behaviour)
                  secrets.randbits(63) if body.get("seed") is None else
                  _number(body, "seed", 0, -(1 << 63), (1 << 63) - 1, integer=True), tuple(stop), stream,
                  bool((opts or {}).get("include_usage")), mode, gamma, pin, adaptive,
                  _resume(ext.get("resume_token_ids"), gw, max_tokens))


def _resume(ids: Any, gw: Gateway, max_tokens: int) -> tuple[int, ...]:
    """`meshllm.resume_token_ids`: the output tokens a client already has of this request (its
    gateway died mid-stream); the request goes on after them, as the gateway's own resume does
    (seeded sampling included): only the tokens after them are generated and sent."""
    if ids is None:
        return ()
    vocab, eos = gw.model.vocab, set(gw.model.tokenizer.eos_ids)
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < (vocab or 1 << 31) for t in ids):
        raise ApiError(400, "meshllm.resume_token_ids must be a list of token ids of this model's vocabulary",
                       "meshllm.resume_token_ids", "invalid_value")
    if len(ids) >= max_tokens:
        raise ApiError(400, f"meshllm.resume_token_ids has {len(ids)} tokens: max_tokens ({max_tokens} here) leaves "
                            "none to generate after them", "meshllm.resume_token_ids", "invalid_value")
    if eos & set(ids):
        raise ApiError(400, "meshllm.resume_token_ids holds an end-of-sequence token: that output is complete",
                       "meshllm.resume_token_ids", "invalid_value")
    return tuple(ids)


def _extension(ext: Any) -> tuple[str | None, int | None, int | None, bool | None]:
    """The `meshllm` field: (speculation mode, gamma, decode replica, adaptive), None where not given."""
    takes = "'meshllm' takes speculation, gamma, adaptive, decode_replica and resume_token_ids"
    if not isinstance(ext, dict):
        raise ApiError(400, f"{takes}: an object, got {type(ext).__name__}", "meshllm", "invalid_value")
    unknown = sorted(set(ext) - {"speculation", "gamma", "adaptive", "decode_replica", "resume_token_ids"})
    if unknown:  # named, as a top-level one is
        raise ApiError(400, f"unrecognized request argument{'s' * (len(unknown) > 1)}: "
                            f"{', '.join(repr(f'meshllm.{k}') for k in unknown[:8])} ({takes})",
                       f"meshllm.{unknown[0]}", "unknown_parameter")
    adaptive = ext.get("adaptive")
    if adaptive is not None and not isinstance(adaptive, bool):
        raise ApiError(400, "meshllm.adaptive must be true or false", "meshllm.adaptive", "invalid_value")
    mode = ext.get("speculation")
    if mode not in (None, "async", "sync", "off"):
        raise ApiError(400, "meshllm.speculation must be async, sync or off", "meshllm.speculation", "invalid_value")
    gamma = None if ext.get("gamma") is None else _number(ext, "gamma", 4, 1, 16, True, "meshllm.")
    pin = None if ext.get("decode_replica") is None else _number(ext, "decode_replica", 0, 0, 1 << 20, True, "meshllm.")
    return mode, gamma, pin, adaptive


def _prompt_ids(body: dict, gw: Gateway) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        ids = gw.model.tokenizer.encode(p)
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        if not all(0 <= x < gw.model.vocab for x in p):
            raise ApiError(400, f"token ids must be in [0, {gw.model.vocab})", "prompt", "invalid_value")
        ids = list(p)
    else:
        raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids", "prompt",
                       "invalid_value")
    if not ids:
        raise ApiError(400, "the prompt encodes to zero tokens", "prompt", "invalid_value")
    return ids


def _chat_ids(body: dict, gw: Gateway) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "messages", "invalid_value")
    if len(msgs) > gw.model.max_context:  # each renders to a token or more (100 000 took 2.5 s to render)
        raise ApiError(400, f"{len(msgs)} messages; this model's context holds {gw.model.max_context} tokens",
                       "messages", "context_length_exceeded")
    clean = []
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and content and all(
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                for part in content):
            content = "".join(part["text"] for part in content)  # OpenAI's content parts, text only
        role = m.get("role") if isinstance(m, dict) else None
        role = {"developer": "system"}.get(role, role) if isinstance(role, str) else None  # (a list: a 500)
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise ApiError(400, f"messages[{i}] must be {{role: system|developer|user|assistant, content: a string "
                                "or a list of text parts}", f"messages[{i}]", "invalid_value")
        clean.append({"role": role, "content": content})
    try:
        return gw.model.tokenizer.encode(gw.model.tokenizer.render_chat(clean))
    except ValueError as e:  # e.g. no chat template
        raise ApiError(400, str(e), "messages", "invalid_value") from None


def json_body(raw: bytes, charset: str | None) -> object:
    """The request's JSON, or an ApiError 400 naming what is wrong with it (an unknown charset and
    nesting deeper than the parser's stack were a plain-text 500)."""
    try:
        text_codec = getattr(codecs.lookup(charset or "utf-8"), "_is_text_encoding", True)  # not base64, zlib, ...
    except LookupError:
        text_codec = False
    if not text_codec:
        raise ApiError(400, f"Content-Type names an unknown charset {charset!r:.40} (JSON is UTF-8)", None,
                       "invalid_json")
    try:
        return json.loads(raw.decode(charset or "utf-8"))
    except RecursionError:
        raise ApiError(400, "the request body nests JSON arrays or objects too deeply", None,
                       "invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise ApiError(400, "the request body is not valid JSON", None, "invalid_json") from None
