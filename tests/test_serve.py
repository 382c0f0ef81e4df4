"""
tools/serve.py, the engine served live over HTTP (uvicorn and FastAPI), tested as a client sees it: a real server
on a free port of 127.0.0.1, clients from the standard library (http.client, and raw sockets for what http.client
will not send). One server serves most of the file, in this process: the tiny --quick model in float64, paged with a
prefix cache, 4 slots, so that requests queue, share blocks and can be preempted. What it proves:
1) 32 concurrent streaming clients, greedy and seeded, each get exactly the tokens generate_sequential gives
   their request and the same request served alone gives, nothing lost or doubled, every stream ended by [DONE];
   a whole (unstreamed) reply says the same; a request with no seed samples with --seed + its index;
2) every endpoint answers in its shape, HEAD as GET does: completions, models, health, metrics (vLLM's names),
   steps, the page; logprobs are the engine's own, in vLLM's shape, streamed too; ignore_eos runs through EOS;
3) every error is OpenAI's shape, naming the field: bad input (strict types, bodies that break Python's parsers),
   unknown paths and methods, a body that is no JSON (415), too large (413), a missing API key on every route
   but /health and /metrics, a full queue (429, and no other request lost), shutting down (503);
4) no body is ever run as a request: bodies left unread, chunked bodies, two lengths (HTTP desync);
5) a client that goes away, mid-stream or mid-wait, cancels its request within a step of the server seeing it:
   its slot and blocks come back, /metrics says so, and the log holds no traceback; one that waits in the
   queue leaves it; an aborted stream still ends with its usage and [DONE];
6) the connections: a cap (503 past it), and one kept alive and idle is closed after the keep-alive timeout;
7) text comes out a piece per token, never splitting a character; offline, prompts are token ids;
8) Ctrl-C: the server, a process of its own, aborts what is in flight and exits 0, promptly.
Every wait has a timeout: a server that hangs fails a test, never the suite.
"""
import contextlib
import http.client
import io
import json
import logging
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

import serve
from model import GPT
from nanobatch import EOT, Request, generate_sequential
from tests.common import IN_BACKGROUND, REPO, TIMEOUT_S, ends_within

ENGINE_OPTIONS = ["--quick", "--port", "0", "--dtype", "float64", "--slots", "4", "--max-len", "48",
                  "--kv-blocks", "40", "--kv-block-size", "4", "--prefix-cache", "--seed", "11"]


@pytest.fixture(scope="module")
def server():
    engine = serve.start(serve.parse(ENGINE_OPTIONS))
    try:
        yield engine
    finally:
        ends_within(TIMEOUT_S, serve.stop, engine)  # the server stops, or the test fails: never hangs


def port(server):
    return server.address[1]


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
    choices = [chunk["choices"][0] for chunk in chunks[:-1] if chunk["choices"]]
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


def index_of(completion_id):
    """The request index a completion id names: cmpl-BOOT-INDEX."""
    return int(completion_id.rsplit("-", 1)[1])


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


def test_a_request_with_no_seed_samples_with_the_servers_seed_plus_its_index(server):
    """--seed 11: request i, sent with no seed (sampled, temperature 1.0), gets what the reference gives it with
    seed 11 + i, so two servers started alike answer alike; a seed it gives is its own."""
    for seed in (None, 5):
        status, reply = complete(server, Request([3, 1, 4], 6, temperature=1.0, seed=seed), stream=False)
        assert status == 200
        i = index_of(reply["id"])
        [want] = generate_sequential(server.model, [Request([3, 1, 4], 6, temperature=1.0, seed=seed or 11 + i)],
                                     max_len=server.max_len)
        assert reply["choices"][0]["token_ids"] == want.tokens, (seed, i)
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as printed:
        serve.parse(["--help"])
    assert "request i (from 0) samples with seed + i" in " ".join(printed.getvalue().split()), "--seed's help"


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
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total"):
        assert f"nanobatch:{name}" in samples, name
    for reason in ("stop", "length", "abort"):
        assert f'nanobatch:request_success_total|{reason}' in samples
    before = metrics(server)
    complete(server, Request([1, 2, 3, 4, 5], 4, temperature=0.0), stream=False)
    # The reply has its tokens in phase 5 of a step, /metrics counts them in its phase 6: a moment later.
    after = wait_until(lambda: (m := metrics(server))["nanobatch:request_success_total|length"] >
                       before["nanobatch:request_success_total|length"] and m)
    assert after["nanobatch:prompt_tokens_total"] - before["nanobatch:prompt_tokens_total"] == 5
    assert after["nanobatch:generation_tokens_total"] - before["nanobatch:generation_tokens_total"] == 4
    assert after["nanobatch:request_success_total|length"] - before["nanobatch:request_success_total|length"] == 1
    assert after["nanobatch:num_requests_running"] == 0 and after["nanobatch:kv_cache_usage_perc"] == 0, \
        "the gauges count a request that retired in the last step"
    status, headers, data = call(server, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"__DATA__" not in data


@pytest.mark.parametrize("path", ["/", "/v1/models", "/health", "/metrics", "/steps"])
def test_head_answers_as_get(server, path):
    """HEAD: GET's status and headers, no body (/steps too, whose GET never ends)."""
    status, headers, data = call(server, "HEAD", path)
    assert status == 200 and data == b"", (status, data[:80])
    assert headers["content-type"].split(";")[0] == {"/": "text/html", "/v1/models": "application/json",
                                                    "/steps": "text/event-stream"}.get(path, "text/plain")


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
            assert name in typed or name.removesuffix("_total") in typed, f"{name} has no TYPE line"
            reason = name_labels.split('finished_reason="')[1].split('"')[0] if "finished_reason" in line else None
            samples[name if reason is None else f"{name}|{reason}"] = float(value)
    return samples


def test_steps_stream_each_engine_step(server):
    """/steps: an event per engine step, requests named by their completion ids, with the fields the page
    and a class read, from admission to the last token."""
    connection = http.client.HTTPConnection("127.0.0.1", port(server), timeout=TIMEOUT_S)
    connection.request("GET", "/steps")
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
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


def test_logprobs_are_the_engines_own_in_vllms_shape(server, monkeypatch):
    """logprobs=3, greedy: each token's logprob is log_softmax of the very logits the engine's forward gave for it
    (recorded as the forward returned them: no recomputation passes, bit for bit), the sampled token first in
    top_logprobs, then the top 3, likeliest first; offline each token is named token_id:ID; text_offset counts the
    tokens' names. Streamed, each chunk carries its own token's entry, the same values. logprobs=0: the sampled
    token alone."""
    rows, forward = [], GPT.forward_packed  # the request runs alone: a forward gives its one row of logits

    def recording(model, step, cache):
        logits = forward(model, step, cache)
        rows.append(logits[-1].clone())
        return logits

    monkeypatch.setattr(GPT, "forward_packed", recording)
    request = Request([7, 7, 7, 2], 4, temperature=0.0)
    status, reply = complete(server, request, stream=False, logprobs=3)
    [choice] = reply["choices"]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    tokens = choice["token_ids"]
    assert logprobs["tokens"] == [f"token_id:{token}" for token in tokens]
    assert logprobs["text_offset"] == [0] + [sum(len(f"token_id:{t}") for t in tokens[:k]) for k in range(1, 4)]
    assert len(rows) == len(tokens) == 4
    for k, (token, row) in enumerate(zip(tokens, rows)):
        want = torch.log_softmax(row, dim=-1)
        assert logprobs["token_logprobs"][k] == want[token].item(), k
        top = want.topk(3)
        assert list(logprobs["top_logprobs"][k].items()) == [(f"token_id:{token}", want[token].item())] + [
            (f"token_id:{i}", v) for i, v in zip(top.indices.tolist(), top.values.tolist())][1:], \
            "greedy: the sampled token is the likeliest, once, then the next two"
    status, chunks = complete(server, request, logprobs=3)
    streamed = [chunk["choices"][0]["logprobs"] for chunk in chunks[:-1]]
    assert [entry["token_logprobs"] for entry in streamed] == [[lp] for lp in logprobs["token_logprobs"]]
    assert [entry["top_logprobs"] for entry in streamed] == [[top] for top in logprobs["top_logprobs"]]
    status, reply = complete(server, Request([7, 7, 7, 2], 2, temperature=0.9, seed=3), stream=False, logprobs=0)
    assert [len(top) for top in reply["choices"][0]["logprobs"]["top_logprobs"]] == [1, 1]


def test_ignore_eos_runs_through_eos_to_max_tokens(server, monkeypatch):
    """With the model made to say EOS every time: an answer stops at its first token ("stop"), unless it asks
    ignore_eos, when it runs through EOS to max_tokens ("length"), EOS after EOS, as vLLM's does."""
    forward = GPT.forward_packed

    def says_eos(model, step, cache):
        logits = forward(model, step, cache)
        logits[:, EOT] += 1e6
        return logits

    monkeypatch.setattr(GPT, "forward_packed", says_eos)
    for ignore_eos, want in ((False, ([EOT], "stop")), (True, ([EOT] * 5, "length"))):
        status, chunks = complete(server, Request([1, 2], 5, temperature=0.0), ignore_eos=ignore_eos)
        assert status == 200 and streamed_tokens(chunks) == want, ignore_eos


def test_top_k_minus_one_is_every_token(server, monkeypatch):
    """top_k -1 (vLLM's "all") and 0 reach the engine as None; 5 as 5."""
    submitted = []
    submit = serve.Engine.submit
    monkeypatch.setattr(serve.Engine, "submit", lambda engine, request, *args: (
        submitted.append(request.top_k), submit(engine, request, *args))[1])
    for top_k in (-1, 0, 5):
        assert complete(server, Request([1], 1, temperature=0.5), top_k=top_k)[0] == 200
    assert submitted == [None, None, 5]


# ---------------------------------------------------------------------------------------------
# 3) Errors, in OpenAI's shape, naming what is wrong


NUMBER_OF_5000_DIGITS = "9" * 5000
BAD_BODIES = [  # (body, the field named, a word of the message); a str body is sent as it is
    ({"max_tokens": 3}, "prompt", "Field required"),
    ({"prompt": []}, "prompt", "missing or empty"),
    ({"prompt": ""}, "prompt", "missing or empty"),
    ({"prompt": None}, "prompt", "missing or empty"),
    ({"prompt": 12}, "prompt", "string or a list"),
    ({"prompt": [1, "two"]}, "prompt", "string or a list"),
    ({"prompt": [1, True]}, "prompt", "string or a list"),
    ({"prompt": [1, 50257]}, "prompt", "outside the vocabulary"),
    ({"prompt": [-1]}, "prompt", "outside the vocabulary"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "several prompts"),
    ({"prompt": "Hello"}, "prompt", "token ids"),  # offline: no tokenizer
    ({"prompt": [1], "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": [1], "max_tokens": 2.5}, "max_tokens", "integer"),
    ({"prompt": [1], "max_tokens": "8"}, "max_tokens", "integer"),
    ({"prompt": [1], "max_tokens": True}, "max_tokens", "integer"),
    ({"prompt": [1] * 40, "max_tokens": 9}, "max_tokens", "maximum context length is 48"),
    ({"prompt": [1], "temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"prompt": [1], "temperature": "hot"}, "temperature", "number"),
    ('{"prompt": [1], "temperature": NaN}', "temperature", "finite"),
    ('{"prompt": [1], "temperature": 1e309}', "temperature", "finite"),
    ('{"prompt": [1], "temperature": 1' + "0" * 400 + "}", "temperature", "number"),
    ({"prompt": [1], "top_k": 1.5}, "top_k", "integer"),
    ({"prompt": [1], "top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"prompt": [1], "seed": 2 ** 64}, "seed", "less than or equal to"),
    ({"prompt": [1], "seed": "1"}, "seed", "integer"),
    ({"prompt": [1], "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": [1], "logprobs": True}, "logprobs", "integer"),
    ({"prompt": [1], "stream": "yes"}, "stream", "boolean"),
    ({"prompt": [1], "stream": 0}, "stream", "boolean"),
    ({"prompt": [1], "stream": ""}, "stream", "boolean"),
    ({"prompt": [1], "stream": []}, "stream", "boolean"),
    ({"prompt": [1], "ignore_eos": 1}, "ignore_eos", "boolean"),
    ({"prompt": [1], "return_token_ids": "true"}, "return_token_ids", "boolean"),
    ({"prompt": [1], "echo": 0}, "echo", "boolean"),
    ({"prompt": [1], "n": 1.0}, "n", "integer"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ({"prompt": [1], "stream": True, "stream_options": {"include_usage": 1}}, "stream_options", "boolean"),
    ({"prompt": [1], "n": 2}, "n", "not supported"),
    ({"prompt": [1], "best_of": 3}, "best_of", "not supported"),
    ({"prompt": [1], "echo": True}, "echo", "not supported"),
    ({"prompt": [1], "stop": "\n"}, "stop", "not supported"),
    ({"prompt": [1], "suffix": "end"}, "suffix", "not supported"),
    ({"prompt": [1], "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": [1], "frequency_penalty": 1}, "frequency_penalty", "not supported"),
    ({"prompt": [1], "top_p": 0.9}, "top_p", "not supported"),
    ({"prompt": [1], "logit_bias": {"1": 2}}, "logit_bias", "not supported"),
]


@pytest.mark.parametrize("body, param, words", BAD_BODIES, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_BODIES)])
def test_bad_input_is_a_400_naming_the_field(server, body, param, words):
    status, _, data = call(server, "POST", "/v1/completions", body.encode() if isinstance(body, str) else body)
    error = json.loads(data)["error"]
    assert status == 400 and set(error) == {"message", "type", "param", "code"}, data
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("body, words", [
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),  # Python's json: too deep
    ('{"prompt": [1], "user": ' + NUMBER_OF_5000_DIGITS + "}", "digits"),  # Python's int: too long, in any field
    ("{not json", "not valid JSON"),
])
def test_bodies_that_break_pythons_parsers_are_a_400(server, body, words):
    """A body Python's parsers choke on is OpenAI's 400, code invalid_json, and the server serves on."""
    status, _, data = call(server, "POST", "/v1/completions", body.encode())
    error = json.loads(data)["error"]
    assert status == 400 and error["code"] == "invalid_json" and words in error["message"], error
    assert call(server, "GET", "/health")[0] == 200


def test_defaults_are_not_refused(server):
    """The unsupported fields at their defaults, nulls, unknown fields, a null model: served, as OpenAI's
    clients send them."""
    body = {"prompt": [1, 2], "max_tokens": 1, "n": 1, "best_of": 1, "logprobs": None, "echo": False, "stop": None,
            "suffix": None, "presence_penalty": 0, "frequency_penalty": 0.0, "model": None, "user": "a student",
            "top_p": 1.0, "stream": None, "temperature": None, "logit_bias": {}, "min_tokens": 3}
    assert call(server, "POST", "/v1/completions", body)[0] == 200


@pytest.mark.parametrize("method, path, body, headers, status, code", [
    ("POST", "/v1/completions", b"[1, 2]", {}, 400, "invalid_value"),
    ("POST", "/v1/completions", {"prompt": [1], "model": "gpt-4"}, {}, 404, "model_not_found"),
    ("GET", "/v2/completions", None, {}, 404, "not_found"),
    ("GET", "/v1/completions", None, {}, 405, "method_not_allowed"),
    ("POST", "/health", b"{}", {}, 405, "method_not_allowed"),
    ("DELETE", "/v1/models", None, {}, 405, "method_not_allowed"),
    ("POST", "/v1/completions", b'{"prompt": [1]}', {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    ("POST", "/v1/completions", b"prompt=1", {"Content-Type": "application/x-www-form-urlencoded"}, 415,
     "unsupported_media_type"),
    ("POST", "/v1/completions", b'{"prompt": [1]}', {"Content-Type": ""}, 415, "unsupported_media_type"),
])
def test_http_errors(server, method, path, body, headers, status, code):
    got, _, data = call(server, method, path, body, headers)
    assert got == status and json.loads(data)["error"]["code"] == code, data


@contextmanager
def raw(server):
    """A socket to the server, for what http.client will not send."""
    connection = socket.create_connection(("127.0.0.1", port(server)), timeout=TIMEOUT_S)
    try:
        yield connection
    finally:
        connection.close()


def read_all(connection):
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
    return data


def reply_of(connection):
    head, _, body = read_all(connection).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_malformed_requests_on_a_raw_socket(server):
    """A body over 1 MB (413, left unread), no Content-Length (400): OpenAI's shape, the connection closed; a
    request line that is no HTTP: 400 from uvicorn (h11), closed; and the server serves on."""
    with raw(server) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 2000000\r\n\r\n{")
        status, body = reply_of(connection)
        assert status == 413 and body["error"]["code"] == "request_too_large"
    with raw(server) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\r\n")
        status, body = reply_of(connection)
        assert status == 400 and "Content-Length" in body["error"]["message"]
    with raw(server) as connection:
        connection.sendall(b"this is not http\r\n\r\n")
        assert read_all(connection).startswith(b"HTTP/1.1 400 ")
    assert call(server, "GET", "/health")[0] == 200


SMUGGLED = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"  # a request hidden in a body: it must never be answered
LAST = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"  # a real one after it, then the close


@pytest.mark.parametrize("sent, statuses", [
    (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(SMUGGLED), SMUGGLED) + LAST,
     [200, 200]),  # a body a GET does not read: read as its body, all the same
    (b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
     % (len(SMUGGLED), SMUGGLED) + LAST, [200, 200]),  # a chunked body, read as chunks
    (b"POST /v1/nope HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
     % (len(SMUGGLED), SMUGGLED) + LAST, [404, 200]),  # refused by the router, its body unread
    (b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED) + LAST, [400]),  # a chunked POST: refused, closed
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
     b"Content-Length: 3\r\n\r\n{}" + SMUGGLED, [400]),  # two lengths
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1_4\r\n\r\n"
     + SMUGGLED, [400]),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: +14\r\n\r\n"
     + SMUGGLED, [400]),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 3\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED, [400]),  # a length and chunks
], ids=["get-body", "get-chunked", "404-body", "chunked-post", "two-lengths", "1_4", "+14", "length-and-chunked"])
def test_no_body_is_ever_run_as_a_request(server, sent, statuses):
    """HTTP desync, tried: a request hidden in a body never gets an answer. Each body is read by its length or
    its chunks (uvicorn's h11), or refused with the connection closed; lengths that are not one plain number
    are a 400."""
    with raw(server) as connection:
        connection.sendall(sent)
        replies = read_all(connection).split(b"HTTP/1.1 ")[1:]
    assert [int(reply.split()[0]) for reply in replies] == statuses, replies
    assert not any(b"nanobatch:" in reply for reply in replies), "the hidden request was answered"


def test_the_api_key_guards_every_route_but_health_and_metrics(server, monkeypatch):
    """With --api-key, every route needs `Authorization: Bearer KEY` (bearer in any case): 401 without, the
    page's route a small page that asks for the key. /health and /metrics do not. A browser that sends the key
    once, as the page does, gets a cookie (HttpOnly, SameSite=Strict, not the key) that lets it in from then on."""
    monkeypatch.setattr(server, "api_key", "sesame")
    body = {"prompt": [1], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"},
                    {"Authorization": "Basic sesame"}, {"Cookie": "nanobatch-key=sesame"}):
        status, _, data = call(server, "POST", "/v1/completions", body, headers)
        assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key", headers
        for path in ("/v1/models", "/steps"):
            assert call(server, "GET", path, headers=headers)[0] == 401, (path, headers)
        status, response_headers, data = call(server, "GET", "/", headers=headers)
        assert status == 401 and b'type="password"' in data and "set-cookie" not in response_headers
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert call(server, "POST", "/v1/completions", body, {"Authorization": f"{scheme} sesame"})[0] == 200
    assert call(server, "GET", "/health")[0] == 200 and call(server, "GET", "/metrics")[0] == 200
    status, headers, _ = call(server, "GET", "/", headers={"Authorization": "Bearer sesame"})
    cookie = headers["set-cookie"]
    assert status == 200 and "HttpOnly" in cookie and "SameSite=strict" in cookie and "sesame" not in cookie
    let_in = {"Cookie": cookie.split(";")[0]}
    assert call(server, "GET", "/", headers=let_in)[0] == 200
    assert call(server, "POST", "/v1/completions", body, let_in)[0] == 200
    assert call(server, "HEAD", "/steps", headers=let_in)[0] == 200


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


def test_a_failed_engine_is_a_500_engine_error(server, monkeypatch):
    """After the engine's thread has failed, a POST gets what /health says: 500, engine_error (docs/api.md)."""
    monkeypatch.setattr(server.live, "error", RuntimeError("a planted failure"))
    for method, path, body in (("POST", "/v1/completions", {"prompt": [1], "max_tokens": 1}), ("GET", "/health", None)):
        status, _, data = call(server, method, path, body)
        assert (status, json.loads(data)["error"]["code"]) == (500, "engine_error"), (path, data)


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
# 5) A client that goes away


def post(connection, body):
    """A completion request, sent on a raw socket."""
    data = json.dumps(body).encode()
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(data), data))


@pytest.mark.parametrize("when", ["mid-stream", "mid-wait"])
def test_a_client_that_goes_away_frees_its_slot_and_blocks(server, monkeypatch, caplog, when):
    """Mid-stream (its first token read, then the socket closed) or mid-wait (a whole reply awaited): once
    the server sees the client gone, the request leaves at the next step boundary as "abort", within two
    forwards of the engine's being let go, and its slot and blocks are back; /metrics says so; the server's
    log holds no traceback."""
    caplog.set_level(logging.INFO)
    before = metrics(server)
    gate = Gate(monkeypatch, n_free=1 if when == "mid-stream" else 0)
    try:
        with raw(server) as connection:
            post(connection, {"prompt": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 38, "temperature": 0.0,
                              "stream": when == "mid-stream"})
            if when == "mid-stream":
                received = b""
                while b"data: " not in received:  # its first token has come; the second is held
                    received += connection.recv(65536)
            else:
                wait_until(lambda: len(server.live.streams) == 1)  # taken in, and held in the forward
        # Cancelled, and (if the engine began its next step only after) gone already, before a forward.
        wait_until(lambda: all(stream.is_cancelled for stream in list(server.live.streams.values())))
    finally:
        gate.open()
    wait_until(lambda: metrics(server)["nanobatch:request_success_total|abort"] ==
               before["nanobatch:request_success_total|abort"] + 1)
    after = wait_until(lambda: (m := metrics(server))["nanobatch:num_requests_running"] == 0 and m)
    n_tokens = after["nanobatch:generation_tokens_total"] - before["nanobatch:generation_tokens_total"]
    assert n_tokens <= (1 if when == "mid-wait" else 2) + 1, f"{n_tokens} tokens made after the client left"
    assert after["nanobatch:kv_cache_usage_perc"] == 0.0 and after["nanobatch:num_requests_waiting"] == 0
    assert server.live.streams == {}, "the engine still holds the stream"
    assert not [record for record in caplog.records if record.exc_info], "a client that left wrote a traceback"


def test_a_request_cancelled_while_it_waits_leaves_the_queue(server, monkeypatch):
    """A runs, the engine held in its second step; B, sent meanwhile, waits (the waiting gauge: 1), and its client
    goes: at the next step B leaves the queue, told abort, and the gauge is back to 0; A finishes."""
    before = metrics(server)
    gate = Gate(monkeypatch, n_free=1)
    a = threading.Thread(target=complete, args=(server, Request([40], 6, temperature=0.0)), daemon=True)
    try:
        a.start()
        wait_until(lambda: metrics(server)["nanobatch:num_requests_running"] == 1)  # in its slot, its step 1 held
        with raw(server) as connection:
            post(connection, {"prompt": [50], "max_tokens": 6, "stream": True})
            wait_until(lambda: metrics(server)["nanobatch:num_requests_waiting"] == 1)
        wait_until(lambda: any(stream.is_cancelled for stream in list(server.live.submitted)))
    finally:
        gate.open()
    grown = lambda reason: metrics(server)[f"nanobatch:request_success_total|{reason}"] - \
        before[f"nanobatch:request_success_total|{reason}"]  # noqa: E731
    wait_until(lambda: grown("abort") == 1 and grown("length") == 1)
    a.join(TIMEOUT_S)
    assert metrics(server)["nanobatch:num_requests_waiting"] == 0 and len(server.queued) == 0


def test_a_stream_aborted_by_the_engine_ends_with_its_usage_and_done(server, monkeypatch):
    """A stream whose request the engine aborts (a cancel from the server's side, as a stop does) while its
    client still reads: its last chunk says "abort" with no token, then the usage counts the tokens it did
    stream, then [DONE]."""
    gate = Gate(monkeypatch, n_free=3)
    out = []
    client = threading.Thread(target=lambda: out.append(complete(
        server, Request([8, 8], 30, temperature=0.0), stream_options={"include_usage": True})), daemon=True)
    try:
        client.start()
        wait_until(lambda: len(server.live.streams) == 1 and metrics(server)["nanobatch:num_requests_running"] == 1)
        [stream] = server.live.streams.values()
        stream.cancel()
    finally:
        gate.open()
    client.join(TIMEOUT_S)
    [(status, chunks)] = out
    *token_chunks, usage_chunk, done = chunks
    assert status == 200 and done == "[DONE]"
    last = token_chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["token_ids"]) == ("abort", []), last
    n_streamed = sum(len(chunk["choices"][0]["token_ids"]) for chunk in token_chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == n_streamed >= 1


# ---------------------------------------------------------------------------------------------
# 6) The connections: a cap, and a timeout for one kept alive


@pytest.fixture(scope="module")
def small_server():
    """A second --quick server, the cap at 3 connections, and connections idle 0.5 s after a reply closed."""
    engine = serve.start(serve.parse(["--quick", "--port", "0", "--limit-concurrency", "3",
                                      "--timeout-keep-alive", "0.5"]))
    try:
        yield engine
    finally:
        ends_within(TIMEOUT_S, serve.stop, engine)


def test_past_the_connection_cap_a_503(small_server):
    """Three connections open (one a /steps stream): a fourth's request is refused with 503 at once; once one
    closes, requests are served again."""
    steps = http.client.HTTPConnection("127.0.0.1", port(small_server), timeout=TIMEOUT_S)
    steps.request("GET", "/steps")
    assert steps.getresponse().status == 200
    idle = [socket.create_connection(("127.0.0.1", port(small_server))) for _ in range(2)]
    try:
        assert call(small_server, "GET", "/health")[0] == 503
    finally:
        steps.close()
        for connection in idle:
            connection.close()
    wait_until(lambda: call(small_server, "GET", "/health")[0] == 200)


def test_an_idle_kept_alive_connection_is_closed(small_server):
    """A connection kept alive after its reply, idle, is closed once --timeout-keep-alive (0.5 s) has passed:
    it holds no place under the cap."""
    with raw(small_server) as connection:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert connection.recv(65536).startswith(b"HTTP/1.1 200 ")
        replied = time.monotonic()
        assert connection.recv(1) == b"", "the server sent more"  # it blocks until the server closes
    assert 0.4 < time.monotonic() - replied < 3


# ---------------------------------------------------------------------------------------------
# 7) Text, a piece per token


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
# 8) Ctrl-C, in a process of its own


def ctrl_c_in_flight(folder):
    """tools/serve.py in a process of its own (a signal goes to a whole process), as a class starts it, on every
    address (0.0.0.0) with no key, one slot, three streaming clients: once one runs and two wait, SIGINT; then a
    new request every few ms until the process has gone -> (the addresses it printed, a line each, its exit
    status, the seconds from the signal to its exit, each client's events, what each request sent while it
    stopped got: a status, or the error that refused it, and what it wrote on stderr)."""
    command = [sys.executable, str(REPO / "tools" / "serve.py"), "--quick", "--host", "0.0.0.0", "--port", "0",
               "--slots", "1"]
    with open(folder / "stderr", "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                   env={**os.environ, "NANOBATCH_CACHE": str(folder), "OMP_NUM_THREADS": "1",
                                        "https_proxy": "http://127.0.0.1:9"})  # offline at once, as test_cli.py
    try:
        lines, addresses = queue.Queue(), []
        threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
        while not addresses or not addresses[-1].startswith("http://127.0.0.1:"):  # the machine's, then its own
            addresses.append(lines.get(timeout=TIMEOUT_S).strip())
        host, port_number = addresses[-1][len("http://"):-1].split(":")
        streams = [None] * 3

        def client(k):
            connection = http.client.HTTPConnection(host, int(port_number), timeout=TIMEOUT_S)
            connection.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2 + k], "max_tokens": 1000,
                                                                      "stream": True}),
                               {"Content-Type": "application/json"})
            streams[k] = events(connection.getresponse().read())

        clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(3)]
        for thread in clients:
            thread.start()
        # All three in: one in the slot, two waiting (the waiting gauge counts a request from its submission,
        # the running one from the step that admits it, so two waiting alone may be the first two, not yet run).
        wait_until(lambda: metric(host, port_number, "nanobatch:num_requests_running") == 1 and
                   metric(host, port_number, "nanobatch:num_requests_waiting") == 2)
        process.send_signal(signal.SIGINT)
        sent, late = time.monotonic(), []
        while process.poll() is None and time.monotonic() - sent < TIMEOUT_S:
            late.append(late_request(host, port_number))
            time.sleep(0.005)
        status = process.wait(timeout=TIMEOUT_S)
        stopped_s = time.monotonic() - sent
        for thread in clients:
            thread.join(TIMEOUT_S)
        return addresses, status, stopped_s, streams, late, (folder / "stderr").read_text()
    finally:
        process.kill()
        process.wait()


def late_request(host, port_number):
    """A request sent while the server stops -> its status, or the name of the error that refused it."""
    connection = http.client.HTTPConnection(host, int(port_number), timeout=TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps({"prompt": [1], "max_tokens": 1}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        body = response.read()
        return response.status if response.status != 503 or json.loads(body)["error"] else "bad 503"
    except OSError as error:  # refused, or closed before a byte of a reply came
        return type(error).__name__
    finally:
        connection.close()


IN_BACKGROUND["test_ctrl_c_aborts_what_is_in_flight_and_exits_0"] = ctrl_c_in_flight  # started with the session


def test_ctrl_c_aborts_what_is_in_flight_and_exits_0(ran):
    """On 0.0.0.0 it prints, once it serves, an address a line that a browser can open (this machine's, 127.0.0.1
    last, never 0.0.0.0) and, with no key, a warning; SIGINT with one request in the one slot and two waiting:
    every stream ends, the waiting ones (at least) with "abort", then [DONE], and the process exits 0 within a
    couple of seconds; a request sent while it stops gets a 503, or its connection is refused (or closed before
    any reply), never a reply cut short; no traceback is written. (Its run starts Python and torch again: it
    starts with the session, beside the other tests, as tests/common.py's IN_BACKGROUND says.)"""
    addresses, status, stopped_s, streams, late, stderr = ran
    port_number = addresses[-1].rsplit(":", 1)[1]
    assert all(re.fullmatch(r"http://\d+\.\d+\.\d+\.\d+:" + port_number, address) and "0.0.0.0" not in address
               for address in addresses), addresses
    assert "WARNING: no --api-key, on 0.0.0.0" in stderr and "Traceback" not in stderr, stderr
    assert status == 0
    assert stopped_s < 5, "it took over 5 s to stop"  # about 0.5 s here; a loaded machine, more
    reasons = sorted(chunks[-2]["choices"][0]["finish_reason"] for chunks in streams)
    assert all(chunks[-1] == "[DONE]" for chunks in streams) and reasons[1:] == ["abort", "abort"], reasons
    assert late and set(late) <= {503, "ConnectionRefusedError", "RemoteDisconnected", "ConnectionResetError"}, late


def metric(host, port_number, name):
    """One sample of GET /metrics, read by its name."""
    connection = http.client.HTTPConnection(host, int(port_number), timeout=TIMEOUT_S)
    connection.request("GET", "/metrics")
    [line] = [line for line in connection.getresponse().read().decode().splitlines() if line.startswith(name + "{")]
    return float(line.split()[-1])
