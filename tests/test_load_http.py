"""
tools/load_http.py, latency against load measured by a client, against a live --quick server in this process
(serve.start on a free port of 127.0.0.1). The server's model is made to take at least FLOOR_S a step, so that
every time the tool reports has a floor the arithmetic states, on any machine however busy:
1) the counts are what the server did: its /metrics counters, the draw's prompts, what the streams carried;
2) the times: a TTFT is at least a step, a request's ITLs at least a step each on the whole, its E2E at least a
   step a token, and TTFT + its ITLs is its E2E; the requests went out at the draw's times / rate;
3) the percentiles are nearest rank: on values whose percentiles are known, and on the run's own values;
4) a time limit bounds a run: streams still open are cut, the server cancels them, every thread is joined;
   a request the server refuses is counted failed;
5) a server that takes text only (transformers serve) is sent each prompt's ids as words, and its count read.
The tool runs as a user runs it, through main(), in about a second.
"""
import contextlib
import io
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import load  # tools/, put on the path by tests.common
import load_http
import serve
from tests.common import TIMEOUT_S, ends_within
from tests.test_serve import metrics

FLOOR_S = 0.01  # every engine step sleeps this long first: a step, and so a token, takes at least this
RATE, N_REQUESTS = 16, 12  # requests a second, and how many: load.py's draw of 12 arrives within 0.41 s


@pytest.fixture(scope="module")
def server():
    """A --quick server whose every forward takes at least FLOOR_S; stopped, and its threads joined, at the end."""
    engine = serve.start(serve.parse(["--quick", "--port", "0", "--max-len", "128"]))
    forward = engine.model.forward_packed

    def slowed(*args, **kwargs):
        time.sleep(FLOOR_S)
        return forward(*args, **kwargs)

    engine.model.forward_packed = slowed  # read by the engine's thread at every step
    try:
        yield engine
    finally:
        ends_within(TIMEOUT_S, serve.stop, engine)  # the server stops, or the test fails: never hangs


def url(server):
    return f"http://127.0.0.1:{server.address[1]}/"


def run_tool(server, tmp_path, *options):
    """load_http.main with options -> (its results, what it printed on stdout, the JSON it wrote)."""
    path = tmp_path / "load.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed, contextlib.redirect_stderr(io.StringIO()):
        results = load_http.main(["--url", url(server), "--warmups", "0", "--json", str(path), *options])
    assert not [t.name for t in threading.enumerate() if t.name.startswith("load_http")], "a thread outlived its run"
    return results, printed.getvalue(), json.loads(path.read_text())


@pytest.fixture(scope="module")
def measured(server, tmp_path_factory):
    """One run at RATE, with the server's counters read before and after -> (figures, replies, printed,
    written, the counters' growth)."""
    before = metrics(server)
    results, printed, written = run_tool(server, tmp_path_factory.mktemp("load"), "--rate", str(RATE),
                                         "--requests", str(N_REQUESTS))
    # A request's last token reaches its client in phase 5 of its step, and /metrics counts it in phase 6: a moment
    # later, a busy machine's moment longer. Read once every request of the run is counted (or the wait runs out).
    ended = [f"nanobatch:request_success_total|{reason}" for reason in ("stop", "length", "abort")]
    deadline = time.perf_counter() + TIMEOUT_S
    while sum((after := metrics(server))[name] - before[name] for name in ended) < N_REQUESTS and \
            time.perf_counter() < deadline:
        time.sleep(0.01)
    [(rate, figures, replies)] = results
    assert rate == RATE
    return figures, replies, printed, written, {name: after[name] - before[name] for name in after}


def nearest_rank(values, q):
    """The percentile as its definition states it: the value at rank ceil(q/100 x n) of the sorted values."""
    return sorted(values)[math.ceil(q / 100 * len(values)) - 1]


# ---------------------------------------------------------------------------------------------
# 1) Counts


def test_the_counts_are_what_the_server_did(measured):
    """Every request completed; the tokens the report counts are those /metrics counted, the prompt tokens those
    the draw holds, and each answer is its drawn length unless the server stopped it at EOS."""
    figures, replies, printed, written, grown = measured
    workload = load_http.draw(0, N_REQUESTS, load_http.GPT2_VOCAB)
    assert (figures["completed"], figures["failed"], figures["not sent"]) == (N_REQUESTS, 0, 0)
    finished = sum(grown[f"nanobatch:request_success_total|{reason}"] for reason in ("stop", "length"))
    assert finished == N_REQUESTS and grown["nanobatch:request_success_total|abort"] == 0
    assert figures["output tokens"] == grown["nanobatch:generation_tokens_total"] == \
        sum(reply.output_tokens for reply in replies)
    assert figures["input tokens"] == grown["nanobatch:prompt_tokens_total"] == sum(len(p) for p, _, _ in workload)
    for reply, (_, n_new, _) in zip(replies, workload):
        assert reply.max_tokens == n_new and len(reply.chunk_s) == reply.output_tokens, reply  # a chunk a token
        assert reply.output_tokens == n_new if reply.finish_reason == "length" else reply.finish_reason == "stop"
    assert figures["requests/s"] == pytest.approx(N_REQUESTS / figures["duration (s)"])
    assert figures["output tokens/s"] == pytest.approx(figures["output tokens"] / figures["duration (s)"])
    [line] = [line.split() for line in printed.splitlines() if line.startswith(f"{RATE:>6}")]
    assert line[1:3] == [str(N_REQUESTS)] * 2 and float(line[5]) == round(figures["output tokens/s"], 1), line
    assert written[0]["output tokens"] == figures["output tokens"] and len(written[0]["replies"]) == N_REQUESTS


# ---------------------------------------------------------------------------------------------
# 2) Times


def test_each_time_is_at_least_the_steps_it_spans(measured):
    """A first token needs a step; a request's n tokens come in n steps, so its E2E is at least n steps. Its ITLs
    add up to n - 1 steps less what held its first chunk up on its way (a busy machine holds one up for a few ms,
    and that lengthens its TTFT as much): so the E2E, TTFT + the ITLs as vLLM adds them, carries the bound. And
    the median ITL, a step, is at least the floor."""
    figures, replies, _, _, _ = measured
    for reply in replies:
        n = reply.output_tokens
        assert reply.ttft_s >= FLOOR_S and reply.e2el_s >= n * FLOOR_S, reply
        assert reply.ttft_s + sum(reply.itl_s) == pytest.approx(reply.e2el_s, abs=1e-9)
    assert figures["itl"]["P50"] >= FLOOR_S
    assert figures["duration (s)"] >= max(reply.sent_s + reply.e2el_s for reply in replies)


def test_the_requests_went_out_at_the_draws_times(measured):
    """Poisson arrivals at RATE a second: request i is sent at the draw's time i / RATE, give or take a thread's
    start, in the draw's order."""
    _, replies, _, _, _ = measured
    workload = load_http.draw(0, N_REQUESTS, load_http.GPT2_VOCAB)
    late = [reply.sent_s - at / RATE for reply, (_, _, at) in zip(replies, workload)]
    assert all(-1e-3 <= lateness < 0.1 for lateness in late), late


# ---------------------------------------------------------------------------------------------
# 3) Percentiles


def test_percentiles_are_nearest_rank(measured):
    """On values whose percentiles are known (Wikipedia's worked example of the nearest-rank method: of 15, 20,
    35, 40, 50 the 5th percentile is 15, the 30th 20, the 40th 20, the 50th 35, the 100th 50), and on the run:
    each P50, P90, P99 and mean the report gives is that of the replies' own values."""
    example = [15, 20, 35, 40, 50]
    assert [load_http.percentile(example, q) for q in (5, 30, 40, 50, 100)] == [15, 20, 20, 35, 50]
    assert [load_http.percentile(list(range(100, 0, -1)), q) for q in load_http.QUANTILES] == [50, 90, 99]
    assert [load_http.percentile(list(range(1, 11)), q) for q in load_http.QUANTILES] == [5, 9, 10]
    figures, replies, _, _, _ = measured
    values = {"ttft": [r.ttft_s for r in replies], "itl": [gap for r in replies for gap in r.itl_s],
              "e2el": [r.e2el_s for r in replies]}
    for name, these in values.items():
        assert figures[name] == {"mean": pytest.approx(sum(these) / len(these)),
                                 **{f"P{q}": nearest_rank(these, q) for q in (50, 90, 99)}}, name


# ---------------------------------------------------------------------------------------------
# 4) Bounds and failures


def test_a_time_limit_cuts_the_run_and_the_server_frees_what_was_cut(server, tmp_path):
    """With --time-limit 0.15, the 7 requests due after it are not sent, and those still streaming then are cut:
    the second, third and fifth, which ask 19, 15 and 25 tokens, at least 0.19 s. The server sees each cut
    client gone and aborts its request; the tool joined its threads (run_tool checks)."""
    before = metrics(server)
    [(_, figures, replies)], _, _ = run_tool(server, tmp_path, "--rate", str(RATE), "--requests", str(N_REQUESTS),
                                             "--time-limit", "0.15")
    workload = load_http.draw(0, N_REQUESTS, load_http.GPT2_VOCAB)
    assert [reply.sent_s is None for reply in replies] == [at / RATE >= 0.15 for _, _, at in workload] == \
        [False] * 5 + [True] * 7
    cut = [reply.index for reply in replies if reply.error == "cut at the time limit"]
    assert {1, 2, 4} <= set(cut) and figures["failed"] == len(cut) and figures["completed"] == 5 - len(cut)
    deadline = time.perf_counter() + TIMEOUT_S
    while metrics(server)["nanobatch:request_success_total|abort"] - before["nanobatch:request_success_total|abort"] \
            < len(cut) and time.perf_counter() < deadline:
        time.sleep(0.02)
    after = metrics(server)
    assert after["nanobatch:request_success_total|abort"] - before["nanobatch:request_success_total|abort"] == len(cut)


def test_a_refused_request_is_counted_failed(server, tmp_path):
    """Token ids beyond the server's vocabulary: it answers 400, and the tool counts those requests failed, with
    the server's reason, and their tokens nowhere."""
    [(_, figures, replies)], _, _ = run_tool(server, tmp_path, "--rate", "inf", "--requests", "3",
                                             "--vocab-size", "1000000")
    assert figures["completed"] == 0 and figures["failed"] == 3 and figures["output tokens"] == 0
    assert all(reply.error.startswith("HTTP 400") and "outside the vocabulary" in reply.error for reply in replies)


def test_a_text_only_server_is_sent_words_and_its_usage_read_beside_its_last_choice(tmp_path):
    """A server as transformers serve is: prompts as text only (400 for token ids), each token a chunk of text,
    and its count (usage) beside the last choice, an empty one. With --as-text 't{}' each prompt goes as its
    ids written as words, and each request's output tokens are the server's count, not its chunks (one more)."""
    got = []

    class TextOnly(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if not isinstance(body["prompt"], str):
                data = b'{"detail": "prompt must be a string."}'
                self.send_response(400)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return self.wfile.write(data)
            got.append(body["prompt"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["max_tokens"]
            chunks = [{"choices": [{"index": 0, "text": f" t{j}"}]} for j in range(n)]
            chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                           "usage": {"completion_tokens": n}})
            self.wfile.write(b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), TextOnly)
    thread = threading.Thread(target=httpd.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    thread.start()
    try:
        base = ["--url", f"http://127.0.0.1:{httpd.server_address[1]}/", "--model", "peer", "--rate", "inf",
                "--requests", "4", "--warmups", "0", "--time-limit", "30"]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            [(_, ids, _)] = ends_within(TIMEOUT_S, load_http.main, base)
            [(_, figures, replies)] = ends_within(TIMEOUT_S, load_http.main, [*base, "--as-text", "t{}"])
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
    workload = load.draw(0, 4, load_http.GPT2_VOCAB)
    assert ids["failed"] == 4 and figures["completed"] == 4, (ids, figures)
    assert sorted(got) == sorted(" ".join(f"t{token}" for token in prompt) for prompt, _, _ in workload), got
    assert [reply.output_tokens for reply in replies] == [n_new for _, n_new, _ in workload], replies
