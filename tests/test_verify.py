"""
tools/verify.py: in float64 every answer identical, a broken engine named, and the verdict's rule
(rounding or BUG) pinned at its edges. With --url, a server's answers alone against under load: the
project's own server changes none in float64, and changes planted in a fake server are found, placed
and judged; a server that cannot be asked is told why.
"""
import json
import math
import socket
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import nanobatch
import serve  # noqa: E402 (tools/, put on the path by tests.common)
from test_nanobatch import decode_sees_everything, prefill_sees_the_future  # the teeth's broken masks
from tests.common import TIMEOUT_S, V, ends_within
import verify  # noqa: E402 (tools/, put on the path by tests.common)
from verify import verdict  # noqa: E402
from tests.test_serve import port


# --verify: every answer identical in float64, a broken engine named, the verdict's rule


@pytest.fixture
def small_vocab_quick(monkeypatch):
    """verify --quick's tiny model with the engine tests' vocabulary of 512, not GPT-2's 50,257: its
    LM head in float64, over every position of every reference forward, took over 90% of these tests'
    time (4.2 s a run, 0.3 s with 512), and no claim below depends on the vocabulary (eos_id is None)."""
    monkeypatch.setattr(nanobatch, "TINY", replace(nanobatch.TINY, vocab_size=V))


@pytest.mark.usefixtures("small_vocab_quick")
@pytest.mark.parametrize("disaggregated", [[], ["--disaggregate"]])
def test_verify_float64_every_answer_identical(capsys, disaggregated):
    """In float64 the engine's greedy answers are the reference's, every one, prefilled on the belt
    or by the worker: exit status 0."""
    with pytest.raises(SystemExit) as exit_status:
        ends_within(TIMEOUT_S, verify.main, ["--quick", "--dtype", "float64", "--device", "cpu", *disaggregated])
    out = capsys.readouterr().out
    assert exit_status.value.code == 0, out[-2000:]
    answers = [line for line in out.splitlines() if line[:1].isalpha() and line[1:3] == "  "]
    assert len(answers) == 12 and all(line.split()[1] == "identical" for line in answers), out
    assert "12 answers: 12 identical, 0 rounding, 0 BUG" in out, out


@pytest.mark.usefixtures("small_vocab_quick")
@pytest.mark.parametrize("broken_mask", [decode_sees_everything, prefill_sees_the_future])
def test_verify_names_a_broken_engine(monkeypatch, capsys, broken_mask):
    """Teeth: with a broken mask, every answer that differs (the first one among them) is a BUG,
    none passes for rounding, and the exit status is 1."""
    monkeypatch.setattr(nanobatch, "attention_mask", broken_mask)
    with pytest.raises(SystemExit) as exit_status:
        verify.main(["--quick", "--dtype", "float64", "--device", "cpu"])
    out = capsys.readouterr().out
    verdicts = [line.split()[1] for line in out.splitlines() if line[:1].isalpha() and line[1:3] == "  "]
    differing = [name for name in verdicts if name != "identical"]
    assert exit_status.value.code == 1, out
    assert differing and set(differing) == {"BUG"}, out


@pytest.mark.usefixtures("small_vocab_quick")
def test_verify_judges_the_workers_first_token(monkeypatch, capsys):
    """Disaggregated, a worker whose prompt sees its own future is judged on its first tokens: the
    logits it reports for them are compared like the loop's, so answers that differ from their
    first token on are each a BUG, and the exit status is 1."""
    monkeypatch.setattr(nanobatch, "attention_mask", prefill_sees_the_future)
    with pytest.raises(SystemExit) as exit_status:
        ends_within(TIMEOUT_S, verify.main, ["--quick", "--dtype", "float64", "--device", "cpu", "--disaggregate"])
    out = capsys.readouterr().out
    verdicts = [line.split()[1:6] for line in out.splitlines() if line[:1].isalpha() and line[1:3] == "  "]
    assert exit_status.value.code == 1, out
    assert all(words[0] in ("identical", "BUG") for words in verdicts), out
    assert ["BUG", "first", "differs", "at", "token"] in verdicts and "first differs at token 0:" in out, out


def logits(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def test_verdict_rounding_within_the_dtype_error():
    """Tokens 0 and 1 are 1e-4 apart in float64. The reference is 2e-4 off and takes token 1, the
    engine 3e-4 off and takes token 0: a flip within the error the dtype itself makes."""
    exact = logits(1.0, 1.0001, 0.0, -1.0, dtype=torch.float64)
    sequential = logits(1.0, 1.0003, -0.0001, -1.0)  # takes token 1
    batched = logits(1.0003, 1.0, 0.0, -1.0)  # takes token 0
    name, figures = verdict(batched, sequential, exact)
    assert name == "rounding", figures
    assert figures["reference margin"] == pytest.approx(3e-4, abs=1e-6), figures
    assert figures["batched error"] == pytest.approx(3e-4, abs=1e-6), figures
    assert figures["reference error"] == pytest.approx(2e-4, abs=1e-6), figures


def test_verdict_bug_across_a_wide_margin():
    """The reference is 1e-4 off and takes token 0, 2 ahead; the engine takes token 1, 2 off."""
    exact = logits(3.0, 1.0, 0.0, -1.0, dtype=torch.float64)
    sequential = logits(3.0001, 1.0, 0.0, -1.0)
    batched = logits(1.0, 3.0, 0.0, -1.0)
    name, figures = verdict(batched, sequential, exact)
    assert name == "BUG", figures
    assert figures["batched error"] == pytest.approx(2.0), figures


def test_verdict_bug_at_a_near_tie():
    """The trap the margin sets: tokens 0 and 1 are 1e-4 apart, and the engine's logits differ
    from the reference's by 0.01, far more than the margin. A margin-against-difference rule would
    call it rounding, but the reference is 1e-6 off the exact logits and the engine 0.01: BUG."""
    exact = logits(1.0, 1.0001, 0.0, -1.0, dtype=torch.float64)
    sequential = logits(1.000001, 1.0001, 0.0, -1.0)
    batched = logits(1.01, 1.0001, 0.0, -1.0)
    name, figures = verdict(batched, sequential, exact)
    assert figures["reference margin"] < figures["|batched - reference|"], figures
    assert name == "BUG", figures


@pytest.mark.parametrize("batched_error, side, expected", [(3.9e-3, -1, "rounding"), (4.1e-3, +1, "BUG")])
def test_verdict_threshold_is_4x_the_reference_error_against_float64(batched_error, side, expected):
    """The rule as the README states it, pinned at its edge: the reference is 1e-3 off float64, so
    the engine may be up to 4e-3 off. 3.9e-3 off on the other side of float64 is rounding, though it
    lies 4.9e-3 from the reference's row; 4.1e-3 off on the same side is a BUG, though it lies only
    3.1e-3 from the reference's row. A rule that compared the two rows with each other, or took
    another factor, gets one of the two wrong."""
    exact = logits(1.0, 0.5, 0.0, -1.0, dtype=torch.float64)
    sequential = logits(1.001, 0.5, 0.0, -1.0)
    batched = logits(1.0 + side * batched_error, 0.5, 0.0, -1.0)
    name, figures = verdict(batched, sequential, exact)
    assert figures["reference error"] == pytest.approx(1e-3, rel=1e-3), figures
    assert name == expected, figures


@pytest.mark.parametrize("offset, expected", [(4e-16, "rounding"), (1e-9, "BUG"), (math.nan, "BUG")])
def test_verdict_in_float64(offset, expected):
    """In float64 the reference is the exact recomputation, its error 0: the engine may be off by
    rounding in the last bits only (the tolerance is a few roundings of the largest logit), and a
    NaN is never rounding."""
    exact = logits(1.0, 1.0, 0.5, -2.0, dtype=torch.float64)
    batched = exact + logits(offset, 0.0, 0.0, 0.0, dtype=torch.float64)
    name, figures = verdict(batched, exact.clone(), exact)
    assert name == expected, figures


# --url: a server's answers, alone against under load. The project's own server in float64 changes none; a
# fake server with changes planted has each found, placed and judged (rounding, BUG, or text only unjudged)


@pytest.mark.parametrize("path", [["--dtype", "float64"], ["--dtype", "float32", "--batch-invariant"]])
def test_url_own_server_changes_no_answer(capsys, path):
    """tools/serve.py (--quick, 4 slots so that requests queue and slots are reused), in float64 or batch-invariant
    in float32, asked 8 greedy prompts alone, all at once and in a shuffled wave: every answer under load is its
    alone answer."""
    engine = serve.start(serve.parse(["--quick", "--port", "0", "--slots", "4", *path]))
    try:
        url = f"http://127.0.0.1:{port(engine)}/"
        with pytest.raises(SystemExit) as exit_status:
            ends_within(TIMEOUT_S, verify.main, ["--url", url, "--n", "8", "--max-tokens", "8", "--waves", "1",
                                                 "--timeout", "30"])
    finally:
        ends_within(TIMEOUT_S, serve.stop, engine)
    out = capsys.readouterr().out
    assert exit_status.value.code == 0, out
    assert "all at once: 8 answers at once" in out and "wave 1: 8 answers at once" in out, out
    assert out.rstrip().endswith("8 prompts, 2 runs under load: 0 of 8 answers changed"), out


PROMPTS = verify.url_prompts("ids", 8, 0)  # what verify --url --n 8 asks, seed 0
TEXTS = verify.url_prompts("text", 8, 0)
# prompt index -> (the token where its answer under load first differs, the logprobs there: the alone run's
# list, then the loaded run's; "a" is the alone answer's token, "b" the loaded one's, "x1".. the rest)
PLANTED = {
    2: (5, {"a": -0.6931, "b": -0.6932, "x1": -2.0, "x2": -3.0, "x3": -4.0},  # a near-tie, and nothing else moved
        {"b": -0.6931, "a": -0.6932, "x1": -2.0, "x2": -3.0, "x3": -4.0}),
    5: (2, {"a": -0.1, "b": -2.5, "x1": -3.0, "x2": -4.0, "x3": -5.0},  # b was far behind: a real change
        {"b": -0.2, "a": -2.4, "x1": -3.0, "x2": -4.0, "x3": -5.0}),
    6: (3, {"a": -0.7, "b": -0.7005, "x1": -2.0, "x2": -3.0, "x3": -4.0},  # the trap: a near-tie alone, but
        {"b": -0.69, "a": -0.7, "x1": -2.3, "x2": -3.0, "x3": -4.0}),     # the list moved 0.31 under load
}


def fake_answer(prompt, max_tokens, under_load):
    """The fake server's answer -> (token ids, their logprobs in vLLM's shape). Token j of a prompt's answer
    is a function of the prompt; a planted prompt under load takes b, a's id + 1, at its token k, and its own
    tokens after."""
    tokens = [(sum(prompt) * 31 + 7 * j) % 50000 for j in range(max_tokens)]
    k, alone_list, loaded_list = PLANTED.get(PROMPTS.index(prompt), (max_tokens, None, None))
    ids = {"a": tokens[k] if k < max_tokens else None, "x1": 50001, "x2": 50002, "x3": 50003}
    if under_load:
        tokens[k:] = [token + 1 for token in tokens[k:]]
    lists = [{f"token_id:{t}": -0.5, **{f"token_id:{50001 + n}": -2.0 - n for n in range(4)}} for t in tokens]
    if k < max_tokens:
        ids["b"] = ids["a"] + 1
        planted = loaded_list if under_load else alone_list
        lists[k] = {f"token_id:{ids[name]}": value for name, value in planted.items()}
    names = [f"token_id:{t}" for t in tokens]
    return tokens, {"tokens": names, "token_logprobs": [lists[j][names[j]] for j in range(len(tokens))],
                    "top_logprobs": lists, "text_offset": [0] * len(tokens)}


def fake_server(kind):
    """A tiny OpenAI-compatible server in a thread -> (its URL, its stop). kind: "vllm" (token ids, logprobs and
    return_token_ids taken), "text" (as transformers serve: a text prompt only, return_token_ids refused, logprobs
    ignored), "no completions" (GET /v1/models only) or "key" (401 without its key). A prompt's first answer of
    more than one token is its alone answer; later ones are under load."""
    seen = set()

    class Fake(BaseHTTPRequestHandler):
        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if kind == "key" and self.headers.get("Authorization") != "Bearer right":
                return self.reply(401, {"error": {"message": "Unauthorized", "type": "invalid_request_error"}})
            self.reply(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if kind == "no completions":
                return self.reply(404, {"detail": "Not Found"})
            if kind == "text" and "return_token_ids" in body:
                return self.reply(422, {"detail": "Unexpected fields in the request: {'return_token_ids'}"})
            if kind == "text" and not isinstance(body["prompt"], str):
                return self.reply(400, {"detail": "prompt must be a string."})
            key = json.dumps(body["prompt"])
            under_load, n = key in seen, body["max_tokens"]
            if n > 1:
                seen.add(key)
            if kind == "text":  # the fake's words for a text prompt; prompt 2's word 3 changes under load
                words = [f"w{(len(body['prompt']) * 31 + 7 * j) % 1000}" for j in range(n)]
                if under_load and body["prompt"] in (TEXTS[2], " ".join(f"t{t}" for t in PROMPTS[2])) and n > 3:
                    words[3] = "changed"
                return self.reply(200, {"choices": [{"index": 0, "text": " ".join(words), "logprobs": None}]})
            tokens, logprobs = fake_answer(body["prompt"], n, under_load)
            self.reply(200, {"choices": [{"index": 0, "text": "", "token_ids": tokens, "logprobs": logprobs,
                                          "finish_reason": "length"}]})

        def log_message(self, *args):  # quiet
            pass

    # 64 connections wait for accept, not http.server's 5: past those, a client's connect waits 1 s to retry
    httpd = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 64, "daemon_threads": True})(
        ("127.0.0.1", 0), Fake)
    thread = threading.Thread(target=httpd.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    thread.start()

    def stop():
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)

    return f"http://127.0.0.1:{httpd.server_address[1]}/", stop


def verify_url(capsys, kind, *options):
    """verify --url against a fake server of that kind -> (exit status, what it printed on stdout and stderr)."""
    url, stop = fake_server(kind)
    try:
        with pytest.raises(SystemExit) as exit_status:
            ends_within(TIMEOUT_S, verify.main, ["--url", url, "--n", "8", "--max-tokens", "8", "--waves", "1",
                                                 "--timeout", "10", *options])
    finally:
        stop()
    printed = capsys.readouterr()
    return exit_status.value.code, printed.out, printed.err


def test_url_finds_places_and_judges_planted_changes(capsys):
    """Three answers planted to change under load, in both runs under load: each found at its token, the
    near-tie called rounding (margins 1e-4, nothing else moved), the wide gap a BUG, and the trap a BUG too
    (a margin of 5e-4 alone, but the rest of the list moved 0.31); exit status 1."""
    status, out, _ = verify_url(capsys, "vllm")
    lines = [line.split() for line in out.splitlines() if line.startswith("  #")]
    assert status == 1, out
    assert "all at once: 8 answers at once" in out and "3 changed" in out, out
    found = {(words[0], words[5].rstrip(":"), words[words.index("load;") + 1].rstrip(":")) for words in lines}
    assert found == {("#2", "5", "rounding"), ("#5", "2", "BUG"), ("#6", "3", "BUG")} and len(lines) == 6, out
    assert "margin alone 0.0001, under load 0.0001; the 5 tokens both list moved 0.0002 against one another" in out
    assert "8 prompts, 2 runs under load: 3 of 8 answers changed (2 rounding, 4 BUG, 0 unjudged changes)" in out, out


@pytest.mark.parametrize("prompts", [["--prompts", "text"], ["--as-text", "t{}"]])
def test_url_text_only_server_compared_as_text(capsys, prompts):
    """A server that takes text prompts only, refuses return_token_ids and gives no logprobs (as transformers
    serve does), asked random words or the random ids written as words: its answers are compared as text, the
    change placed at its character and word, and unjudged."""
    status, out, _ = verify_url(capsys, "text", *prompts)
    assert status == 1, out
    assert "note: the server refuses return_token_ids (HTTP 422" in out and "compared: text" in out, out
    assert out.count("  #2   first differs at character 15 (word 3): ") == 2, out
    assert out.count(" alone, 'changed w") == 2 and out.count("' under load; unjudged") == 2, out
    assert "8 prompts, 2 runs under load: 1 of 8 answers changed (0 rounding, 0 BUG, 2 unjudged changes)" in out, out


@pytest.mark.parametrize("kind, words", [
    ("closed", "cannot reach"),
    ("key", "HTTP 401, Unauthorized: give the server's key with --api-key KEY"),
    ("no completions", "POST /v1/completions: HTTP 404, Not Found: the server has no such route"),
    ("text", "the server refuses a prompt of token ids (HTTP 400, prompt must be a string.): ask with --prompts text"),
])
def test_url_says_why_a_server_cannot_be_asked(capsys, kind, words):
    """Unreachable, a key wanted, no completions API, token ids refused: each said in one line, exit status 2."""
    if kind == "closed":  # a port just freed: nothing listens there
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{probe.getsockname()[1]}/"
        with pytest.raises(SystemExit) as exit_status:
            verify.main(["--url", url, "--timeout", "10"])
        status, err = exit_status.value.code, capsys.readouterr().err
    else:
        status, _, err = verify_url(capsys, kind)
    assert status == 2 and words in err, err
