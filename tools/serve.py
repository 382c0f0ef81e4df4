"""
nanobatch served live: an OpenAI-compatible server on uvicorn and FastAPI, as vLLM's is, the belt behind it.

    python tools/serve.py --quick                 a tiny random GPT-2, in seconds, on http://127.0.0.1:8000/
    python tools/serve.py --kv-blocks 512 --prefix-cache --host 0.0.0.0 --api-key KEY     GPT-2 124M, for a class

Two actors, a thread each: the engine's runs nanobatch's loop (Part 5: LiveRequests) and never waits on a client;
uvicorn's event loop serves every connection (HTTP parsed by h11, each request checked by pydantic). Between them,
a queue per request, fed from the engine's thread with loop.call_soon_threadsafe(queue.put_nowait, item), as vLLM's
AsyncLLM feeds a request's output collector. docs/api.md has every endpoint and field. On a machine that also runs
the clients, start it with OMP_NUM_THREADS=1: torch's idle threads would spin beside them (docs/labs.md, Lab 12).
"""
import argparse
import asyncio
import codecs
import contextlib
import json
import logging
import reprlib
import resource
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import fastapi
import prometheus_client
import torch
import uvicorn
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
import explore  # noqa: E402 (tools/: the live page draws each step as the recorded page does)
from belt_svg import AXIS_H, GAP, LEFT, RIGHT, STRIP_H, SVG_WIDTH, TITLE_H  # noqa: E402
import nanobatch  # noqa: E402
from nanobatch import EOT, SEED_RANGE, LiveRequests, Request  # noqa: E402

MAX_BODY = 1_000_000  # bytes of a request's body, at most (413 past it)
# OpenAI's fields that nanobatch does not do, each with the values that mean "not asked for".
UNSUPPORTED = {"n": (1,), "best_of": (None, 1), "echo": (False,), "stop": (None, "", []), "suffix": (None, ""),
               "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (None, 1),
               "top_p": (None, 1), "logit_bias": (None, {})}
FINISH_REASONS = {"eos": "stop", "length": "length", "context": "length", "abort": "abort"}  # nanobatch -> OpenAI
PAGE = Path(__file__).resolve().parent / "serve.html"  # the live part of the page at GET /, in explore.html
# A mask's bits in a /steps event, at most (past it, no grid is made or drawn). Measured on GPT-2 124M's shape, four
# prompts of 400-900 tokens in a step: their bits cost the engine's thread 110 ms, 2.9 MB an event; capped, 11 ms
MAX_MASK_CELLS = 2 ** 15
MAX_BEHIND = 10_000  # /steps events a client may leave unread; past them it misses steps (the engine never waits)
GRACE_S = 2  # seconds a stop lets the replies in flight end (each aborted) before it cuts them
KEY_COOKIE = "nanobatch-key"  # the page's proof that its browser gave the API key (never the key itself)
prometheus_client.disable_created_metrics()  # no "_created" twin beside each counter: /metrics shows what counts


# ---------------------------------------------------------------------------------------------
# The protocol: what a completion request may hold (a pydantic model), the errors, the replies' parts


class ApiError(Exception):
    """An error reply: its HTTP status and OpenAI's error object."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def response(self, headers=None):
        return JSONResponse(self.body, self.status, headers)


class CompletionRequest(BaseModel):
    """POST /v1/completions' body as vLLM's CompletionRequest has it: OpenAI's fields, and vLLM's top_k, ignore_eos
    and return_token_ids. Strict ("stream": 0 and "n": 1.0 are refused); null is a field's default; other fields
    are ignored, as vLLM ignores them. What only the engine knows (the vocabulary, the cache) it checks at submit."""
    model_config = ConfigDict(strict=True, extra="ignore")
    prompt: str | list[int]  # a text (GPT-2's tokenizer), or its token ids
    model: str | None = None
    max_tokens: int = Field(16, ge=1)  # 16: OpenAI's default
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)  # OpenAI's default; 0 is greedy
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: every token, as vLLM takes them (the engine's None)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # None: the server's --seed + request index
    ignore_eos: bool = False  # on through EOS to max_tokens, as vLLM's (and its benchmark's)
    logprobs: int | None = Field(None, ge=0, le=20)  # the sampled token's and the top k: 20 as vLLM's --max-logprobs
    stream: bool = False
    stream_options: dict[str, bool] | None = None  # {"include_usage": true}: the usage as a last chunk
    return_token_ids: bool = False  # vLLM's: token_ids in each choice (offline, always: the text is empty)
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    top_p: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("max_tokens", "temperature", "stream", "return_token_ids", "ignore_eos", "echo", "n",
                     "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def null_is_default(cls, value, info):  # as OpenAI reads a null
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("prompt", mode="before")
    @classmethod
    def one_prompt(cls, prompt):
        if prompt in (None, "", []):
            raise PydanticCustomError("empty", "prompt is missing or empty: give a string, or a list of token ids")
        if isinstance(prompt, list) and all(isinstance(item, (str, list)) for item in prompt):
            raise PydanticCustomError("several", "prompt holds several prompts: send one prompt per request")
        if not (isinstance(prompt, str) or isinstance(prompt, list) and all(type(t) is int for t in prompt)):
            raise PydanticCustomError("prompt", "prompt must be a string or a list of token ids (integers)")
        return prompt

    @field_validator(*UNSUPPORTED)
    @classmethod
    def left_out(cls, value, info):
        if value not in UNSUPPORTED[info.field_name]:
            raise PydanticCustomError("unsupported_parameter", f"{info.field_name}={json.dumps(value)[:80]} is "
                                      f"not supported by nanobatch (leave it out)")
        return value


async def error_reply(http, error):
    """Every error in OpenAI's shape: ours (an ApiError); pydantic's first complaint about a body, naming its field
    (param: a top-level field); starlette's (no such path or method, a body that Python's json cannot parse)."""
    if isinstance(error, HTTPException):
        path, allowed = http.url.path, (error.headers or {}).get("Allow")
        message, code = {404: (f"no such path: {path}", "not_found"), 405: (f"{path} takes {allowed}, not "
                                                                            f"{http.method}", "method_not_allowed")
                         }.get(error.status_code, (f"the body is not valid JSON: {error.__cause__!r}", "invalid_json"))
        error = ApiError(error.status_code, message, code=code)
    elif not isinstance(error, ApiError):
        first = error.errors()[0]
        kind, where = first["type"], first["loc"][1:]  # loc: ("body", field, ...), or ("body", a place in the JSON)
        param = where[0] if where and isinstance(where[0], str) else None
        if kind == "json_invalid":
            message = f"the body is not valid JSON: {first['ctx']['error']}"
        elif kind in ("empty", "several", "prompt", "unsupported_parameter"):  # ours: whole sentences already
            message = first["msg"]
        else:
            message = f"{param or 'the body'}: {first['msg']}, got {reprlib.repr(first['input'])}"
        codes = {"empty": "missing_required_parameter", "missing": "missing_required_parameter",
                 "unsupported_parameter": "unsupported_parameter", "json_invalid": "invalid_json"}
        error = ApiError(400, message, param, codes.get(kind, "invalid_value"))
    return error.response()


class Detokenizer:
    """Token ids to text, a piece at a time, never splitting a character: a GPT-2 token may end in the middle
    of a UTF-8 character, whose bytes then wait for the next token. EOS ends a text and is not part of it."""

    def __init__(self, tokenizer):
        self.tokenizer, self.utf8 = tokenizer, codecs.getincrementaldecoder("utf-8")("replace")

    def text(self, token, is_last):  # the text that token completes (token None: none)
        if self.tokenizer is None:  # offline: the answer is its token_ids only
            return ""
        data = b"" if token is None or token == EOT else self.tokenizer.decode_single_token_bytes(token)
        return self.utf8.decode(data, final=is_last)

    def name(self, token):  # a token alone, as logprobs names it (vLLM's way): its text, or offline token_id:ID
        return f"token_id:{token}" if self.tokenizer is None else self.tokenizer.decode([token])


def logprobs_json(detokenizer, pieces, k, first_offset=0):
    """OpenAI's logprobs object of the completions API, in vLLM's shape: each token's name, its logprob, the top k
    (the sampled token first), and where each token's text begins. pieces: (token, log_softmax of its row (V,))."""
    names = [detokenizer.name(token) for token, _ in pieces]
    chosen = [max(logprobs[token].item(), -9999.0) for token, logprobs in pieces]  # vLLM's floor: JSON has no -inf
    tops = [logprobs.topk(k) for _, logprobs in pieces]  # each (k,) values, (k,) token ids
    return {"text_offset": (first_offset + torch.tensor([0, *map(len, names)]).cumsum(0)[:-1]).tolist(),
            "token_logprobs": chosen, "tokens": names,
            "top_logprobs": [{name: logprob, **{detokenizer.name(i): max(v, -9999.0) for i, v in zip(
                top.indices.tolist(), top.values.tolist())}} for name, logprob, top in zip(names, chosen, tops)]}


def step_event(report, name, requests, tokenizer):
    """A StepReport as the /steps event, each request named by name(request index): its completion id. `explore`:
    the step as explore.py records it, for the live page; `requests`: {index: letter, colour, prompt length, id}."""
    return {
        "step": report.step, "belt": report.belt, "n_slots": len(report.belt),
        "occupants": [None if i is None else name(i) for i in report.occupants],
        "letters": {name(i): nanobatch.letter(i) for i in report.occupants if i is not None},
        "admitted": [name(i) for i in report.admitted], "sampled": [name(i) for i in report.sampled],
        "finished": [name(i) for i, _ in report.finished],
        "finish_reasons": {name(i): FINISH_REASONS[c.finish_reason] for i, c in report.finished},
        "preempted": [name(i) for i in report.preempted], "waiting": [name(i) for i in report.waiting],
        "n_prompt_tokens": report.n_prompt_tokens, "kv_used": report.kv_used, "kv_total": report.kv_total,
        "step_ms": round(1e3 * report.step_s, 3), "model_ms": round(1e3 * report.model_s, 3),
        "explore": explore.step_data(report, explore.occupants([report]), tokenizer, MAX_MASK_CELLS),
        "requests": requests}


def usage(request, n_completion):  # OpenAI's usage object
    return {"prompt_tokens": len(request.prompt), "completion_tokens": n_completion,
            "total_tokens": len(request.prompt) + n_completion}


def event(body):  # one server-sent event: a JSON body, or [DONE]
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


# ---------------------------------------------------------------------------------------------
# The engine and what it tells: the live belt, the metrics, the logprobs, and each step for /steps


class Engine:
    """The engine's thread (a LiveRequests), and what the event loop reads of it, which on_step makes each step."""

    def __init__(self, model, tokenizer, model_name, args):
        self.model, self.tokenizer, self.model_name, self.max_len = model, tokenizer, model_name, args.max_len
        self.max_waiting, self.api_key, self.seed = args.max_waiting, args.api_key, args.seed
        self.live = LiveRequests(model, n_slots=args.slots, max_len=args.max_len, eos_id=EOT, policy=args.policy,
                                 prefill_chunk=args.prefill_chunk, kv_blocks=args.kv_blocks,
                                 kv_block_size=args.kv_block_size, prefix_cache=args.prefix_cache,
                                 on_step=self.on_step)
        self.boot = uuid.uuid4().hex[:12]  # completion ids are this server's own: cmpl-BOOT-INDEX
        self.cookie = secrets.token_urlsafe(32)  # what a browser that gave the key holds instead (Door)
        self.lock = threading.Lock()  # guards the next five, written by the event loop's thread and the engine's
        self.prompt_lengths = {}  # request index -> prompt tokens, until its first token is counted
        self.queued = set()  # request indices submitted and not in a slot: the queue --max-waiting limits
        self.logprobs_to = {}  # request index -> where its logprobs go, for the requests that asked for them
        self.shown = {}  # request index -> the page's data of it (letter, colour, prompt length, id), in flight
        self.is_stopping = False
        self.watchers, self.loop = [], None  # an asyncio queue per /steps client, and their event loop
        self.registry = CollectorRegistry()  # this server's own, not the process's: a test starts several
        kinds = {"num_requests_running": (Gauge, "Requests in a slot of the belt."),
                 "num_requests_waiting": (Gauge, "Requests waiting for a slot."),
                 "kv_cache_usage_perc": (Gauge, "KV-cache usage: the share of its positions holding a request's "
                                                "keys (1 means 100 percent)."),
                 "prompt_tokens": (Counter, "Prompt tokens of requests that made their first token."),
                 "generation_tokens": (Counter, "Tokens generated."),
                 "num_preemptions": (Counter, "Requests preempted (paged).")}  # vLLM's names, vllm: -> nanobatch:
        self.metrics = {name: kind(f"nanobatch:{name}", meaning, ["model_name"], registry=self.registry)
                        .labels(model_name) for name, (kind, meaning) in kinds.items()}
        self.metrics["num_requests_waiting"].set_function(lambda: len(self.queued))
        success = Counter("nanobatch:request_success", "Requests finished, by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.finished = {reason: success.labels(model_name, reason) for reason in ("stop", "length", "abort")}

    def check_serving(self):  # an ApiError once the engine has failed or the server stops: /health's, a POST's
        if self.live.error:
            raise ApiError(500, f"the engine has failed: {self.live.error!r}", code="engine_error", kind="server_error")
        if self.is_stopping:
            raise ApiError(503, "the server is shutting down", code="unavailable", kind="server_error")

    def completion_id(self, request_index):
        return f"cmpl-{self.boot}-{request_index}"

    def request_of(self, body):
        """A CompletionRequest -> the engine's Request; or an ApiError: another model's name, a text prompt
        offline, stream_options without a stream, or a prompt and max_tokens longer than --max-len together."""
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist: this server serves `{self.model_name}`.",
                           "model", "model_not_found")
        if isinstance(body.prompt, str) and self.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer (tiktoken's GPT-2 files could not be had offline): "
                                "send the prompt as a list of token ids", "prompt", "tokenizer_unavailable")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options applies to a stream only: give stream=true", "stream_options")
        prompt = body.prompt if isinstance(body.prompt, list) else \
            self.tokenizer.encode(body.prompt, allowed_special="all")  # "<|endoftext|>" is GPT-2's EOS, as in training
        if len(prompt) + body.max_tokens > self.max_len:  # refused as vLLM refuses it, in its words
            raise ApiError(400, f"This model's maximum context length is {self.max_len} tokens. However, you "
                                f"requested {len(prompt) + body.max_tokens} tokens ({len(prompt)} in the prompt, "
                                f"{body.max_tokens} in the completion). Please reduce the length of the prompt or "
                                f"completion.", "max_tokens", "invalid_value")
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else None  # vLLM's -1 (or 0): every token
        return Request(prompt, body.max_tokens, body.temperature, top_k, body.seed, ignore_eos=body.ignore_eos)

    def submit(self, request, put, wants_logprobs):
        """request onto the belt's queue, its items handed to put in the engine's thread -> its Stream; or an ApiError:
        shutting down, the queue full, or what the engine refuses (an id outside the vocabulary, too small a pool)."""
        with self.lock:  # the engine's on_step waits, so that it meets this request's bookkeeping whole
            self.check_serving()
            if self.max_waiting is not None and len(self.queued) >= self.max_waiting:
                raise ApiError(429, f"{len(self.queued)} requests wait for a slot already (--max-waiting "
                               f"{self.max_waiting}): try again later", code="rate_limit_exceeded", kind="requests")
            if request.seed is None:  # --seed's promise: the server's request i samples with seed + i
                request = replace(request, seed=(self.seed + self.live.n_submitted) % 2 ** 64)
            try:
                stream = self.live.submit(request, on_item=put)
            except ValueError as e:
                raise ApiError(400, str(e), "prompt", "invalid_value") from None
            i = stream.request_index
            self.queued.add(i)
            self.prompt_lengths[i] = len(request.prompt)
            self.shown[i] = dict(explore.request_data(i, request), id=self.completion_id(i))
            if wants_logprobs:
                self.logprobs_to[i] = put
        return stream

    def on_step(self, report):
        """One engine step, in the engine's thread: the metrics, the logprobs asked for, the /steps event."""
        metrics, leaving = self.metrics, {i for i, _ in report.finished}
        with self.lock:
            named = {i for i in report.occupants if i is not None} | {*report.waiting, *leaving}  # a cancel: leaving
            requests = {i: self.shown[i] for i in named}  # each /steps event says who it names
            for i in report.sampled:  # vLLM counts a prompt's tokens when its first token comes
                metrics["prompt_tokens"].inc(self.prompt_lengths.pop(i, 0))
            metrics["generation_tokens"].inc(len(report.sampled))
            metrics["num_preemptions"].inc(len(report.preempted))
            for i, completion in report.finished:
                self.finished[FINISH_REASONS[completion.finish_reason]].inc()
                self.prompt_lengths.pop(i, None)  # cancelled before its first token
                del self.shown[i]
            self.queued -= {*report.admitted, *leaving}
            self.queued |= set(report.preempted)
            # The belt as the next step finds it, once phase 7 has retired the step's finished requests.
            metrics["num_requests_running"].set(sum(i is not None and i not in leaving for i in report.occupants))
            metrics["kv_cache_usage_perc"].set(report.kv_used_after / report.kv_total)
            wanted = [(row, self.logprobs_to[i]) for row, i in enumerate(report.sampled) if i in self.logprobs_to]
            for i in leaving:
                self.logprobs_to.pop(i, None)
        if wanted:  # from the very logits the step sampled from: raw (before temperature and top-k), as vLLM's
            rows = report.logits[[row for row, _ in wanted]]  # (R', V)
            logprobs = torch.log_softmax(rows.to(torch.promote_types(rows.dtype, torch.float32)), dim=-1)
            for row, (_, put) in zip(logprobs.cpu(), wanted):  # a copy on the host: the event loop never waits on a GPU
                put(row.clone())  # its own row, not a view that keeps the step's (R', V) alive
        if self.watchers:  # no one reads /steps: no event made, the engine pays for it only while it is read
            data = event(step_event(report, self.completion_id, requests, self.tokenizer))
            for watcher in [watcher for watcher in self.watchers if watcher.qsize() < MAX_BEHIND]:
                self.loop.call_soon_threadsafe(watcher.put_nowait, data)

    async def steps(self):
        """/steps: each step's event, until the client goes or the server stops (None comes)."""
        self.loop, watcher = asyncio.get_running_loop(), asyncio.Queue()
        self.watchers.append(watcher)
        try:
            while (step := await watcher.get()) is not None:
                yield step
        finally:
            self.watchers.remove(watcher)


class Answer:
    """A request on the belt, as the event loop sees it: the engine's thread hands each item over onto an asyncio
    queue of its own (call_soon_threadsafe): (token, finish_reason) from its Stream (Part 5's on_item), the token's
    logprobs (if asked) from on_step, or the engine's error. A task beside the handler awaits the client's
    http.disconnect (vLLM's with_cancellation) and cancels the request, which leaves the belt at the next step."""

    def __init__(self, engine, request, wants_logprobs, http):
        loop, self.items, self.wants_logprobs = asyncio.get_running_loop(), asyncio.Queue(), wants_logprobs
        self.stream = engine.submit(request, lambda item: loop.call_soon_threadsafe(self.items.put_nowait, item),
                                    wants_logprobs)
        self.listener = asyncio.ensure_future(self.cancel_when_gone(http))

    async def cancel_when_gone(self, http):  # uvicorn says "disconnect" once a reply has ended, too: then the
        while (await http.receive())["type"] != "http.disconnect":  # request has finished, and cancel does nothing
            pass
        self.stream.cancel()

    async def next_item(self):
        item = await self.items.get()
        if isinstance(item, BaseException):  # the engine failed
            raise ApiError(500, f"the engine failed: {item!r}", code="engine_error", kind="server_error")
        return item

    async def __aiter__(self):  # -> (token, finish_reason, logprobs or None), the last with its reason
        finish_reason = None
        while finish_reason is None:
            token, finish_reason = await self.next_item()
            yield token, finish_reason, await self.next_item() if self.wants_logprobs and token is not None else None


# ---------------------------------------------------------------------------------------------
# The HTTP side: FastAPI on uvicorn's event loop, which only submits, reads and cancels


class Door:
    """What a request must show before any route reads its body (a middleware, as vLLM checks its API key); refused,
    its connection closes, the body unread. With --api-key, the key, on every route but /health and /metrics; GET /
    without it is KEY_PAGE, which asks for it once (docs/api.md says why a cookie). A POST's body: JSON (415
    otherwise: a form or text/plain is what another site's page may send unasked), its size in Content-Length (a
    chunked body is refused), at most MAX_BODY (413). A length and chunks both: 400 (RFC 9112, 6.1: smuggling)."""

    def __init__(self, app, engine):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        refusal = self.refusal(fastapi.Request(scope)) if scope["type"] == "http" else None
        await (self.app if refusal is None else refusal)(scope, receive, send)

    def refusal(self, http):
        """The response that refuses this request, or None."""
        engine, headers, path, length = self.engine, http.headers, http.url.path, http.headers.get("content-length")
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        scheme, _, key = headers.get("authorization", "").partition(" ")  # the scheme in any case, as HTTP has it
        # Each compared in constant time (compare_digest): no reply's timing tells a byte of them.
        has_key = engine.api_key is None or scheme.lower() == "bearer" and secrets.compare_digest(
            key.strip().encode(), engine.api_key.encode())
        has_cookie = secrets.compare_digest(http.cookies.get(KEY_COOKIE, "").encode(), engine.cookie.encode())
        if path not in ("/health", "/metrics") and not (has_key or has_cookie):
            if path == "/":
                return HTMLResponse(KEY_PAGE, 401, {"Connection": "close"})
            error = ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key")
        elif "transfer-encoding" in headers and length is not None:
            error = ApiError(400, "a request with Transfer-Encoding and Content-Length both", code="bad_request")
        elif http.method != "POST":
            return None
        elif media_type != "application/json":
            error = ApiError(415, f"a POST's body must be application/json, not {media_type or 'untyped'}",
                             code="unsupported_media_type")
        elif length is None:
            error = ApiError(400, "a POST needs a Content-Length header with the body's size (chunks are refused)",
                             code="bad_request")
        elif int(length) > MAX_BODY:  # h11 has checked that it is one number
            error = ApiError(413, f"the body has {length} bytes, over {MAX_BODY}", code="request_too_large")
        else:
            return None
        return error.response({"Connection": "close"})


KEY_PAGE = """<!doctype html><meta charset="utf-8"><title>nanobatch: API key</title>
<form id="form" style="font: 15px sans-serif; margin: 2em">This server needs its API key (--api-key):
  <input type="password" id="key" autofocus> <button>open</button> <span id="said"></span></form>
<script>form.onsubmit = async (event) => {  // the key, sent once as the API takes it: the reply's cookie lets us in
  event.preventDefault();
  const reply = await fetch("/", {headers: {Authorization: `Bearer ${key.value}`}});
  if (reply.ok) location.reload(); else said.textContent = "wrong key";
};</script>
"""


def app_of(engine):
    """The server's FastAPI application, serving engine."""
    app = fastapi.FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # docs/api.md is the documentation
    app.add_middleware(Door, engine=engine)
    for kind in (ApiError, fastapi.exceptions.RequestValidationError, HTTPException):
        app.add_exception_handler(kind, error_reply)  # async: on the event loop, no thread for an error

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: fastapi.Request):
        request = engine.request_of(body)
        answer = Answer(engine, request, body.logprobs is not None, http)
        reply = {"id": engine.completion_id(answer.stream.request_index), "object": "text_completion",
                 "created": int(time.time()), "model": engine.model_name}
        with_ids = body.return_token_ids or engine.tokenizer is None  # offline, token_ids carries the answer
        detokenizer = Detokenizer(engine.tokenizer)
        if body.stream:  # X-Request-Id: vLLM's header, so that the page knows its request while it waits
            return StreamingResponse(chunks(answer, request, reply, detokenizer, with_ids, body),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": reply["id"]})
        pieces = [(token, detokenizer.text(token, reason is not None), lp) async for token, reason, lp in answer]
        completion = answer.stream.completion
        if completion.finish_reason == "abort":  # the server stops (or the client has gone: this goes nowhere)
            raise ApiError(503, "the server is shutting down: the request was aborted", code="unavailable",
                           kind="server_error")
        choice = {"index": 0, "text": "".join(text for _, text, _ in pieces),
                  "finish_reason": FINISH_REASONS[completion.finish_reason], "logprobs": None if body.logprobs is None
                  else logprobs_json(detokenizer, [(token, lp) for token, _, lp in pieces], body.logprobs)}
        if with_ids:
            choice.update(prompt_token_ids=request.prompt, token_ids=completion.tokens)
        return JSONResponse({**reply, "choices": [choice], "usage": usage(request, len(completion.tokens))})

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        card = {"id": engine.model_name, "object": "model", "created": int(time.time()), "owned_by": "nanobatch",
                "max_model_len": engine.max_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        engine.check_serving()
        return Response(media_type="text/plain")

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return Response(prometheus_client.generate_latest(engine.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.api_route("/steps", methods=["GET", "HEAD"])
    async def steps(http: fastapi.Request):  # HEAD: the headers alone, not a stream that never ends
        return StreamingResponse(engine.steps() if http.method == "GET" else iter(()),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.api_route("/", methods=["GET", "HEAD"])
    async def page():  # tools/explore.html fed live: its data, a run with no step yet (the page fills it from
        # /steps) and, as `live`, what this server serves; in its belts' place, the live part: tools/serve.html
        options = engine.live.options
        run = ("live", options["n_slots"], options["policy"], options["prefill_chunk"], False, options["kv_blocks"],
               options["prefix_cache"])  # as nanobatch.Shown.runs holds a run
        shown = nanobatch.Shown([], [run], {"live": []}, {}, {"live": []}, engine.tokenizer)
        data = explore.page_data(shown, f"python tools/serve.py: {engine.model_name}, served live")
        data["live"] = dict(model=engine.model_name, max_len=engine.max_len, has_tokenizer=engine.tokenizer is not None,
                            belt=dict(width=SVG_WIDTH, left=LEFT, right=RIGHT, title_h=TITLE_H, gap=GAP,
                                      strip_h=STRIP_H, axis_h=AXIS_H))  # belt_svg.py's sizes, for the belt drawn live
        response = HTMLResponse(explore.filled(data, PAGE.read_text()))
        if engine.api_key is not None:  # this browser gave the key (the Door let it in): the page's requests need it
            response.set_cookie(KEY_COOKIE, engine.cookie, httponly=True, samesite="strict")
        return response

    return app


async def chunks(answer, request, reply, detokenizer, with_ids, body):
    """A stream's server-sent events: a chunk per token (the prompt's ids with the first, if asked), the last with
    its finish reason; the usage, if asked; then [DONE]. The engine failing midway: an event, as vLLM says it."""
    include_usage, n_tokens, n_chars = (body.stream_options or {}).get("include_usage", False), 0, 0
    try:
        async for token, reason, logprobs in answer:
            text = detokenizer.text(token, reason is not None)
            choice = {"index": 0, "text": text, "finish_reason": reason and FINISH_REASONS[reason], "logprobs": None
                      if logprobs is None else logprobs_json(detokenizer, [(token, logprobs)], body.logprobs, n_chars)}
            if with_ids:  # as vLLM: the prompt's ids with the first chunk
                choice.update(token_ids=[] if token is None else [token],
                              **({"prompt_token_ids": request.prompt} if n_tokens == 0 else {}))
            n_tokens, n_chars = n_tokens + (token is not None), n_chars + len(text)
            yield event({**reply, "choices": [choice], **({"usage": None} if include_usage else {})})
        if include_usage:
            yield event({**reply, "choices": [], "usage": usage(request, n_tokens)})
    except ApiError as error:
        yield event(error.body)
    yield event("[DONE]")


# ---------------------------------------------------------------------------------------------
# Starting and stopping


def load(args):
    """The model and its tokenizer as --demo loads them -> (model, tokenizer or None, its served name)."""
    model = None if args.quick else nanobatch.load_gpt2(args.weights, args.batch_invariant)
    name = "nanobatch-quick" if args.quick else "gpt2-random" if model is None else Path(args.weights or "gpt2").stem
    if model is None and not args.quick:
        print(f"serve: no GPT-2 weights here (offline, none in {nanobatch.default_cache_dir()}): serving a randomly "
              f"initialised GPT-2 124M, whose answers are noise", file=sys.stderr)
    model = nanobatch.seeded_model(args) if model is None else model.to(args.device, args.dtype).eval()
    tokenizer = nanobatch.load_tokenizer(model)
    if tokenizer is None:
        print("serve: no tokenizer (tiktoken's files offline): prompts are ids, answers token_ids", file=sys.stderr)
    return model, tokenizer, name


def start(args):
    """Load, start the engine's thread, then uvicorn's (its loggers as the process has them; signals are serve()'s)
    -> the Engine, serving: its uvicorn.Server engine.server, its address engine.address (--port 0: a free one)."""
    model, tokenizer, name = load(args)
    args.max_len = args.max_len or model.config.block_size
    engine = Engine(model, tokenizer, args.served_model_name or name, args)
    try:
        engine.live.__enter__()  # the engine's thread; a bad option raises here, before any request
    except ValueError as e:
        nanobatch.fail(e)
    engine.server = uvicorn.Server(uvicorn.Config(
        app_of(engine), host=args.host, port=args.port, http="h11", lifespan="off", log_config=None,
        limit_concurrency=args.limit_concurrency, timeout_keep_alive=args.timeout_keep_alive,
        timeout_graceful_shutdown=GRACE_S))
    engine.http_thread = threading.Thread(target=engine.server.run, name="nanobatch http", daemon=True)
    engine.http_thread.start()
    while not engine.server.started and engine.http_thread.is_alive():  # uvicorn binds its socket, then serves
        time.sleep(0.01)
    if not engine.server.started:
        engine.live.close(abort=True)
        nanobatch.fail(f"cannot serve on {args.host}:{args.port} (uvicorn's reason is above)")
    engine.address = engine.server.servers[0].sockets[0].getsockname()[:2]
    return engine


def stop(engine):
    """Ctrl-C or SIGTERM: take no more requests, abort those in flight (their streams end abort, [DONE]), end /steps;
    then uvicorn closes each connection as its reply ends, or after GRACE_S (a client that reads nothing)."""
    with engine.lock:
        engine.is_stopping = True
    engine.live.close(abort=True)
    for watcher in list(engine.watchers):  # the engine's thread has ended: no step comes after this
        engine.loop.call_soon_threadsafe(watcher.put_nowait, None)
    engine.server.should_exit = True  # uvicorn looks every 0.1 s
    engine.http_thread.join(timeout=GRACE_S + 5)


def addresses(host, port):
    """Where a browser finds the server: its --host; or for 0.0.0.0, which no browser opens, this machine's addresses
    that others reach, then 127.0.0.1."""
    if host != "0.0.0.0":
        return [f"http://{f'[{host}]' if ':' in host else host}:{port}/"]
    found = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # sends nothing: the system picks the address that a route out would use
        found.append(probe.getsockname()[0])
    return [f"http://{address}:{port}/" for address in found + ["127.0.0.1"]]


def serve(args):
    """start, print where it serves (an address a line), serve until SIGINT or SIGTERM, stop -> 0."""
    logging.basicConfig(level=logging.INFO, format="serve: %(message)s", stream=sys.stderr)  # uvicorn's lines
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a socket a connection: room for --limit-concurrency
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.limit_concurrency + 256)), hard))
    engine = start(args)  # Ctrl-C while it loads: KeyboardInterrupt, caught in main
    stop_asked = threading.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, lambda *_: stop_asked.set())
    try:
        print("\n".join(addresses(args.host, engine.address[1])), flush=True)
        if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"serve: WARNING: no --api-key, on {args.host}: anyone who reaches this machine can send prompts, "
                  f"and read every prompt and answer at /steps", file=sys.stderr, flush=True)
        while not stop_asked.wait(0.1):  # a signal sets it; the timeout keeps the main thread able to take one
            pass
        print("serve: stopping: aborting the requests in flight", file=sys.stderr, flush=True)
    finally:
        stop(engine)
    return 0


def parse(argv=None):
    """The command line -> its options: the engine's as --demo spells them, and the server's own."""
    parser = argparse.ArgumentParser(prog="tools/serve.py", description="nanobatch as an OpenAI-compatible server.")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (127.0.0.1; a class: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000, help="the port (8000; 0 takes a free one)")
    parser.add_argument("--max-waiting", type=nanobatch.positive(int), metavar="N", default=None,
                        help="at most N requests wait for a slot; past it, 429 (no limit)")
    parser.add_argument("--api-key", metavar="KEY", default=None, help="every route but /health and /metrics needs "
                        "Authorization: Bearer KEY; the page asks for it once")
    parser.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (gpt2, offline "
                        "gpt2-random, --quick nanobatch-quick)")
    parser.add_argument("--seed", type=int, default=0, help="the random model's weights (--quick, or offline), and "
                        "each request that gives no seed: the server's request i (from 0) samples with seed + i (0)")
    parser.add_argument("--limit-concurrency", type=nanobatch.positive(int), metavar="N", default=2048,
                        help="connections at once, at most: past them, 503, as uvicorn's option (2048)")
    parser.add_argument("--timeout-keep-alive", type=float, metavar="S", default=5.0,
                        help="a connection is closed after S seconds without a whole request, as uvicorn's (5)")
    engine_options = nanobatch.SERVING - {"disaggregate", "seed"} | {"prefix_cache", "policy", "weights", "quick"}
    _, args = nanobatch.parse_args(parser, argv, engine_options)  # the seed is the server's own (above)
    return args


def main(argv=None):
    try:
        return serve(parse(argv))
    except KeyboardInterrupt:  # before it served: nothing to stop
        return 130


if __name__ == "__main__":
    sys.exit(main())
