"""
nanobatch served live: an OpenAI-compatible server on Python's standard library, the belt behind it.

    python tools/serve.py --quick                 a tiny random GPT-2, in seconds, on http://127.0.0.1:8000/
    python tools/serve.py --kv-blocks 512 --prefix-cache --host 0.0.0.0      GPT-2 124M, for a class
    curl -N localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 16, "stream": true}'

One engine thread runs nanobatch's loop (Part 5: LiveRequests); an HTTP thread per client only submits, reads
and cancels, so the loop never waits on a client. A client that goes away cancels its request, which leaves
the belt at the next step. Endpoints, named as vLLM's: POST /v1/completions, GET /v1/models, /health, /metrics
(Prometheus), /steps (each engine step, as server-sent events) and / (the live belt, a page). Every error is
OpenAI's shape, {"error": {"message", "type", "param", "code"}}. docs/api.md lists every field. On a machine
that also runs the clients (a load tool, a class's browsers), start it with OMP_NUM_THREADS=1: torch's idle
threads spin beside the HTTP threads (docs/labs.md, Lab 12: at 8 requests a second on 2 cores, a --quick step
3.3 ms with it, 3.5 to 99.9 ms in three runs without).
"""
import argparse
import codecs
import json
import math
import queue
import select
import signal
import socket
import sys
import threading
import time
import uuid
from types import SimpleNamespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
import explore  # noqa: E402 (tools/: the live page draws each step as the recorded page does)
from belt_svg import AXIS_H, GAP, LEFT, RIGHT, STRIP_H, SVG_WIDTH, TITLE_H  # noqa: E402
import nanobatch  # noqa: E402
from nanobatch import EOT, SEED_RANGE, LiveRequests, Request, is_int, letter  # noqa: E402

MAX_BODY = 1_000_000  # bytes of a request's body, at most (413 past it)
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the completions API
# OpenAI's fields that nanobatch does not do, each with the values that mean "not asked for".
UNSUPPORTED = {"n": (1,), "best_of": (1,), "logprobs": (), "echo": (False,), "stop": ("", []), "suffix": ("",),
               "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},)}
FINISH_REASONS = {"eos": "stop", "length": "length", "context": "length", "abort": "abort"}  # nanobatch -> OpenAI
POLL_S = 0.05  # how often a handler waiting for tokens looks whether its client has gone
PAGE = Path(__file__).resolve().parent / "serve.html"  # the live part of the page at GET /, in explore.html
# A mask's bits in a /steps event, at most: past it (a long prompt's chunk: T x L), the page draws no grid and the
# engine's thread makes none. Measured on GPT-2 124M's shape, four prompts of 400-900 tokens in one step: their
# bits cost the engine's thread 110 ms and 2.9 MB an event (and the page millions of cells); capped, 11 ms, 0.3 MB
MAX_MASK_CELLS = 2 ** 15


# ---------------------------------------------------------------------------------------------
# The protocol: what a completion request may hold, and what the replies look like


class ApiError(Exception):
    """An error reply: its HTTP status and OpenAI's error object."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(message, param=None, code="invalid_value"):
    return ApiError(400, message, param, code)


def parse_completion(body, model_name, vocab_size, max_len, tokenizer):
    """A POST /v1/completions body -> (Request, stream, include_usage, return_token_ids), or an ApiError
    that names the field at fault."""
    if not isinstance(body, dict):
        raise bad(f"the body must be a JSON object, got {type(body).__name__}")
    if body.get("model") is not None and body["model"] != model_name:
        raise ApiError(404, f"The model `{body['model']}` does not exist: this server serves `{model_name}`.",
                       "model", "model_not_found")
    for name, defaults in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in defaults:
            raise bad(f"{name}={json.dumps(body[name])} is not supported by nanobatch (leave it out)", name,
                      "unsupported_parameter")
    prompt = prompt_tokens(body.get("prompt"), vocab_size, tokenizer)
    max_tokens = body.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not is_int(max_tokens) or max_tokens < 1:
        raise bad(f"max_tokens must be an integer >= 1, got {json.dumps(max_tokens)}", "max_tokens")
    if len(prompt) + max_tokens > max_len:  # vLLM's words for it
        raise bad(f"This model's maximum context length is {max_len} tokens. However, you requested "
                  f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} in the completion). "
                  f"Please reduce the length of the prompt or completion.", "max_tokens")
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature  # OpenAI's default
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and
            0 <= temperature < math.inf):
        raise bad(f"temperature must be a number >= 0, got {json.dumps(temperature)}", "temperature")
    top_k = body.get("top_k")
    if top_k is not None and not (is_int(top_k) and top_k >= -1):
        raise bad(f"top_k must be an integer >= 1 (0 or -1: all tokens), got {json.dumps(top_k)}", "top_k")
    seed = body.get("seed")
    if seed is not None and not (is_int(seed) and SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise bad(f"seed must be an integer in {SEED_RANGE[0]}..{SEED_RANGE[1]}, got {json.dumps(seed)}", "seed")
    stream, options, return_ids = body.get("stream") or False, body.get("stream_options"), body.get("return_token_ids")
    for name, value in (("stream", stream), ("return_token_ids", return_ids or False)):
        if not isinstance(value, bool):
            raise bad(f"{name} must be true or false, got {json.dumps(value)}", name)
    if options is not None and not (stream and isinstance(options, dict) and
                                    isinstance(options.get("include_usage", False), bool)):
        raise bad("stream_options must be an object such as {\"include_usage\": true}, and only with stream=true",
                  "stream_options")
    request = Request(prompt, max_tokens, float(temperature), top_k if top_k and top_k > 0 else None, seed)
    return request, stream, bool(options and options.get("include_usage")), bool(return_ids)


def prompt_tokens(prompt, vocab_size, tokenizer):
    """A prompt as token ids: a string (encoded with GPT-2's tokenizer), or a list of ids."""
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise bad("this server has no tokenizer (tiktoken's GPT-2 files could not be had offline): send the "
                      "prompt as a list of token ids", "prompt", "tokenizer_unavailable")
        return tokenizer.encode(prompt, allowed_special="all")  # "<|endoftext|>" is GPT-2's EOS, as in training
    if isinstance(prompt, list) and prompt and all(is_int(token) for token in prompt):
        outside = [token for token in prompt if not 0 <= token < vocab_size]
        if outside:
            raise bad(f"prompt has token id {outside[0]}, outside the vocabulary 0..{vocab_size - 1}", "prompt")
        return [int(token) for token in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
        raise bad("prompt holds several prompts: send one prompt per request", "prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise bad("prompt is missing or empty: give a string, or a list of token ids", "prompt",
                  "missing_required_parameter")
    raise bad(f"prompt must be a string or a list of token ids, got {json.dumps(prompt)[:80]}", "prompt")


class Detokenizer:
    """Token ids to text, a piece at a time, never splitting a character: a GPT-2 token may end in the middle
    of a UTF-8 character, whose bytes then wait for the next token. EOS ends a text and is not part of it."""

    def __init__(self, tokenizer):
        self.tokenizer, self.utf8 = tokenizer, codecs.getincrementaldecoder("utf-8")("replace")

    def text(self, token, is_last):
        """The text that token completes (token None: none)."""
        if self.tokenizer is None:  # offline: the answer is its token_ids only
            return ""
        data = b"" if token is None or token == EOT else self.tokenizer.decode_single_token_bytes(token)
        return self.utf8.decode(data, final=is_last)


def step_event(report, name, requests, tokenizer):
    """A StepReport as the /steps event. Its figures name each request by name(request index), its completion
    id, as a client of the API knows it. `explore` is the same step as tools/explore.py records one (its rows,
    masks and cache; requests by index), and `requests` each request the step names, {index: its letter,
    colour, prompt length and completion id}: the live page (GET /) draws a live step with explore.html's own
    render, as it draws a recorded one."""
    return {
        "step": report.step, "belt": report.belt, "n_slots": len(report.belt),
        "occupants": [None if i is None else name(i) for i in report.occupants],
        "letters": {name(i): letter(i) for i in report.occupants if i is not None},
        "admitted": [name(i) for i in report.admitted], "sampled": [name(i) for i in report.sampled],
        "finished": [name(i) for i, _ in report.finished],
        "finish_reasons": {name(i): FINISH_REASONS[c.finish_reason] for i, c in report.finished},
        "preempted": [name(i) for i in report.preempted], "waiting": [name(i) for i in report.waiting],
        "n_prompt_tokens": report.n_prompt_tokens, "kv_used": report.kv_used, "kv_total": report.kv_total,
        "step_ms": round(1e3 * report.step_s, 3), "model_ms": round(1e3 * report.model_s, 3),
        "explore": explore.step_data(report, explore.occupants([report]), tokenizer, MAX_MASK_CELLS),
        "requests": requests}


def named(report):
    """The request indices a StepReport names: in a slot, waiting, or finished (a cancelled one may be neither)."""
    return {i for i in report.occupants if i is not None} | set(report.waiting) | {i for i, _ in report.finished}


def usage(n_prompt, n_completion):
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


# ---------------------------------------------------------------------------------------------
# The engine and what it tells: the live belt, the metrics, and each step for /steps


class Engine:
    """The engine thread (a LiveRequests) and what the HTTP threads read of it. Each step's report arrives
    in on_step, in the engine's thread: it is turned into the /steps event and the metrics, never waited on."""

    def __init__(self, model, tokenizer, model_name, args):
        self.model, self.tokenizer, self.model_name, self.max_len = model, tokenizer, model_name, args.max_len
        self.max_waiting, self.api_key = args.max_waiting, args.api_key
        self.live = LiveRequests(model, n_slots=args.slots, max_len=args.max_len, eos_id=EOT, policy=args.policy,
                                 prefill_chunk=args.prefill_chunk, kv_blocks=args.kv_blocks,
                                 kv_block_size=args.kv_block_size, prefix_cache=args.prefix_cache,
                                 on_step=self.on_step)
        self.boot = uuid.uuid4().hex[:12]  # completion ids are this server's own: cmpl-BOOT-INDEX
        self.lock = threading.Lock()  # guards everything below, written by HTTP threads and the engine's
        self.prompt_lengths = {}  # request index -> prompt tokens, until its first token is counted
        self.queued = set()  # request indices submitted and not in a slot: the queue --max-waiting limits
        self.running, self.kv_usage, self.is_stopping = 0, 0.0, False
        self.block_size = args.kv_block_size if args.kv_blocks else args.max_len  # positions in a block of the cache
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0}
        self.finished = dict.fromkeys(("stop", "length", "abort"), 0)  # request_success_total by finished_reason
        self.watchers = []  # a queue per /steps client: each step's event, as JSON
        self.shown = {}  # request index -> the page's data of it (letter, colour, prompt length, id), in flight
        self.n_replying = 0  # completions whose handler has not ended its reply: stop lets them end it
        self.all_replied = threading.Condition(self.lock)

    def completion_id(self, request_index):
        return f"cmpl-{self.boot}-{request_index}"

    def submit(self, request):
        """request onto the belt's queue -> its Stream, or an ApiError: shutting down, or the queue full."""
        with self.lock:  # the engine's on_step waits, so that it meets this request's bookkeeping whole
            if self.is_stopping or self.live.error:
                raise ApiError(503, "the server is shutting down" if self.is_stopping else
                               f"the engine has failed: {self.live.error!r}", code="unavailable", kind="server_error")
            if self.max_waiting is not None and len(self.queued) >= self.max_waiting:
                raise ApiError(429, f"{len(self.queued)} requests wait for a slot already (--max-waiting "
                               f"{self.max_waiting}): try again later", code="rate_limit_exceeded", kind="requests")
            try:
                stream = self.live.submit(request)
            except ValueError as e:  # what the engine refuses: a pool too small for it, say
                raise bad(str(e), "prompt") from None
            self.queued.add(stream.request_index)
            self.prompt_lengths[stream.request_index] = len(request.prompt)
            self.n_replying += 1  # until its handler calls replied()
            self.shown[stream.request_index] = dict(explore.request_data(stream.request_index, request),
                                                    id=self.completion_id(stream.request_index))
        return stream

    def on_step(self, report):
        """One engine step: the metrics, then its event for every /steps client (in the engine's thread)."""
        ids = self.completion_id
        with self.lock:
            requests = {i: self.shown[i] for i in named(report)}  # each /steps event says who it names
            for i in report.sampled:  # vLLM counts a prompt's tokens when its first token comes
                self.counters["prompt_tokens"] += self.prompt_lengths.pop(i, 0)
            self.counters["generation_tokens"] += len(report.sampled)
            self.counters["num_preemptions"] += len(report.preempted)
            for i, completion in report.finished:
                self.finished[FINISH_REASONS[completion.finish_reason]] += 1
                self.prompt_lengths.pop(i, None)  # cancelled before its first token
                del self.shown[i]
            self.queued -= {*report.admitted, *(i for i, _ in report.finished)}
            self.queued |= set(report.preempted)
            # The belt as the step leaves it, once its finished requests have retired (phase 7): what is held now.
            leaving = {i for i, _ in report.finished}
            staying = [SimpleNamespace(n_cached=n, block_table=table) for i, n, table in zip(
                report.occupants, report.n_cached, report.block_tables) if i is not None and i not in leaving]
            self.running = len(staying)
            self.kv_usage = nanobatch.positions_in_use(staying, self.block_size) / report.kv_total
            watchers = list(self.watchers)
        if not watchers:  # no one reads /steps: no event made, the engine pays for it only while it is read
            return
        event = json.dumps(step_event(report, ids, requests, self.tokenizer))
        for watcher in watchers:
            try:
                watcher.put_nowait(event)
            except queue.Full:  # a client that reads no more: it is dropped, the engine never waits
                self.unwatch(watcher)

    def watch(self):  # a new /steps client's queue
        watcher = queue.Queue(maxsize=10_000)
        with self.lock:
            self.watchers.append(watcher)
        return watcher

    def unwatch(self, watcher):
        with self.lock:
            if watcher in self.watchers:
                self.watchers.remove(watcher)

    def metrics(self):
        """Prometheus' text format, the names vLLM gives them (vllm: -> nanobatch:)."""
        label = f'model_name="{self.model_name}"'
        with self.lock:
            gauges = {"num_requests_running": (self.running, "Requests in a slot of the belt."),
                      "num_requests_waiting": (len(self.queued), "Requests waiting for a slot."),
                      "kv_cache_usage_perc": (self.kv_usage, "KV-cache usage: the share of its positions holding a "
                                                             "request's keys (1 means 100 percent).")}
            counters = dict(self.counters)
            finished = dict(self.finished)
        lines = []
        for name, (value, meaning) in gauges.items():
            lines += [f"# HELP nanobatch:{name} {meaning}", f"# TYPE nanobatch:{name} gauge",
                      f"nanobatch:{name}{{{label}}} {value}"]
        meanings = {"prompt_tokens": "Prompt tokens of requests that made their first token.",
                    "generation_tokens": "Tokens generated.", "num_preemptions": "Requests preempted (paged)."}
        for name, value in counters.items():
            lines += [f"# HELP nanobatch:{name}_total {meanings[name]}", f"# TYPE nanobatch:{name}_total counter",
                      f"nanobatch:{name}_total{{{label}}} {value}"]
        lines += ["# HELP nanobatch:request_success_total Requests finished, by finish reason.",
                  "# TYPE nanobatch:request_success_total counter"]
        lines += [f'nanobatch:request_success_total{{{label},finished_reason="{reason}"}} {n}'
                  for reason, n in finished.items()]
        return "\n".join(lines) + "\n"

    def replied(self):
        """A completion's handler has ended its reply (or given up on its client)."""
        with self.lock:
            self.n_replying -= 1
            self.all_replied.notify_all()

    def stop(self):
        """Ctrl-C or SIGTERM: take no more requests, abort those in flight (their streams end), end /steps."""
        with self.lock:
            self.is_stopping = True
            watchers = list(self.watchers)
        self.live.close(abort=True)
        for watcher in watchers:
            watcher.put(None)


# ---------------------------------------------------------------------------------------------
# The HTTP side: a thread per client, which only submits, reads and cancels


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: each reply says its length (a stream closes its connection)
    timeout = 60  # seconds a silent client holds its thread
    server_version = "nanobatch"
    engine: Engine = None  # set by serve()

    def setup(self):
        super().setup()
        # Each write leaves at once: without this, a reply's body (or a streamed token) that follows its
        # headers waits for the client's acknowledgement, which a client delays by up to 40 ms (Nagle's rule).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def do_other(self):
        self.route(self.command)

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_other

    ROUTES = {"/v1/completions": {"POST": "complete"}, "/v1/models": {"GET": "models"}, "/health": {"GET": "health"},
              "/metrics": {"GET": "send_metrics"}, "/steps": {"GET": "steps"}, "/": {"GET": "page"}}

    def route(self, method):
        path = self.path.split("?")[0]
        try:
            if path not in self.ROUTES:
                raise ApiError(404, f"no such path: {path}", code="not_found")
            if method not in self.ROUTES[path]:
                raise ApiError(405, f"{path} takes {', '.join(self.ROUTES[path])}, not {method}",
                               code="method_not_allowed")
            if path.startswith("/v1/") and self.engine.api_key is not None and \
                    self.headers.get("Authorization") != f"Bearer {self.engine.api_key}":
                raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key")
            getattr(self, self.ROUTES[path][method])()
        except ApiError as error:
            if error.status in (401, 404, 405) and self.headers.get("Content-Length", "0") != "0":
                self.close_connection = True  # a body left unread: kept alive, it would be read as the next request
            self.send_json(error.status, error.body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (a malformed request line, say), in OpenAI's shape."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # what a line that is no HTTP leaves: no status line would be sent
            self.request_version = "HTTP/1.0"
        error = ApiError(code, message or "bad request", code="bad_request")
        self.send_json(code, error.body)

    def send_json(self, status, body, content_type="application/json"):
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def read_body(self):
        """The request's JSON body, or an ApiError: 413 past MAX_BODY, 400 if it is no JSON."""
        try:
            length = int(self.headers.get("Content-Length", ""))
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise bad("a POST needs a Content-Length header with the body's size", None, "bad_request") from None
        if length > MAX_BODY:
            self.close_connection = True  # its body is left unread
            raise ApiError(413, f"the body has {length} bytes, over {MAX_BODY}", code="request_too_large")
        try:
            return json.loads(self.rfile.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"the body is not valid JSON: {e}", None, "invalid_json") from None

    def client_gone(self):
        """Whether the client has closed its connection: readable, with nothing left to read."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def items(self, stream):
        """stream's (token, finish_reason) pairs, as the engine makes them. Waiting, it looks every POLL_S
        whether its client has gone: then it cancels the request and ends (the engine frees its slot)."""
        while True:
            try:
                item = stream.items.get(timeout=POLL_S)
            except queue.Empty:
                if self.client_gone():
                    stream.cancel()
                    raise ConnectionResetError("the client has gone")
                continue
            if isinstance(item, BaseException):
                raise ApiError(500, f"the engine failed: {item!r}", code="engine_error", kind="server_error")
            yield item
            if item[1] is not None:
                return

    # ---- the endpoints

    def complete(self):
        engine = self.engine
        request, stream_it, include_usage, return_ids = parse_completion(
            self.read_body(), engine.model_name, engine.model.config.vocab_size, engine.max_len, engine.tokenizer)
        stream = engine.submit(request)
        try:
            self.reply(request, stream, stream_it, include_usage, return_ids)
        finally:
            engine.replied()

    def reply(self, request, stream, stream_it, include_usage, return_ids):
        """The completion's reply, as its Stream's tokens come: one JSON at the end, or an event a token."""
        engine = self.engine
        reply = {"id": engine.completion_id(stream.request_index), "object": "text_completion",
                 "created": int(time.time()), "model": engine.model_name}
        with_ids = return_ids or engine.tokenizer is None  # offline, token_ids carries the answer
        detokenizer = Detokenizer(engine.tokenizer)
        if not stream_it:
            try:
                pieces = [(token, detokenizer.text(token, reason is not None)) for token, reason in self.items(stream)]
            except ConnectionResetError:
                return
            if stream.completion.finish_reason == "abort":
                raise ApiError(503, "the server is shutting down: the request was aborted", code="unavailable",
                               kind="server_error")
            choice = {"index": 0, "text": "".join(text for _, text in pieces),
                      "finish_reason": FINISH_REASONS[stream.completion.finish_reason], "logprobs": None}
            if with_ids:
                choice.update(prompt_token_ids=request.prompt, token_ids=stream.completion.tokens)
            n_tokens = len(stream.completion.tokens)
            return self.send_json(200, {**reply, "choices": [choice], "usage": usage(len(request.prompt), n_tokens)})
        self.start_events(reply["id"])
        n_tokens = 0
        try:
            for token, reason in self.items(stream):
                choice = {"index": 0, "text": detokenizer.text(token, reason is not None),
                          "finish_reason": reason and FINISH_REASONS[reason], "logprobs": None}
                if with_ids:  # as vLLM: the prompt's ids with the first chunk
                    choice.update(token_ids=[] if token is None else [token],
                                  **({"prompt_token_ids": request.prompt} if n_tokens == 0 else {}))
                n_tokens += token is not None
                self.send_event({**reply, "choices": [choice], **({"usage": None} if include_usage else {})})
            if include_usage:
                self.send_event({**reply, "choices": [], "usage": usage(len(request.prompt), n_tokens)})
            self.send_event("[DONE]")
        except ApiError as error:  # the engine failed mid-stream: said as an event, as vLLM does
            self.send_event(error.body)
            self.send_event("[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            stream.cancel()  # the client has gone: its request leaves the belt at the next step

    def start_events(self, request_id=None):
        """Server-sent events: no length; the connection closes when they end. request_id: a completion's id,
        in vLLM's X-Request-Id header, so that a client (the page) knows its request while it waits."""
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        if request_id is not None:
            self.send_header("X-Request-Id", request_id)
        self.end_headers()

    def send_event(self, body):
        self.wfile.write(f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode())
        self.wfile.flush()

    def steps(self):
        """Each engine step's event as it comes, until the client goes or the server stops."""
        watcher = self.engine.watch()
        self.start_events()
        try:
            while True:
                try:
                    event = watcher.get(timeout=15)
                except queue.Empty:  # a comment line: keeps proxies open, and finds a client that has gone
                    self.wfile.write(b": idle\n\n")
                    continue
                if event is None:
                    return
                self.send_event(event)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        finally:
            self.engine.unwatch(watcher)

    def models(self):
        card = {"id": self.engine.model_name, "object": "model", "created": int(time.time()), "owned_by": "nanobatch",
                "max_model_len": self.engine.max_len}
        self.send_json(200, {"object": "list", "data": [card]})

    def health(self):
        if self.engine.live.error:
            raise ApiError(500, f"the engine has failed: {self.engine.live.error!r}", code="engine_error",
                           kind="server_error")
        if self.engine.is_stopping:
            raise ApiError(503, "the server is shutting down", code="unavailable", kind="server_error")
        self.send_json(200, "", "text/plain")

    def send_metrics(self):
        self.send_json(200, self.engine.metrics(), "text/plain; version=0.0.4; charset=utf-8")

    def page(self):
        """The live belt: tools/explore.html fed live. Its data: a run with no step yet, which the page fills from
        /steps, and, as `live`, what this server serves; in its belts' place, the live part: tools/serve.html."""
        engine, options = self.engine, self.engine.live.options
        run = ("live", options["n_slots"], options["policy"], options["prefill_chunk"], False, options["kv_blocks"],
               options["prefix_cache"])  # as nanobatch.Shown.runs holds a run
        shown = nanobatch.Shown([], [run], {"live": []}, {}, {"live": []}, engine.tokenizer)
        data = explore.page_data(shown, f"python tools/serve.py: {engine.model_name}, served live")
        data["live"] = {"model": engine.model_name, "max_len": engine.max_len,
                        "has_tokenizer": engine.tokenizer is not None, "needs_api_key": engine.api_key is not None,
                        "belt": dict(width=SVG_WIDTH, left=LEFT, right=RIGHT, title_h=TITLE_H, gap=GAP,
                                     strip_h=STRIP_H, axis_h=AXIS_H)}  # belt_svg.py's sizes, for the belt drawn live
        self.send_json(200, explore.filled(data, PAGE.read_text()), "text/html; charset=utf-8")

    def log_message(self, format, *args):  # one line a request on stderr, as http.server does, but quieter
        if not getattr(self, "path", "").startswith("/metrics"):
            sys.stderr.write(f"serve: {self.address_string()} {format % args}\n")


# ---------------------------------------------------------------------------------------------
# Starting and stopping


class Server(ThreadingHTTPServer):
    daemon_threads = True  # a client that never reads cannot keep the process alive
    request_queue_size = 128  # connections the system holds before accept: a class arrives at once (default 5)

    def __init__(self, address, handler):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)


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
        print("serve: no tokenizer (tiktoken's GPT-2 files cannot be had offline): prompts must be lists of token "
              "ids, and answers come as token_ids, their text empty", file=sys.stderr)
    return model, tokenizer, name


def start(args):
    """Load, start the engine's thread and the HTTP server's -> the Engine, serving (engine.httpd)."""
    model, tokenizer, name = load(args)
    args.max_len = args.max_len or model.config.block_size
    engine = Engine(model, tokenizer, args.served_model_name or name, args)
    try:
        engine.httpd = Server((args.host, args.port), type("BoundHandler", (Handler,), {"engine": engine}))
    except OSError as e:
        nanobatch.fail(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
    try:
        engine.live.__enter__()  # the engine's thread; a bad option raises here, before any request
    except ValueError as e:
        engine.httpd.server_close()
        nanobatch.fail(e)
    engine.http_thread = threading.Thread(target=engine.httpd.serve_forever, kwargs=dict(poll_interval=0.1),
                                          name="nanobatch http", daemon=True)  # shutdown() seen within 0.1 s
    engine.http_thread.start()
    return engine


def stop(engine):
    """Take no more requests, abort those in flight (their streams end), then close the HTTP server."""
    engine.stop()
    with engine.lock:  # each aborted stream's end written before the process may exit; a client that reads
        engine.all_replied.wait_for(lambda: engine.n_replying == 0, timeout=2)  # nothing holds it 2 s at most
    engine.httpd.shutdown()
    engine.httpd.server_close()
    engine.http_thread.join(timeout=5)


def serve(args):
    """start, print the address on a line of its own, serve until SIGINT or SIGTERM, stop -> 0."""
    engine = start(args)  # Ctrl-C while it loads: KeyboardInterrupt, caught in main
    stop_asked = threading.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, lambda *_: stop_asked.set())
    try:
        host, port = engine.httpd.server_address[:2]
        print(f"http://{f'[{host}]' if ':' in host else host}:{port}/", flush=True)
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
    parser.add_argument("--api-key", metavar="KEY", default=None, help="/v1/ needs Authorization: Bearer KEY")
    parser.add_argument("--served-model-name", metavar="NAME", default=None,
                        help="the model's name in the API (gpt2; gpt2-random offline; nanobatch-quick)")
    _, args = nanobatch.parse_args(parser, argv, {"slots", "max_len", "prefill_chunk", "kv_blocks", "kv_block_size",
                                                   "prefix_cache", "policy", "device", "dtype", "weights", "quick",
                                                   "seed", "batch_invariant"})
    return args


def main(argv=None):
    try:
        return serve(parse(argv))
    except KeyboardInterrupt:  # before it served: nothing to stop
        return 130


if __name__ == "__main__":
    sys.exit(main())
