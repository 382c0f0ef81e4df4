"""
What every test file shares, in one place: the tiny seeded models and their fixtures, the `offline`
fixture, the quick demo run once for the suite (the labs and the page's tests read it), seeded
workloads and the six requests worked by hand, the helpers that compare answers and print the worst
difference, and the guard that keeps a hung prefill worker from hanging the suite.
test_nanobatch.py (the proof) and each file of tests/ import the helpers they use (`from tests.common
import ...`); the fixtures reach every test through conftest.py, `offline` (autouse) among them, so
that no test touches the network.
"""
import contextlib
import gc
import io
import math
import random
import shutil
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import model as model_py
from model import GPT, GPTConfig, PackedStep
from nanobatch import Request

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))  # the tools a reader may skip, tested all the same

TINY = dict(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=64)
V = TINY["vocab_size"]  # the engine's tests: a token's cost is mostly the LM head's, n_embd x V, so a small V
GPT2_V = 50257  # the input checks' model keeps GPT-2's vocabulary, and so its EOS id, 50256
MAX_LEN = 32  # positions per slot in the engine tests: short, so that some answers run out of room
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", "cuda"] if HAS_CUDA else ["cpu"]  # CUDA cases are collected only where torch sees a GPU
# One CPU thread for torch, here and in the programs the tests start (cli_env, tests/test_cli.py): models this small gain
# nothing from a second, and torch's idle threads spin while they wait, so on two cores shared with
# anything else two threads made the suite several times slower (measured: 19 engine tests took
# 85-125 s, not 10-11 s). The tests of the prefill worker's thread split ask for 3 threads themselves.
torch.set_num_threads(1)
# The objects made so far (torch's, numpy's, pytest's: some 180,000) are never garbage: frozen, Python's
# collector skips them, and each full collection, which the suite's runs set off a dozen times, walks
# the suite's own objects only; and it collects after 50,000 new objects, not 700, so that the runs'
# short-lived ones are gone before it looks (measured on two shared cores: 3.7 s in the collector
# became 1.6 frozen, and 0.5 with the threshold too).
gc.freeze()
gc.set_threshold(50_000, 20, 10)


def tiny_gpt(device="cpu", dtype=torch.float64, seed=0, **sizes):
    """A seeded random GPT, 2 layers of 64 dimensions and a vocabulary of 512 unless told otherwise.
    With GPT-2's init (std 0.02) a model this small is so smooth that its tokens hardly depend on
    what attention sees, and a key read from the wrong slot goes unnoticed.
    Drawing the blocks' matrices with std 0.1 makes tokens depend on their context (measured while
    writing these tests: 39 of 48 runs with a deliberately broken cache read caught, not 26)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY, **sizes}))
    with torch.no_grad():
        for p in model.transformer.h.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    return model.to(device, dtype).eval()


@pytest.fixture(scope="module")
def gpt():
    """The model most tests share: float64 on CPU."""
    return tiny_gpt()


@pytest.fixture(scope="module")
def gpt2_vocab():
    """The same with GPT-2's vocabulary, for the input checks: ids up to 50256, EOS the default."""
    return tiny_gpt(vocab_size=GPT2_V)


@pytest.fixture(scope="module", params=DEVICES)
def gpt_on(request):
    """The same model on every device present; float64 on CUDA too, so tokens must match exactly."""
    return tiny_gpt(request.param)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test touches the network: urlopen refuses every address but a local file://."""
    real_urlopen = urllib.request.urlopen

    def urlopen(url, *args, **kwargs):
        if not str(url).startswith("file:"):
            raise urllib.error.URLError("the tests run offline")
        return real_urlopen(url, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)


# The quick demo, run once for the whole suite: the labs read what it ran and printed, the page's tests
# the page it wrote and the forwards it ran (a run of it takes a second or more).

def on_host(packed):
    """A PackedStep copied to the CPU now, so that what is compared is what the forward received."""
    return PackedStep(packed.tokens.cpu().clone(), packed.positions.cpu().clone(), packed.slots.cpu().clone(),
                      packed.n_one_token, packed.one_token_mask.cpu().clone(),
                      [(rows, slot, mask.cpu().clone()) for rows, slot, mask in packed.chunks],
                      packed.logit_rows.cpu().clone(),
                      None if packed.block_tables is None else packed.block_tables.cpu().clone())


FORWARD_PACKED = model_py.GPT.forward_packed  # the real one, before any test wraps it


def record_forwards(monkeypatch):
    """model.GPT.forward_packed, recording the PackedStep of every call made in the main thread -> that list."""
    calls = []

    def recording(self, step, cache):
        # The loop's calls, not the worker's; and of those, the ones over tokens: a step with nothing to
        # feed (every prompt at the prefill worker) runs its forward over none, and reports no packed step.
        if threading.current_thread() is threading.main_thread() and len(step.tokens):
            calls.append(on_host(step))
        return FORWARD_PACKED(self, step, cache)

    monkeypatch.setattr(model_py.GPT, "forward_packed", recording)
    return calls


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory):
    """`python tools/explore.py FILE --quick`, once: the quick demo (continuous, then static), run and printed
    as `python nanobatch.py --demo --quick` runs and prints it, its page written, its loop's forwards recorded
    -> a namespace: path, page (its text), data (the page's, parsed back), calls, shown (nanobatch.Shown),
    printed (its output, the belt and the table, then the line naming the page)."""
    import json
    import re
    import explore  # tools/, put on the path above
    path = tmp_path_factory.mktemp("explore") / "belt.html"
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(io.StringIO()) as printed:
        calls = record_forwards(monkeypatch)
        shown = explore.main([str(path), "--quick"])
    page = path.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="nanobatch-run">(.*?)</script>', page, re.S)[1])
    return SimpleNamespace(path=path, page=page, data=data, calls=calls, shown=shown, printed=printed.getvalue())


def random_prompt(rng, n_tokens):
    return [rng.randrange(V) for _ in range(n_tokens)]


def first_difference(got, want):
    """'' when the completions agree token for token and reason for reason, else the first that differs."""
    if len(got) != len(want):
        return f"{len(got)} completions for {len(want)} requests"
    for i, (g, w) in enumerate(zip(got, want)):
        if (g.tokens, g.finish_reason) != (w.tokens, w.finish_reason):
            return f"request {i} differs:\n  got  {g.finish_reason} {g.tokens}\n  want {w.finish_reason} {w.tokens}"
    return ""


def worst(got, want):
    """The largest absolute difference and where it is: what a failed closeness check should print."""
    diff = (got - want).abs().nan_to_num(nan=math.inf)  # a NaN is the worst difference of all
    # The flat index unravelled by hand: torch.unravel_index's first call imports sympy, 1.4 s.
    flat, where = int(diff.argmax()), ()
    for size in reversed(diff.shape):
        flat, index = divmod(flat, size)
        where = (index,) + where
    return f"max |got - want| = {diff.max().item():.3g} at {where}: got {got[where]}, want {want[where]}"


def random_workload(seed, n_requests=10, sampled=False):
    """Seeded requests with every corner in them: prompts of 1 and of MAX_LEN - 1 tokens, answers of
    1 token and answers too long for their slot, and requests that arrive while others run."""
    rng = random.Random(seed)
    prompt_lens = [1, MAX_LEN - 1] + [rng.randint(1, MAX_LEN - 1) for _ in range(n_requests - 2)]
    max_new = [1, 2 * MAX_LEN] + [rng.randint(1, 24) for _ in range(n_requests - 2)]
    rng.shuffle(prompt_lens)
    rng.shuffle(max_new)
    requests = []
    for i, (n_prompt, n_new) in enumerate(zip(prompt_lens, max_new)):
        temperature, top_k = (rng.choice([0.0, 0.8, 1.5]), rng.choice([None, 1, 5, 50])) if sampled else (0.0, None)
        arrival = 0 if rng.random() < 0.4 else rng.randint(1, 12)  # most come late, out of list order
        requests.append(Request(random_prompt(rng, n_prompt), n_new, temperature, top_k, seed=1000 + i,
                                arrival=arrival))
    return requests


# Six requests, A to F, on two slots, whose every step is worked out by hand: tests/test_reports.py
# checks each StepReport field against it, tests/test_page.py what the page draws of them (its
# comment works the six runs out in short). A, C, D and F begin with a system prompt of one block.
SYSTEM = [1, 2]  # a system prompt that A, C, D and F begin with: one block of the paged runs
HAND_WORKED = [(SYSTEM + [3], 5, 0), ([11, 12], 6, 0), (SYSTEM + [23], 1, 0),  # (prompt, tokens, arrival)
               (SYSTEM + [33], 2, 10), ([41], 1, 10), (SYSTEM + [53], 1, 10)]


def hand_worked_requests():
    """HAND_WORKED's requests: past the system prompt, the tens of a prompt's ids name it (A's 3, B's
    11, 12, C's 23); served with eos_id=None, each makes exactly its tokens."""
    return [Request(prompt, max_new_tokens=n_tokens, arrival=arrival) for prompt, n_tokens, arrival in HAND_WORKED]


# The prefill worker is a second thread: the tests that start it run through ends_within.

WORKER = "nanobatch prefill worker"  # the thread's name
TIMEOUT_S = 120  # a run here takes seconds; minutes mean it hangs


def ends_within(seconds, function, *args, **kwargs):
    """function(*args, **kwargs), or what it raised, provided that it ends within `seconds`."""
    outcome = {}

    def call():
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as error:  # KeyboardInterrupt and SystemExit too: raised again below
            outcome["error"] = error

    caller = threading.Thread(target=call, name="test caller", daemon=True)
    caller.start()
    caller.join(seconds)
    assert not caller.is_alive(), f"{function.__name__} still running after {seconds} s: it hangs"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def worker_threads():
    return [thread for thread in threading.enumerate() if thread.name == WORKER]


def on_worker():
    return threading.current_thread().name == WORKER


# ---------------------------------------------------------------------------------------------
# tools/load.py --quick's runs, made once for the session: tests/test_load.py and Labs 10 and 12 read them


def quietly(function, *args):
    """function(*args), what it printed -> (its result, the lines it printed)."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        result = function(*args)
    return result, printed.getvalue()


@pytest.fixture(scope="session")
def smallest():
    import load  # tools/load.py, on the path above
    return load.GPT(load.SMALLEST).eval()


@pytest.fixture(scope="session")
def workload():
    import load
    return load.draw(0, load.N_REQUESTS, load.SMALLEST.vocab_size)


def saturated(model, workload, n_slots):
    """The tool's saturation table for n_slots -> (predicted, measured, what it printed)."""
    import load
    predicted = load.predict(workload, n_slots)
    measured, printed = quietly(load.saturations, model, workload, n_slots, predicted)
    return predicted, measured, printed


@pytest.fixture(scope="session")
def at_8(smallest, workload):
    return saturated(smallest, workload, 8)


@pytest.fixture(scope="session")
def knee(smallest, workload):
    """The sweep's lines Labs 10 and 12 show: static at 0.4 and 0.8 a step, continuous at 0.4 and 0.8."""
    import load
    return quietly(load.sweep, smallest, workload, 8, {"static": [0.4, 0.8], "continuous": [0.4, 0.8]}, False)


# ---------------------------------------------------------------------------------------------
# Runs in a process of their own (a command line, a server to Ctrl-C), started as the session does, beside
# the tests in this process (conftest.py's hooks): mostly they wait for Python and torch to start, and torch
# here uses one core of two. A test registers its run in IN_BACKGROUND and reads it through `ran`.

IN_BACKGROUND = {}  # test name -> its run: a function of a folder of its own, which returns what the test reads
BACKGROUND = SimpleNamespace(runs={}, folder=None, threads=None)  # the runs started, in a folder of their own


def start_in_background(tests):
    """Start the runs of these tests (names) that have not started."""
    if BACKGROUND.threads is None:
        BACKGROUND.folder = Path(tempfile.mkdtemp(prefix="nanobatch-runs-"))
        BACKGROUND.threads = ThreadPoolExecutor(max(1, len(IN_BACKGROUND)), thread_name_prefix="nanobatch run")
    for test in set(tests) & IN_BACKGROUND.keys() - BACKGROUND.runs.keys():
        (folder := BACKGROUND.folder / test).mkdir()
        BACKGROUND.runs[test] = BACKGROUND.threads.submit(IN_BACKGROUND[test], folder)


def stop_background():
    """At the session's end: wait for the runs still going (each ends within its timeouts), remove the folder."""
    if BACKGROUND.threads is not None:
        BACKGROUND.threads.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(BACKGROUND.folder, ignore_errors=True)


@pytest.fixture
def ran(request):
    """What the test's run gave back (or raised): started as the session began, or now."""
    start_in_background([request.node.originalname])
    return BACKGROUND.runs[request.node.originalname].result(timeout=300)
