"""
tools/serve.py, the engine served live over HTTP, tested as a client sees it: a real server on a free port
of 127.0.0.1, clients from the standard library (http.client, and raw sockets for what http.client will not
send). One server serves the whole file, in this process: the tiny --quick model in float64, paged with a
prefix cache, 4 slots, so that requests queue, share blocks and can be preempted. What it proves:
1) 32 concurrent streaming clients, greedy and seeded, each get exactly the tokens generate_sequential
   gives their request and the same request served alone gives, nothing lost or doubled, every stream
   ended by [DONE]; a whole (unstreamed) reply says the same;
2) every endpoint answers in its shape: completions, models, health, metrics (vLLM's names), steps, the page;
3) every error is OpenAI's shape, naming the field: bad input, unknown paths and methods, too large a body,
   a missing API key, a full queue (429, and no other request lost), shutting down (503);
4) a client that goes away, mid-stream or mid-wait, cancels its request: its slot and blocks come back;
5) text comes out a piece per token, never splitting a character; offline, prompts are token ids;
6) Ctrl-C: the server, a process of its own, aborts what is in flight and exits 0, promptly.
Every wait has a timeout: a server that hangs fails a test, never the suite.
"""
import http.client
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

import serve
from model import GPT
from nanobatch import EOT, Request, generate_sequential
from tests.common import IN_BACKGROUND, REPO, TIMEOUT_S, ends_within

ENGINE_OPTIONS = ["--quick", "--port", "0", "--dtype", "float64", "--slots", "4", "--max-len", "48",
                  "--kv-blocks", "40", "--kv-block-size", "4", "--prefix-cache"]


@pytest.fixture(scope="module")
def server():
    engine = serve.start(serve.parse(ENGINE_OPTIONS))
    try:
        yield engine
    finally:
        ends_within(TIMEOUT_S, serve.stop, engine)  # the server stops, or the test fails: never hangs


def port(server):
    return server.httpd.server_address[1]


def call(server, method, path, body=None, headers=None, timeout=TIMEOUT_S):
    """One request -> (status, headers, body bytes)."""
    connection = http.client.HTTPConnection("127.0.0.1", port(server), timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        connection.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def events(data):
    """A server-sent events body -> its data fields, JSON parsed ([DONE] kept as the string)."""
    fields = [block[len("data: "):] for block in data.decode().split("\n\n") if block.startswith("data: ")]
    return [field if field == "[DONE]" else json.loads(field) for field in fields]


def complete(server, request, stream=True, **extra):
    """A Request through POST /v1/completions -> (status, its events or its JSON reply)."""
    body = {"prompt": request.prompt, "max_tokens": request.max_new_tokens, "temperature": request.temperature,
            "seed": request.seed, "stream": stream, **extra}
    status, _, data = call(server, "POST", "/v1/completions", body)
    return status, (events(data) if stream and status == 200 else json.loads(data))


def streamed_tokens(chunks):
    """The token ids a stream carried, and its finish reason; and checks its shape: one choice a chunk, the
    reason on the last chunk only, then [DONE]."""
    assert chunks[-1] == "[DONE]", f"the stream did not end with [DONE]: {chunks[-1:]}"
    choices = [chunk["choices"][0] for chunk in chunks[:-1]]
    assert all(c["finish_reason"] is None for c in choices[:-1]) and choices[-1]["finish_reason"], choices
    return [t for c in choices for t in c["token_ids"]], choices[-1]["finish_reason"]


def workload(n, seed):
    """n requests, half greedy and half sampled with seeds, prompts of 1-6 tokens, 1-6 new tokens each:
    short, since the reference's every token runs the plain forward over its whole sequence, and its LM
    head over every position (GPT-2's 50,257 tokens, in float64) is most of this file's time."""
    rng = random.Random(seed)
    return [Request([rng.randrange(50257) for _ in range(rng.randint(1, 6))], rng.randint(1, 6),
                    temperature=0.0 if i % 2 else 0.9, seed=seed + i) for i in range(n)]


def finish_reason(completion):
    return {"eos": "stop", "length": "length", "context": "length"}[completion.finish_reason]


# ---------------------------------------------------------------------------------------------
# 1) Many clients at once get what one request alone gets, and what the reference gets


def test_32_concurrent_streams_equal_the_reference_and_each_alone(server):
    """32 clients stream at once into 4 slots: each answer is generate_sequential's, token for token, and
    the one the same request gets served alone; every stream ends with [DONE], no token lost or doubled."""
    requests = workload(32, seed=7)
    got = [None] * len(requests)

    def client(i):
        got[i] = complete(server, requests[i], return_token_ids=True)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a client hung"
    want = generate_sequential(server.model, requests, max_len=server.max_len, eos_id=EOT)
    for i, (status, chunks) in enumerate(got):
        assert status == 200, chunks
        assert len({chunk["id"] for chunk in chunks[:-1]}) == 1, f"request {i}: chunks of several completions"
        assert streamed_tokens(chunks) == (want[i].tokens, finish_reason(want[i])), f"request {i}"
    ids = {chunks[0]["id"] for _, chunks in got}
    assert len(ids) == len(requests), "two requests were given one completion id"
    for i in range(len(requests)):  # alone on the belt, and whole: the same answer
        status, reply = complete(server, requests[i], stream=False, return_token_ids=True)
        assert status == 200 and reply["choices"][0]["token_ids"] == want[i].tokens, reply
        assert reply["choices"][0]["finish_reason"] == finish_reason(want[i])
        assert reply["usage"] == {"prompt_tokens": len(requests[i].prompt), "completion_tokens": len(want[i].tokens),
                                  "total_tokens": len(requests[i].prompt) + len(want[i].tokens)}


# ---------------------------------------------------------------------------------------------
# 2) Every endpoint


def test_the_reply_shapes(server):
    """A whole reply and a stream as OpenAI's completions API gives them; usage as a last chunk when asked."""
    request = Request([464, 3139, 286], 3, temperature=0.0)
    status, reply = complete(server, request, stream=False)
    assert status == 200
    assert set(reply) == {"id", "object", "created", "model", "choices", "usage"}
    assert reply["object"] == "text_completion" and reply["model"] == "nanobatch-quick"
    assert reply["id"].startswith("cmpl-") and isinstance(reply["created"], int)
    [choice] = reply["choices"]
    # Offline (no tiktoken files here), text is empty and token_ids carry the answer, asked or not.
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["text"] == ""
    assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"
    status, chunks = complete(server, request, stream_options={"include_usage": True})
    assert status == 200 and chunks[-1] == "[DONE]"
    *token_chunks, usage_chunk, _ = chunks
    assert len(token_chunks) == 3, "one chunk per step that makes a token"
    assert all(chunk["usage"] is None for chunk in token_chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == reply["usage"]
    assert token_chunks[0]["choices"][0]["prompt_token_ids"] == request.prompt  # with the first chunk only
    assert all("prompt_token_ids" not in chunk["choices"][0] for chunk in token_chunks[1:])
    status, chunks = complete(server, request)
    assert all("usage" not in chunk for chunk in chunks[:-1]), "usage chunks only when asked"


def test_models_health_metrics_and_the_page(server):
    status, _, data = call(server, "GET", "/v1/models")
    assert status == 200
    assert json.loads(data)["data"][0] | {"created": 0} == {"id": "nanobatch-quick", "object": "model", "created": 0,
                                                           "owned_by": "nanobatch", "max_model_len": 48}
    assert call(server, "GET", "/health")[0] == 200
    status, headers, data = call(server, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total"):
        assert f"nanobatch:{name}" in samples, name
    for reason in ("stop", "length", "abort"):
        assert f'nanobatch:request_success_total|{reason}' in samples
    before = metrics(server)
    complete(server, Request([1, 2, 3, 4, 5], 4, temperature=0.0), stream=False)
    after = metrics(server)
    assert after["nanobatch:prompt_tokens_total"] - before["nanobatch:prompt_tokens_total"] == 5
    assert after["nanobatch:generation_tokens_total"] - before["nanobatch:generation_tokens_total"] == 4
    assert after["nanobatch:request_success_total|length"] - before["nanobatch:request_success_total|length"] == 1
    assert after["nanobatch:num_requests_running"] == 0 and after["nanobatch:kv_cache_usage_perc"] == 0, \
        "the gauges count a request that retired in the last step"
    status, headers, data = call(server, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"__CONFIG__" not in data


def metrics(server):
    """GET /metrics -> {name (|finished_reason): value}, checking each sample has its HELP and TYPE lines."""
    text = call(server, "GET", "/metrics")[2].decode()
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{")[0]
            assert name in typed, f"{name} has no TYPE line"
            reason = name_labels.split('finished_reason="')[1].split('"')[0] if "finished_reason" in line else None
            samples[name if reason is None else f"{name}|{reason}"] = float(value)
    return samples


def test_steps_stream_each_engine_step(server):
    """/steps: an event per engine step, requests named by their completion ids, with the fields the page
    and a class read, from admission to the last token."""
    connection = http.client.HTTPConnection("127.0.0.1", port(server), timeout=TIMEOUT_S)
    connection.request("GET", "/steps")
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    try:
        status, reply = complete(server, Request([5, 6, 7], 3, temperature=0.0), stream=False)
        seen = []
        while not any(reply["id"] in event["finished"] for event in seen):
            line = response.fp.readline().decode()
            if line.startswith("data: "):
                seen.append(json.loads(line[len("data: "):]))
    finally:
        connection.close()
    required = {"step", "belt", "occupants", "admitted", "finished", "preempted", "waiting", "kv_used", "kv_total"}
    assert all(required <= set(event) for event in seen)
    steps = [event["step"] for event in seen]
    assert steps == list(range(steps[0], steps[0] + len(steps))), "a step missing from /steps"
    mine = [event for event in seen if reply["id"] in event["occupants"]]
    assert reply["id"] in mine[0]["admitted"] and len(mine) == 3, "admitted, then a token a step for 3 steps"
    assert all(event["kv_total"] == 40 * 4 for event in seen)


# ---------------------------------------------------------------------------------------------
# 3) Errors, in OpenAI's shape, naming what is wrong


BAD_BODIES = [  # (body, the field named, a word of the message)
    ({"max_tokens": 3}, "prompt", "missing"),
    ({"prompt": []}, "prompt", "missing"),
    ({"prompt": ""}, "prompt", "missing"),
    ({"prompt": 12}, "prompt", "string or a list"),
    ({"prompt": [1, "two"]}, "prompt", "string or a list"),
    ({"prompt": [1, True]}, "prompt", "string or a list"),
    ({"prompt": [1, 50257]}, "prompt", "outside the vocabulary"),
    ({"prompt": [-1]}, "prompt", "outside the vocabulary"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "several prompts"),
    ({"prompt": "Hello"}, "prompt", "token ids"),  # offline: no tokenizer
    ({"prompt": [1], "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": [1], "max_tokens": 2.5}, "max_tokens", "integer"),
    ({"prompt": [1], "max_tokens": "8"}, "max_tokens", "integer"),
    ({"prompt": [1] * 40, "max_tokens": 9}, "max_tokens", "maximum context length is 48"),
    ({"prompt": [1], "temperature": -0.1}, "temperature", ">= 0"),
    ({"prompt": [1], "temperature": "hot"}, "temperature", ">= 0"),
    ({"prompt": [1], "top_k": 1.5}, "top_k", "integer"),
    ({"prompt": [1], "top_k": -2}, "top_k", "integer"),
    ({"prompt": [1], "seed": 2 ** 64}, "seed", "integer"),
    ({"prompt": [1], "seed": "1"}, "seed", "integer"),
    ({"prompt": [1], "stream": "yes"}, "stream", "true or false"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ({"prompt": [1], "n": 2}, "n", "not supported"),
    ({"prompt": [1], "best_of": 3}, "best_of", "not supported"),
    ({"prompt": [1], "logprobs": 1}, "logprobs", "not supported"),
    ({"prompt": [1], "echo": True}, "echo", "not supported"),
    ({"prompt": [1], "stop": "\n"}, "stop", "not supported"),
    ({"prompt": [1], "suffix": "end"}, "suffix", "not supported"),
    ({"prompt": [1], "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": [1], "frequency_penalty": 1}, "frequency_penalty", "not supported"),
]


@pytest.mark.parametrize("body, param, words", BAD_BODIES, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_BODIES)])
def test_bad_input_is_a_400_naming_the_field(server, body, param, words):
    status, _, data = call(server, "POST", "/v1/completions", body)
    error = json.loads(data)["error"]
    assert status == 400 and set(error) == {"message", "type", "param", "code"}, data
    assert error["param"] == param and words in error["message"], error


def test_defaults_are_not_refused(server):
    """The unsupported fields at their defaults, unknown fields, a null model: served, as OpenAI's clients send."""
    body = {"prompt": [1, 2], "max_tokens": 1, "n": 1, "best_of": 1, "logprobs": None, "echo": False, "stop": None,
            "suffix": None, "presence_penalty": 0, "frequency_penalty": 0.0, "model": None, "user": "a student"}
    assert call(server, "POST", "/v1/completions", body)[0] == 200


@pytest.mark.parametrize("method, path, body, status, code", [
    ("POST", "/v1/completions", b"{not json", 400, "invalid_json"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "invalid_value"),
    ("POST", "/v1/completions", {"prompt": [1], "model": "gpt-4"}, 404, "model_not_found"),
    ("GET", "/v2/completions", None, 404, "not_found"),
    ("GET", "/v1/completions", None, 405, "method_not_allowed"),
    ("POST", "/health", b"{}", 405, "method_not_allowed"),
    ("DELETE", "/v1/models", None, 405, "method_not_allowed"),
])
def test_http_errors(server, method, path, body, status, code):
    got, _, data = call(server, method, path, body)
    assert got == status and json.loads(data)["error"]["code"] == code, data


@contextmanager
def raw(server):
    """A socket to the server, for what http.client will not send."""
    connection = socket.create_connection(("127.0.0.1", port(server)), timeout=TIMEOUT_S)
    try:
        yield connection
    finally:
        connection.close()


def reply_of(connection):
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_malformed_requests_on_a_raw_socket(server):
    """A body over 1 MB (413, unread), no Content-Length (400), a request line that is no HTTP (400): each
    answered in OpenAI's shape, and the server serves on."""
    with raw(server) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n{")
        status, body = reply_of(connection)
        assert status == 413 and body["error"]["code"] == "request_too_large"
    with raw(server) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, body = reply_of(connection)
        assert status == 400 and "Content-Length" in body["error"]["message"]
    with raw(server) as connection:
        connection.sendall(b"this is not http\r\n\r\n")
        status, body = reply_of(connection)
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert call(server, "GET", "/health")[0] == 200


def test_a_refused_post_closes_its_connection(server):
    """A POST refused before its body is read (an unknown path here) closes its connection: its body, left
    unread, is never taken for a second request on a kept-alive connection."""
    with raw(server) as connection:
        body = b'{"prompt": [1]}'
        connection.sendall(b"POST /v1/nope HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body) +
                           b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, reply = reply_of(connection)  # reads until the server closes: one reply only
    assert status == 404 and reply["error"]["code"] == "not_found", reply


def test_the_api_key(server, monkeypatch):
    """With --api-key, /v1/ needs Authorization: Bearer KEY (401 without); /health and /metrics do not."""
    monkeypatch.setattr(server, "api_key", "sesame")
    body = {"prompt": [1], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        status, _, data = call(server, "POST", "/v1/completions", body, headers)
        assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    assert call(server, "GET", "/v1/models")[0] == 401
    assert call(server, "POST", "/v1/completions", body, {"Authorization": "Bearer sesame"})[0] == 200
    assert call(server, "GET", "/health")[0] == 200 and call(server, "GET", "/metrics")[0] == 200


def test_a_full_queue_is_a_429_and_loses_no_other_request(server, monkeypatch):
    """--max-waiting 2: with the engine held inside a forward, two requests wait, and a third is refused at
    once with 429; let go, the two finish whole, with the reference's tokens."""
    monkeypatch.setattr(server, "max_waiting", 2)
    gate = Gate(monkeypatch)
    requests = [Request([20 + i, 7], 5, temperature=0.0) for i in range(2)]
    results = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, complete(server, requests[i], return_token_ids=True)), daemon=True) for i in range(2)]
    try:
        for i, thread in enumerate(threads):
            thread.start()
            wait_until(lambda: len(server.queued) == i + 1)  # submitted, the engine held in its forward
        status, reply = complete(server, Request([99], 3))
        assert status == 429 and reply["error"]["code"] == "rate_limit_exceeded", reply
    finally:
        gate.open()
    for thread in threads:
        thread.join(TIMEOUT_S)
    want = generate_sequential(server.model, requests, max_len=server.max_len, eos_id=EOT)
    assert [streamed_tokens(chunks) for _, chunks in results] == [(w.tokens, finish_reason(w)) for w in want]


def test_shutting_down_is_a_503(server, monkeypatch):
    monkeypatch.setattr(server, "is_stopping", True)
    status, _, data = call(server, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1})
    assert status == 503 and json.loads(data)["error"]["type"] == "server_error"
    assert call(server, "GET", "/health")[0] == 503


def wait_until(condition, timeout=TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.005)
    raise AssertionError("timed out")


class Gate:
    """Holds the engine's thread inside its next forwards until let through, n_free of them passing first:
    the belt stands still while a test arranges what it needs (a full queue, a client gone)."""

    def __init__(self, monkeypatch, n_free=0):
        self.passes, forward = threading.Semaphore(n_free), GPT.forward_packed

        def gated(model, step, cache):
            if not self.passes.acquire(timeout=TIMEOUT_S):
                raise RuntimeError("the test's gate never opened")
            return forward(model, step, cache)

        monkeypatch.setattr(GPT, "forward_packed", gated)

    def open(self):
        self.passes.release(10 ** 6)


# ---------------------------------------------------------------------------------------------
# 4) A client that goes away


@pytest.mark.parametrize("when", ["mid-stream", "mid-wait"])
def test_a_client_that_goes_away_frees_its_slot_and_blocks(server, monkeypatch, when):
    """Mid-stream (its first token read, then the socket closed) or mid-wait (a whole reply awaited): once
    the server sees the client gone, the request leaves at the next step boundary as "abort", within two
    forwards of the engine's being let go, and its slot and blocks are back; /metrics says so."""
    before = metrics(server)
    gate = Gate(monkeypatch, n_free=1 if when == "mid-stream" else 0)
    try:
        with raw(server) as connection:
            body = json.dumps({"prompt": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 38, "temperature": 0.0,
                               "stream": when == "mid-stream"}).encode()
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            if when == "mid-stream":
                received = b""
                while b"data: " not in received:  # its first token has come; the second is held
                    received += connection.recv(65536)
            else:
                wait_until(lambda: len(server.live.streams) == 1)  # taken in, and held in the forward
        wait_until(lambda: server.live.streams[next(iter(server.live.streams))].is_cancelled)
    finally:
        gate.open()
    wait_until(lambda: metrics(server)["nanobatch:request_success_total|abort"] ==
               before["nanobatch:request_success_total|abort"] + 1)
    after = wait_until(lambda: (m := metrics(server))["nanobatch:num_requests_running"] == 0 and m)
    n_tokens = after["nanobatch:generation_tokens_total"] - before["nanobatch:generation_tokens_total"]
    assert n_tokens <= (1 if when == "mid-wait" else 2) + 1, f"{n_tokens} tokens made after the client left"
    assert after["nanobatch:kv_cache_usage_perc"] == 0.0 and after["nanobatch:num_requests_waiting"] == 0
    assert server.live.streams == {}, "the engine still holds the stream"


# ---------------------------------------------------------------------------------------------
# 5) Text, a piece per token


class Bytes:
    """A stand-in for tiktoken's GPT-2 encoding: token t decodes to PIECES[t], bytes that split characters."""
    PIECES = [b"caf", b"\xc3", b"\xa9 ", b"\xe2\x82", b"\xac!", b"\xff", b"ok"]

    def decode_single_token_bytes(self, token):
        return self.PIECES[token]


@pytest.mark.parametrize("tokens", [[0, 1, 2, 3, 4], [1], [3, 6], [5, 0], [0, 1, EOT], [2, 3]])
def test_text_comes_a_piece_per_token_never_splitting_a_character(tokens):
    """The pieces joined are the answer decoded whole (as tiktoken decodes: bad bytes replaced), EOS left out;
    a token that ends inside a character gives an empty piece, and the character comes with the next."""
    detokenizer = serve.Detokenizer(Bytes())
    pieces = [detokenizer.text(token, k == len(tokens) - 1) for k, token in enumerate(tokens)]
    whole = b"".join(Bytes.PIECES[t] for t in tokens if t != EOT).decode("utf-8", errors="replace")
    assert "".join(pieces) == whole
    if tokens[:3] == [0, 1, 2]:
        assert pieces[:3] == ["caf", "", "é "]


# ---------------------------------------------------------------------------------------------
# 6) Ctrl-C, in a process of its own


def ctrl_c_in_flight(folder):
    """tools/serve.py in a process of its own (a signal goes to a whole process), one slot, three streaming
    clients: once one runs and two wait, SIGINT -> (the line it printed first, its exit status, the seconds
    from the signal to its exit, each client's events)."""
    command = [sys.executable, str(REPO / "tools" / "serve.py"), "--quick", "--port", "0", "--slots", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "NANOBATCH_CACHE": str(folder), "OMP_NUM_THREADS": "1",
                                    "https_proxy": "http://127.0.0.1:9"})  # offline at once, as tests/test_cli.py
    try:
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
        address = lines.get(timeout=TIMEOUT_S).strip()
        host, port_number = address[len("http://"):-1].split(":")
        streams = [None] * 3

        def client(k):
            connection = http.client.HTTPConnection(host, int(port_number), timeout=TIMEOUT_S)
            connection.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2 + k], "max_tokens": 1000,
                                                                      "stream": True}))
            streams[k] = events(connection.getresponse().read())

        clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(3)]
        for thread in clients:
            thread.start()
        # All three in: one in the slot, two waiting (the waiting gauge counts a request from its submission,
        # the running one from the step that admits it, so two waiting alone may be the first two, not yet run).
        wait_until(lambda: metric(host, port_number, "nanobatch:num_requests_running") == 1 and
                   metric(host, port_number, "nanobatch:num_requests_waiting") == 2)
        process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        status = process.wait(timeout=TIMEOUT_S)
        stopped_s = time.monotonic() - sent
        for thread in clients:
            thread.join(TIMEOUT_S)
        return address, status, stopped_s, streams
    finally:
        process.kill()
        process.wait()


IN_BACKGROUND["test_ctrl_c_aborts_what_is_in_flight_and_exits_0"] = ctrl_c_in_flight  # started with the session


def test_ctrl_c_aborts_what_is_in_flight_and_exits_0(ran):
    """The address printed alone on a line once it serves; SIGINT with one request in the one slot and two
    waiting: every stream ends, the waiting ones (at least) with "abort", then [DONE], and the process exits
    0 within a couple of seconds. (Its run starts Python and torch again: it starts with the session, beside
    the other tests, as tests/common.py's IN_BACKGROUND says.)"""
    address, status, stopped_s, streams = ran
    assert address.startswith("http://127.0.0.1:") and address.endswith("/"), address
    assert status == 0
    assert stopped_s < 5, "it took over 5 s to stop"  # about 0.5 s here; a loaded machine, more
    reasons = sorted(chunks[-2]["choices"][0]["finish_reason"] for chunks in streams)
    assert all(chunks[-1] == "[DONE]" for chunks in streams) and reasons[1:] == ["abort", "abort"], reasons


def metric(host, port_number, name):
    """One sample of GET /metrics, read by its name."""
    connection = http.client.HTTPConnection(host, int(port_number), timeout=TIMEOUT_S)
    connection.request("GET", "/metrics")
    [line] = [line for line in connection.getresponse().read().decode().splitlines() if line.startswith(name + "{")]
    return float(line.split()[-1])
