"""
Latency against load in wall time, measured by a client: tools/load.py's seeded workload sent over HTTP to a
running OpenAI-compatible server, Poisson arrivals at a chosen rate, every answer streamed, as `vllm bench
serve` sends it. It reports request throughput, output tokens/s, and TTFT, ITL and end-to-end latency at P50,
P90 and P99.

    OMP_NUM_THREADS=1 python tools/serve.py --max-len 128 &            GPT-2 124M (offline: random) on :8000
    python tools/load_http.py --url http://127.0.0.1:8000/ --rate 1 2   200 requests at 1 a second, then at 2
    python tools/load_http.py --url URL --rate inf --requests 8          8 at once (--max-concurrency 1: in turn)
    python tools/load_http.py --url URL --rate 4 --as-text 't{}'         a server that takes text prompts only

A tool beside tools/load.py, not inside it: load.py runs the engine in its own process on a clock of steps;
this is a client, on a clock of seconds, of any server that speaks OpenAI's completions API. It sends no field
that only nanobatch knows, and it talks to nothing but the URL it is given. It takes load.py's draw (its own
code uses the standard library only), so that a rate here and a rate in steps there serve the same prompts and
answer lengths, in the same order, at the same gaps scaled.

What it measures, as vLLM's `bench serve` defines it (read in vllm-project/vllm: vllm/benchmarks/serve.py at
def9ce85ba10, calculate_metrics; vllm/benchmarks/lib/endpoint_request_func.py at 3aee4a4f4c4d,
async_request_openai_completions):
- TTFT, time to first token: from just before the request is sent to the first streamed chunk with a choice;
- ITL, inter-token latency: from one such chunk to the next (a chunk is a step's token, here and in vLLM);
- end-to-end latency: from just before the request is sent to its last chunk with a choice;
- output tokens: the usage the server reports at the end (stream_options.include_usage), else chunks counted.
  The server stops an answer at EOS (OpenAI's API has no ignore_eos), so the count is what came back;
- request throughput and output tokens/s: completed requests and their tokens over the run, from the first
  send until every reply is in.
Percentiles are nearest rank (nanobatch.percentile, as every other figure of this project); vLLM interpolates
between ranks (numpy's default), which differs from this by less than the gap between two neighbouring values.
"""
import argparse
import http.client
import json
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py, for load.py's draw
from belt_svg import checked_path  # noqa: E402
from load import N_REQUESTS, draw  # noqa: E402
from nanobatch import percentile  # noqa: E402

GPT2_VOCAB = 50257  # the token ids a prompt may hold: GPT-2's, any GPT-2 server's
QUANTILES = (50, 90, 99)  # the percentiles reported
GRACE_S = 5  # past the time limit, how long a request's thread may take to notice and end
PROGRESS_S = 5  # a progress line on stderr this often


# ---------------------------------------------------------------------------------------------
# One request: sent, its answer streamed, each chunk's time taken as it comes


@dataclass
class Reply:
    """One request as the client saw it: when it was sent (s from the run's start), when each chunk with a
    choice came (s from its send), its tokens, and what went wrong, if anything."""
    index: int
    prompt_tokens: int
    max_tokens: int
    sent_s: float | None = None  # None: never sent (the time limit came first)
    chunk_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def is_ok(self):  # as vLLM counts a success: a 200 whose stream held a chunk with a choice
        return self.error is None and bool(self.chunk_s)

    @property
    def ttft_s(self):
        return self.chunk_s[0]

    @property
    def itl_s(self):  # the gaps between its chunks, each its own value (as vLLM's itl list)
        return [later - earlier for earlier, later in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def e2el_s(self):
        return self.chunk_s[-1]


def events(response, sock, deadline):
    """A server-sent events body -> each event's data as it completes (a blank line ends an event). Other
    fields (event:, id:) and comments (":...", a keep-alive) carry no tokens. Each read of sock, the
    response's socket, waits at most until the deadline: then TimeoutError."""
    lines = []
    while True:
        sock.settimeout(max(deadline - time.perf_counter(), 0.001))
        line = response.readline()
        if not line:
            break
        line = line.decode().rstrip("\r\n")
        if line.startswith("data:"):
            lines.append(line[len("data:"):].removeprefix(" "))
        elif not line and lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


def send(target, reply, body, started, deadline):
    """reply's request, streamed; fills in reply. started: the run's perf_counter() at its start."""
    headers = {"Content-Type": "application/json", **target["headers"]}
    connection = http.client.HTTPConnection(target["host"], target["port"],
                                            timeout=max(deadline - time.perf_counter(), 0.001))
    sent, response = time.perf_counter(), None
    reply.sent_s = sent - started
    try:
        connection.request("POST", target["path"], json.dumps(body), headers)
        sock = connection.sock  # kept: a reply that closes its connection leaves the response holding it alone
        response = connection.getresponse()
        if response.status != 200:
            reply.error = f"HTTP {response.status}: {response.read(300).decode(errors='replace')}"
            return
        usage = None
        for data in events(response, sock, deadline):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):  # a token (its text may be empty: offline, or half a character)
                reply.chunk_s.append(time.perf_counter() - sent)
                reply.finish_reason = chunk["choices"][0].get("finish_reason") or reply.finish_reason
            elif "error" in chunk:
                reply.error = f"in the stream: {chunk['error']}"
            if chunk.get("usage"):  # the server's own count: in a chunk of its own (vLLM), or beside the last
                usage = chunk["usage"].get("completion_tokens")  # choice (transformers serve)
        reply.output_tokens = len(reply.chunk_s) if usage is None else usage
        if not reply.chunk_s and reply.error is None:
            reply.error = "the stream held no token"
    except TimeoutError:
        reply.error = "cut at the time limit"
    except (OSError, http.client.HTTPException, ValueError) as error:
        reply.error = f"{type(error).__name__}: {error}"
    finally:  # a stream cut short: the server sees its client gone, and cancels the request
        if response is not None:
            response.close()  # it holds the socket once the server has said it closes the connection
        connection.close()


# ---------------------------------------------------------------------------------------------
# A run: the requests sent at their arrival times, a thread each, every thread joined


def run(target, workload, rate, max_concurrency=None, time_limit_s=600, tell=None, as_text=None):
    """workload (load.draw's (prompt, answer length, arrival at one a second)) sent at `rate` requests a second
    (math.inf: all at once), at most max_concurrency in flight -> (its Replies, the run's seconds). Nothing is
    sent past time_limit_s, and a reply still streaming then is cut. as_text: a format ("t{}") that writes each
    prompt's token ids as words, for a server that takes text only."""
    replies = [Reply(i, len(prompt), n_new) for i, (prompt, n_new, _) in enumerate(workload)]
    permits = threading.Semaphore(max_concurrency or len(workload))  # vLLM's --max-concurrency
    started = time.perf_counter()
    deadline = started + time_limit_s

    def client(reply, body):  # a request's thread: its whole story; what goes wrong is told in its Reply
        if not permits.acquire(timeout=max(deadline - time.perf_counter(), 0)):
            reply.error = "not sent: no free place before the time limit"
            return
        try:
            send(target, reply, body, started, deadline)
        except Exception as error:  # a reply this client cannot read (a chunk not in OpenAI's shape, say)
            reply.error = f"the client failed: {error!r}"
        finally:
            permits.release()

    threads, last_told = [], started
    for reply, (prompt, n_new, at) in zip(replies, workload):
        due = started + (0 if math.isinf(rate) else at / rate)
        while (now := time.perf_counter()) < min(due, deadline):  # wait for its arrival, telling progress
            time.sleep(min(due - now, 0.5))
            if tell and now - last_told >= PROGRESS_S:
                tell(replies, now - started)
                last_told = now
        if due >= deadline:
            break  # it and those after it are never sent
        body = {"model": target["model"], "max_tokens": n_new, "temperature": 0,
                "prompt": prompt if as_text is None else " ".join(as_text.format(token) for token in prompt),
                "stream": True, "stream_options": {"include_usage": True}}
        threads.append(threading.Thread(target=client, args=(reply, body), name=f"load_http {reply.index}",
                                        daemon=True))
        threads[-1].start()
    for thread in threads:  # each ends by the deadline: its reads wait no longer
        while thread.is_alive() and time.perf_counter() < deadline + GRACE_S:
            thread.join(timeout=min(PROGRESS_S, max(deadline + GRACE_S - time.perf_counter(), 0.01)))
            if tell and thread.is_alive():
                tell(replies, time.perf_counter() - started)
    seconds = time.perf_counter() - started
    hung = [thread.name for thread in threads if thread.is_alive()]
    if hung:
        raise RuntimeError(f"{len(hung)} request threads did not end {GRACE_S} s past the time limit: {hung[:5]}")
    return replies, seconds


def summarize(replies, seconds):
    """The run's figures, as vLLM's calculate_metrics: counts, throughput, and each time's mean and percentiles
    in seconds, over the requests that succeeded."""
    done = [reply for reply in replies if reply.is_ok]
    times = {"ttft": [r.ttft_s for r in done], "itl": [gap for r in done for gap in r.itl_s],
             "e2el": [r.e2el_s for r in done]}
    figures = {"requests": len(replies), "completed": len(done),
               "failed": sum(r.error is not None and r.sent_s is not None for r in replies),
               "not sent": sum(r.sent_s is None for r in replies), "duration (s)": seconds,
               "input tokens": sum(r.prompt_tokens for r in done), "output tokens": sum(r.output_tokens for r in done)}
    figures["requests/s"] = figures["completed"] / seconds
    figures["output tokens/s"] = figures["output tokens"] / seconds
    for name, values in times.items():
        figures[name] = {"mean": statistics.mean(values) if values else None,
                         **{f"P{q}": percentile(values, q) if values else None for q in QUANTILES}}
    return figures


# ---------------------------------------------------------------------------------------------
# The command line: find the server, check it with a request, then each rate in turn


def target_of(url, endpoint, model):
    """The URL given -> where to send (host, port, the completions path), the headers, and the model's name:
    --model, else the first that GET /v1/models lists (as vLLM's bench serve asks)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{url}: give the server's address as http://HOST:PORT/ (http only)")
    base = parts.path.rstrip("/")
    target = {"host": parts.hostname, "port": parts.port or 80, "path": base + endpoint, "model": model,
              "headers": {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}  # as vLLM's client
              if os.environ.get("OPENAI_API_KEY") else {}}
    if model is None:
        connection = http.client.HTTPConnection(target["host"], target["port"], timeout=30)
        try:
            connection.request("GET", base + "/v1/models", headers=target["headers"])
            response = connection.getresponse()
            listed = json.loads(response.read()) if response.status == 200 else {}
        finally:
            connection.close()
        if not listed.get("data"):
            raise ValueError(f"GET {base}/v1/models gave no model (HTTP {response.status}): give --model")
        target["model"] = listed["data"][0]["id"]
    return target


def figure(value):
    """A time to 3 or 4 figures: 0.46, 37.5, 964."""
    return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f}"


def print_table(rows):
    """A line per rate: requests sent and done, throughput, then each latency's P50 / P90 / P99 (TTFT and E2E in
    s, ITL in ms)."""
    print(f"{'rate':>6}{'sent':>6}{'done':>6}{'s':>7}{'req/s':>7}{'tok/s':>7}{'TTFT P50/P90/P99 s':>22}"
          f"{'ITL P50/P90/P99 ms':>21}{'E2E P50/P90/P99 s':>22}")
    for rate, f in rows:
        cells = [" / ".join(figure(scale * f[name][f"P{q}"]) for q in QUANTILES) if f["completed"] else "-"
                 for name, scale in (("ttft", 1), ("itl", 1e3), ("e2el", 1))]
        print(f"{rate:>6g}{f['requests'] - f['not sent']:>6}{f['completed']:>6}{f['duration (s)']:>7.1f}"
              f"{f['requests/s']:>7.2f}{f['output tokens/s']:>7.1f}{cells[0]:>22}{cells[1]:>21}{cells[2]:>22}",
              flush=True)


def load_http(args):
    """Each rate in turn, after args.warmups requests not counted -> [(rate, summarize's figures, Replies)]."""
    target = target_of(args.url, args.endpoint, args.model)
    workload = draw(args.seed, args.requests, args.vocab_size)
    answers = [n for _, n, _ in workload]
    print(f"load_http: {args.requests} requests of tools/load.py's draw (seed {args.seed}): prompts of 4-16 tokens, "
          f"answers of {min(answers)}-{max(answers)} asked (mean {statistics.mean(answers):.2f}), streamed to "
          f"{target['model']} at {args.url}" + (f", at most {args.max_concurrency} at once" if args.max_concurrency
                                                else ""), flush=True)

    def tell(replies, seconds):  # progress, on stderr
        sent = sum(r.sent_s is not None for r in replies)
        ended = [r for r in replies if r.is_ok or r.error is not None]
        print(f"load_http: {seconds:.0f} s: {sent} sent, {len(ended)} ended "
              f"({sum(r.error is not None for r in ended)} failed)", file=sys.stderr, flush=True)

    for _ in range(args.warmups):  # as vLLM's initial test run: the URL checked, and the server warmed
        warmup, _ = run(target, workload[:1], math.inf, time_limit_s=args.time_limit, as_text=args.as_text)
        if not warmup[0].is_ok:
            raise SystemExit(f"load_http: the first request failed: {warmup[0].error}")
    results = []
    for rate in args.rate:
        print(f"load_http: {rate:g} requests a second", file=sys.stderr, flush=True)
        replies, seconds = run(target, workload, rate, args.max_concurrency, args.time_limit, tell, args.as_text)
        results.append((rate, summarize(replies, seconds), replies))
        tell(replies, seconds)
    print_table([(rate, figures) for rate, figures, _ in results])
    if args.json:
        Path(args.json).write_text(json.dumps([{"rate": rate, **figures, "replies": [asdict(r) for r in replies]}
                                               for rate, figures, replies in results], indent=1))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tools/load_http.py", description="latency against load, by a client "
                                     "of a running OpenAI-compatible server")
    parser.add_argument("--url", required=True, help="the server, as tools/serve.py prints it: http://HOST:PORT/")
    parser.add_argument("--rate", type=float, nargs="+", required=True, metavar="R",
                        help="requests a second, Poisson arrivals (inf: all at once); several: each in turn")
    parser.add_argument("--requests", type=int, default=N_REQUESTS, metavar="N",
                        help=f"N requests, drawn as tools/load.py draws its {N_REQUESTS} ({N_REQUESTS})")
    parser.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                        help="at most N requests in flight; the others wait, unsent (no limit)")
    parser.add_argument("--time-limit", type=float, default=600, metavar="S",
                        help="a run's seconds, at most: nothing is sent after, a stream still open is cut (600)")
    parser.add_argument("--warmups", type=int, default=1, metavar="N",
                        help="requests sent first and not counted: the URL checked, the server warmed (1)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed, as tools/load.py's (0)")
    parser.add_argument("--vocab-size", type=int, default=GPT2_VOCAB, metavar="V",
                        help=f"prompts' token ids are below V (GPT-2's, {GPT2_VOCAB})")
    parser.add_argument("--model", default=None, help="the model's name in the API (the first of /v1/models)")
    parser.add_argument("--endpoint", default="/v1/completions", help="the completions path (/v1/completions)")
    parser.add_argument("--as-text", metavar="FORMAT", default=None,
                        help="send each prompt as text, its token ids written with FORMAT (e.g. 't{}') and joined by "
                             "spaces: for a server that takes text only, whose tokenizer reads them back as the ids")
    parser.add_argument("--json", metavar="FILE", type=checked_path, help="every figure and reply, written to FILE")
    args = parser.parse_args(argv)
    if any(rate <= 0 for rate in args.rate) or args.requests < 1 or (args.max_concurrency or 1) < 1 \
            or args.time_limit <= 0 or args.warmups < 0:
        parser.error("rates, --requests, --max-concurrency and --time-limit must be positive; --warmups at least 0")
    if args.as_text is not None and "{}" not in args.as_text:
        parser.error("--as-text FORMAT writes a token id where its {} is: 't{}', say")
    try:
        return load_http(args)
    except (ValueError, OSError, http.client.HTTPException) as error:
        raise SystemExit(f"load_http: {error}") from None


if __name__ == "__main__":
    main()
