"""
Tests for nanobatch, told as a story in the manner of minGPT's test_huggingface_import.

Everything is checked against an independent reference: `GPT.forward`, the textbook causal forward
with no cache, and `generate_sequential`, which serves one request at a time through it. The models
are tiny (2 layers, 4 heads, 64 dimensions, a vocabulary of 512; GPT-2's 50,257 where the input
checks need its ids) and seeded, so every run sees the same numbers. float64 on CPU makes "the same
tokens" a fair demand. tools/ is tested here too.

    python -m pytest -q        (about a minute on two CPU cores; no network)
"""
import argparse
import contextlib
import copy
import ctypes
import html
import html.parser
import inspect
import io
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import model as model_py
import nanobatch
from model import GPT, GPTConfig, PackedStep
from nanobatch import POLICIES, Request, attention_mask, generate, generate_sequential, sample

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "tools"))  # the tools a reader may skip, tested here all the same
import belt_svg  # noqa: E402
import bench  # noqa: E402
import explore  # noqa: E402
import verify  # noqa: E402
from verify import verdict  # noqa: E402

TINY = dict(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=64)
V = TINY["vocab_size"]  # the engine's tests: a token's cost is mostly the LM head's, n_embd x V, so a small V
GPT2_V = 50257  # the input checks' model keeps GPT-2's vocabulary, and so its EOS id, 50256
MAX_LEN = 32  # positions per slot in the engine tests: short, so that some answers run out of room
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", "cuda"] if HAS_CUDA else ["cpu"]  # CUDA cases are collected only where torch sees a GPU
# One CPU thread for torch, here and in the programs the tests start (cli_env): models this small gain
# nothing from a second, and torch's idle threads spin while they wait, so on two cores shared with
# anything else two threads made the suite several times slower (measured: 19 engine tests took
# 85-125 s, not 10-11 s). The tests of the prefill worker's thread split ask for 3 threads themselves.
torch.set_num_threads(1)


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
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return f"max |got - want| = {diff.max().item():.3g} at {where}: got {got[where]}, want {want[where]}"


# ---------------------------------------------------------------------------------------------
# 1) The engine serves exactly what the reference serves


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


def n_active(completions, step):
    return sum(c.admit_step <= step <= c.finish_step for c in completions)


def check_clock(requests, completions, n_slots, policy, prefill_chunk=None, reports=(), disaggregate=False):
    """Check the schedule from admit_step, first_token_step and finish_step, and the prompt budget
    (or, disaggregated, the handovers) from the step reports if given; returns how many steps had a
    queue."""
    n, n_queued_steps = len(requests), 0
    for i, (r, c) in enumerate(zip(requests, completions)):
        assert c.finish_step == c.first_token_step + len(c.tokens) - 1, f"request {i}: one token per step broken: {c}"
        assert c.admit_step >= r.arrival, f"request {i} admitted at step {c.admit_step}, before it arrived"
        n_prompt_steps = c.first_token_step - c.admit_step + 1  # steps its prompt took, the first token's included
        if disaggregate:  # the worker takes what time it takes; its first token comes no sooner than admission
            assert n_prompt_steps >= 1, f"request {i}: a first token before its admission: {c}"
        elif prefill_chunk is None:
            assert n_prompt_steps == 1, f"request {i}: a whole prompt took {n_prompt_steps} steps: {c}"
        else:
            assert n_prompt_steps >= math.ceil(len(r.prompt) / prefill_chunk), f"request {i}: over budget: {c}"
        assert 0 <= c.ttft_s <= c.latency_s, f"request {i}: first token after the last one: {c}"
        assert len(c.token_times_s) == len(c.tokens) and c.token_times_s == sorted(c.token_times_s), c
    fcfs = sorted(range(n), key=lambda i: (requests[i].arrival, i))  # first come, first served
    for field in ("admit_step", "first_token_step"):  # slots, then the prompt budget, go in arrival order
        steps = [getattr(completions[i], field) for i in fcfs]
        assert steps == sorted(steps), f"{field} out of arrival order: requests {fcfs} at steps {steps}"
    if disaggregate:  # the loop feeds no prompt token; each first token comes from the worker, at its step
        assert all(report.n_prompt_tokens == 0 for report in reports), "the decode loop fed prompt tokens"
        handed_over = Counter((i, report.step) for report in reports for i in report.handed_over)
        assert handed_over == Counter((i, c.first_token_step) for i, c in enumerate(completions)), handed_over
    else:  # the budget is kept, and used in full while a prompt is left unfinished
        budget = math.inf if prefill_chunk is None else prefill_chunk
        for report in reports:
            assert report.n_prompt_tokens <= budget, f"step {report.step}: {report.n_prompt_tokens} prompt tokens"
            assert report.n_prefilling == 0 or report.n_prompt_tokens == budget, \
                f"step {report.step}: {report.n_prompt_tokens} of {budget} prompt tokens, {report.n_prefilling} waiting"
    for t in range(max(c.finish_step for c in completions) + 1):
        waiting = [i for i in range(n) if requests[i].arrival <= t < completions[i].admit_step]
        active = n_active(completions, t)
        assert active <= n_slots, f"step {t}: {active} requests active in {n_slots} slots"
        if waiting and policy == "continuous":
            assert active == n_slots, f"step {t}: requests {waiting} wait while {active} of {n_slots} slots work"
        if waiting and policy == "static":
            assert active > 0, f"step {t}: the belt is empty while requests {waiting} wait"
        n_queued_steps += bool(waiting)
    if policy == "static":  # a batch is admitted only into an empty belt, and fills it if it can
        for s in sorted({c.admit_step for c in completions}):
            running = [i for i, c in enumerate(completions) if c.admit_step < s <= c.finish_step]
            assert not running, f"static admitted at step {s} while requests {running} still ran"
            joined = sum(c.admit_step == s for c in completions)
            left = [i for i in range(n) if requests[i].arrival <= s < completions[i].admit_step]
            assert not left or joined == n_slots, f"step {s}: {joined} admitted of {n_slots}, {left} left waiting"
    return n_queued_steps


def check_stops(requests, completions, max_len, eos_id):
    """Each answer stops at its first token that is EOS (kept), reaches max_new_tokens, or fills
    max_len, whichever comes first, and says which."""
    for i, (r, c) in enumerate(zip(requests, completions)):
        for n, token in enumerate(c.tokens, start=1):
            reason = ("eos" if token == eos_id else "length" if n == r.max_new_tokens
                      else "context" if len(r.prompt) + n == max_len else None)
            if reason:
                break
        assert (n, reason) == (len(c.tokens), c.finish_reason), f"request {i} should stop at {n} ({reason}): {c}"


@pytest.fixture(scope="module", params=["greedy", "sampled"])
def workload(request, gpt_on):
    """A random workload, an eos_id the model really emits mid-answer, and the reference's answers.
    The eos_id is the first new token of some answer, past its first: that answer must stop there."""
    requests = random_workload(seed=9, sampled=request.param == "sampled")
    no_eos = generate_sequential(gpt_on, requests, max_len=MAX_LEN, eos_id=None)
    eos_id = next(c.tokens[k] for c in no_eos for k in range(1, len(c.tokens)) if c.tokens[k] not in c.tokens[:k])
    return requests, eos_id, generate_sequential(gpt_on, requests, max_len=MAX_LEN, eos_id=eos_id)


def split_attention_everywhere(monkeypatch):
    """Attention calls made free, so that a step's one-token rows split at a cut (some together,
    some each alone over its own slot) wherever their lengths differ, even in these tiny models
    (where the real cost of a call keeps them together) -> the cuts chosen, as (cut, longest) pairs."""
    cuts, attention_cut = [], model_py.attention_cut

    def recording(lengths, n_slots, device):
        cuts.append((attention_cut(lengths, n_slots, device), max(lengths, default=0)))
        return cuts[-1][0]

    monkeypatch.setattr(model_py, "CALL_COST_IN_KEYS", {"cpu": 0, "gpu": 0})
    monkeypatch.setattr(model_py, "attention_cut", recording)
    return cuts


@pytest.mark.parametrize("cut", ["by cost", "split"])  # one-token rows split at a cut only when it pays, or wherever
@pytest.mark.parametrize("prefill_chunk", [None, 1, 5])  # whole prompts, a token a step, a few
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n_slots", [1, 3, 16])  # one slot, a few, more slots than requests
def test_generate_matches_sequential(gpt_on, workload, n_slots, policy, prefill_chunk, cut, monkeypatch):
    """The heart of it: batching must change when tokens are computed, never which. Same tokens,
    same finish reasons as one request at a time through the plain forward, greedy and sampled,
    whole prompts or prompts cut into chunks that ride along with other slots' decoding, decoding
    rows attending together or, past the step's cut, alone."""
    cuts = split_attention_everywhere(monkeypatch) if cut == "split" else None
    requests, eos_id, reference = workload
    reasons = {c.finish_reason for c in reference}
    assert reasons == {"eos", "length", "context"}, f"the workload must end answers every way, got {reasons}"
    check_stops(requests, reference, MAX_LEN, eos_id)  # the reference itself obeys the stopping rules
    reports = []
    got = generate(gpt_on, requests, n_slots=n_slots, max_len=MAX_LEN, eos_id=eos_id, policy=policy,
                   prefill_chunk=prefill_chunk, on_step=reports.append)
    assert first_difference(got, reference) == ""
    check_clock(requests, got, n_slots, policy, prefill_chunk, reports)
    if prefill_chunk is not None and n_slots > 1:  # some prompt was cut, and rode along with decoding
        assert any(report.n_prefilling and report.n_running for report in reports), "no chunk rode with decoding"
    if n_slots < len(requests):  # late requests found the belt busy and others already queued
        queued_behind = [i for i, r in enumerate(requests) if 0 < r.arrival < got[i].admit_step and any(
            requests[j].arrival < r.arrival < got[j].admit_step for j in range(len(requests)))]
        assert queued_behind, "no late request had to queue behind others: the workload lacks teeth"
    if n_slots == 1 and prefill_chunk is None:  # one slot is the sequential reference's own clock
        assert [(c.admit_step, c.finish_step) for c in got] == [(c.admit_step, c.finish_step) for c in reference]
    if cuts is not None and n_slots > 1:
        assert any(cut < longest for cut, longest in cuts), "no step split its one-token rows"


@pytest.mark.parametrize("prefill_chunk", [None, 3])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n_slots", [1, 2, 5])
def test_clock(gpt, n_slots, policy, prefill_chunk):
    """The schedule, on random workloads: one token per step after the first, prompts within their
    budget, first come first served, continuous never idles a slot while a request waits, static
    admits only into an empty belt. Each schedule judged by the other policy's rules must fail."""
    for seed in (1, 2):
        requests, reports = random_workload(seed, n_requests=16), []
        completions = generate(gpt, requests, n_slots=n_slots, max_len=MAX_LEN, eos_id=None, policy=policy,
                               prefill_chunk=prefill_chunk, on_step=reports.append)
        assert check_clock(requests, completions, n_slots, policy, prefill_chunk, reports) > 0, \
            "nothing ever waited: a toothless workload"
        if n_slots > 1:
            other = POLICIES[1 - POLICIES.index(policy)]
            with pytest.raises(AssertionError):
                check_clock(requests, completions, n_slots, other)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_gets_one_completion_in_order(gpt, policy):
    """Nothing lost, nothing doubled: distinct max_new_tokens make each completion say whose it is,
    and every request is admitted and finished exactly once in the step reports."""
    rng = random.Random(4)
    lengths = rng.sample(range(1, 21), 12)
    requests = [Request(random_prompt(rng, rng.randint(1, 8)), n, arrival=rng.randint(0, 10)) for n in lengths]
    reports = []
    completions = generate(gpt, requests, n_slots=3, max_len=MAX_LEN, eos_id=None, policy=policy,
                           on_step=reports.append)
    assert [len(c.tokens) for c in completions] == lengths, "completions are not in request order"
    assert {c.finish_reason for c in completions} == {"length"}
    admitted = sorted(i for report in reports for i in report.admitted)
    finished = sorted(i for report in reports for i, _ in report.finished)
    assert admitted == finished == list(range(len(requests)))
    assert all(c is completions[i] for report in reports for i, c in report.finished)


@pytest.mark.parametrize("serve", [generate, generate_sequential])
def test_stopping_rules_in_order(gpt, serve):
    """When rules fire on the same token, the first in order wins: EOS (kept), then max_new_tokens,
    then max_len. The reference shares the rule, so here it is checked against fixed expectations."""
    prompt = [1, 2, 3]
    free = generate_sequential(gpt, [Request(prompt, 8)], max_len=MAX_LEN, eos_id=None)[0].tokens
    k = next(k for k in range(1, len(free)) if free[k] not in free[:k])  # free[k] first appears at k
    eos_last = serve(gpt, [Request(prompt, k + 1)], max_len=len(prompt) + k + 1, eos_id=free[k])[0]
    assert (eos_last.tokens, eos_last.finish_reason) == (free[:k + 1], "eos")
    length_last = serve(gpt, [Request(prompt, k)], max_len=len(prompt) + k, eos_id=free[k])[0]
    assert (length_last.tokens, length_last.finish_reason) == (free[:k], "length")
    context = serve(gpt, [Request(prompt, 8)], max_len=len(prompt) + k, eos_id=None)[0]
    assert (context.tokens, context.finish_reason) == (free[:k], "context")


@pytest.mark.parametrize("policy", POLICIES)
def test_rows_computed_per_step(gpt, monkeypatch, policy):
    """What each step costs: continuous batching computes a row for each running request and no
    empty ones; static batching, like a padded batch, keeps computing a finished request's row (with
    its logits) until the whole batch is done. Counted from the forward the engine really runs."""
    rows = []  # per step: (one-token rows, logits rows)
    forward_packed = GPT.forward_packed

    def counting(model, step, cache):  # one-token rows attend together, or alone past the step's cut
        alone = sum(rows.stop - rows.start == 1 for rows, _, _ in step.chunks)
        rows.append((step.n_one_token + alone, step.logit_rows.numel()))
        return forward_packed(model, step, cache)

    monkeypatch.setattr(GPT, "forward_packed", counting)
    rng = random.Random(12)  # prompts of 2+ tokens: an admitted prompt is a chunk, not a one-token row
    requests = [Request(random_prompt(rng, rng.randint(2, 6)), rng.randint(1, 12)) for _ in range(9)]
    reports = []
    generate(gpt, requests, n_slots=3, max_len=MAX_LEN, eos_id=None, policy=policy, on_step=reports.append)
    assert len(rows) == len(reports)
    for (n_one_token, n_logits), report in zip(rows, reports):
        n_decoding = report.n_running - len(report.admitted)  # whole prompts: the admitted sample at once
        if policy == "continuous":
            assert (n_one_token, n_logits) == (n_decoding, report.n_running), f"step {report.step}: {rows}"
        elif not report.admitted:  # a static batch mid-way: every slot a row, finished ones padding
            assert (n_one_token, n_logits) == (3, 3), f"step {report.step}: {rows}"
    if policy == "static":
        assert any(report.n_running < 3 and not report.admitted for report in reports), "no padding was needed"


def test_reused_slot_gives_the_same_answer(gpt):
    """A freed slot keeps its previous occupant's keys. A short request must not notice: in one slot,
    after a long request, it answers exactly as it does in a fresh cache."""
    rng = random.Random(3)
    long_request = Request(random_prompt(rng, 28), 3)  # leaves keys in 30 of the slot's 32 positions
    for short in (Request(random_prompt(rng, 2), 12), Request(random_prompt(rng, 5), 10, 1.0, 20, seed=7)):
        fresh = generate(gpt, [short], n_slots=1, max_len=MAX_LEN, eos_id=None)
        reused = generate(gpt, [long_request, short], n_slots=1, max_len=MAX_LEN, eos_id=None)
        assert reused[1].admit_step > 0, "the short request did not follow the long one"
        assert first_difference(reused[1:], fresh) == ""


def test_needle_among_fillers(gpt):
    """A seeded request draws from its own generator: alone, or at a random place among many fillers
    with other lengths and sampling settings, it gets the same tokens."""
    rng = random.Random(5)
    needle = Request(random_prompt(rng, 6), 16, temperature=0.9, top_k=50, seed=1234, arrival=3)
    alone = generate_sequential(gpt, [needle], max_len=MAX_LEN, eos_id=None)
    greedy = generate_sequential(gpt, [Request(needle.prompt, 16, arrival=3)], max_len=MAX_LEN, eos_id=None)
    assert alone[0].tokens != greedy[0].tokens, "the needle does not really sample"
    top_1 = generate_sequential(gpt, [Request(needle.prompt, 16, 1.5, top_k=1, seed=1)], max_len=MAX_LEN, eos_id=None)
    assert top_1[0].tokens == greedy[0].tokens, "top_k=1 must be greedy at any temperature"
    fillers = [Request(random_prompt(rng, rng.randint(1, 20)), rng.randint(1, 11), rng.choice([0.0, 0.7, 1.3]),
                       rng.choice([None, 3, 100]), arrival=rng.randint(0, 6)) for _ in range(15)]
    place = rng.randrange(len(fillers) + 1)
    crowd = fillers[:place] + [needle] + fillers[place:]
    for policy in POLICIES:
        got = generate(gpt, crowd, n_slots=4, max_len=MAX_LEN, eos_id=None, policy=policy)
        assert first_difference(got[place:place + 1], alone) == "", f"needle at {place} of {len(crowd)}, {policy}"


def decode_sees_everything(positions, L):
    """Broken on purpose: a decode row sees all L positions, past its own prefix."""
    visible = attention_mask(positions, L)  # the real mask: imported before any monkeypatching
    return torch.ones_like(visible) if positions.size(1) == 1 else visible


def prefill_sees_the_future(positions, L):
    """Broken on purpose: a prompt token sees the prompt tokens after it."""
    visible = attention_mask(positions, L)
    return torch.ones_like(visible) if positions.size(1) > 1 else visible


@pytest.mark.parametrize("broken_mask", [decode_sees_everything, prefill_sees_the_future])
def test_a_broken_mask_is_caught(gpt, monkeypatch, broken_mask):
    """Negative control: the equivalence tests have teeth. With prompts of different lengths sharing
    two slots, a mask that shows a row its slot's old keys or padding, or a prompt its own future,
    must make generate disagree with the reference."""
    rng = random.Random(1)
    requests = [Request(random_prompt(rng, n), m) for n, m in [(20, 12), (3, 10), (12, 8), (2, 10), (7, 6)]]
    reference = generate_sequential(gpt, requests, max_len=MAX_LEN, eos_id=None)
    assert first_difference(generate(gpt, requests, n_slots=2, max_len=MAX_LEN, eos_id=None), reference) == ""
    monkeypatch.setattr(nanobatch, "attention_mask", broken_mask)
    broken = generate(gpt, requests, n_slots=2, max_len=MAX_LEN, eos_id=None)
    assert first_difference(broken, reference) != "", f"{broken_mask.__name__} went unnoticed"


def test_a_slot_is_cleaned_for_its_new_occupant(monkeypatch):
    """The mask hides a slot's previous occupant by giving its keys weight 0, but 0 * NaN is NaN: an
    occupant whose keys overflowed would poison the next. generate must wipe what a request wrote
    as it leaves. Here the first request holds a token whose embedding is NaN, so every key it
    writes from there on is NaN; the requests after it in the same slot must still get the
    reference's answers, and must not once the wiping is switched off (so the NaN was there)."""
    model, poison = tiny_gpt(), 7
    with torch.no_grad():
        model.transformer.wte.weight[poison] = math.nan
    rng = random.Random(8)
    # Slot 0: the poisoned request (NaN keys at positions 2..19), then short ones. Slot 1: a long
    # one, which makes every step attend over more positions than a short request has, so the
    # short requests' masks cover the positions the poisoned one wrote.
    first = Request([1, 2, poison] + random_prompt(rng, 17), 1)
    companion = Request(random_prompt(rng, 3), 26)
    later = [Request(random_prompt(rng, n), m) for n, m in [(2, 8), (5, 3), (1, 7)]]
    reference = generate_sequential(model, later, max_len=MAX_LEN, eos_id=None)
    got = generate(model, [first, companion] + later, n_slots=2, max_len=MAX_LEN, eos_id=None)
    assert [c.slot for c in got] == [0, 1, 0, 0, 0], "the short requests did not follow the poisoned one"
    assert first_difference(got[2:], reference) == ""
    monkeypatch.setattr(model_py.KVCache, "clear", lambda cache, slot, n_positions: None)
    dirty = generate(model, [first, companion] + later, n_slots=2, max_len=MAX_LEN, eos_id=None)
    assert first_difference(dirty[2:], reference) != "", "NaN keys left in a slot went unnoticed without wiping"


# ---------------------------------------------------------------------------------------------
# 1b) Disaggregated prefill: the prompts on a worker of their own, the same answers
#
# A second thread is in play, so a test that hangs must not hang the suite: each disaggregated run
# goes through `ends_within`, which runs it in a thread of the test's own and joins it with a
# timeout. A hang fails the test; the stuck thread is a daemon, so it cannot keep the suite alive.

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


@pytest.mark.parametrize("prefill_chunk", [None, 5])  # whole prompts a forward of the worker, or 5 tokens
@pytest.mark.parametrize("n_slots", [1, 3, 16])
def test_disaggregated_matches_sequential(gpt_on, workload, n_slots, prefill_chunk):
    """Prefilling on a worker of its own, the keys and values copied into the slot, changes where
    prompts are computed, never which tokens come: the reference's tokens and finish reasons, greedy
    and sampled, every finish reason among them, late arrivals queueing behind others. The clock:
    admission first come first served, each first token from the worker, one token a step after it."""
    requests, eos_id, reference = workload
    assert {c.finish_reason for c in reference} == {"eos", "length", "context"}
    reports = []
    got = ends_within(TIMEOUT_S, generate, gpt_on, requests, n_slots=n_slots, max_len=MAX_LEN, eos_id=eos_id,
                      prefill_chunk=prefill_chunk, disaggregate=True, on_step=reports.append)
    assert first_difference(got, reference) == ""
    check_clock(requests, got, n_slots, "continuous", reports=reports, disaggregate=True)
    if n_slots < len(requests):
        assert any(0 < r.arrival < got[i].admit_step for i, r in enumerate(requests)), "no late request queued"
    assert worker_threads() == [], "the prefill worker outlived generate"


def test_disaggregated_prompts_go_to_the_worker_only(gpt, monkeypatch):
    """Counted from the forwards the two threads really run: the loop's carry exactly the answers'
    tokens fed back (each answer's but its last, at its positions) and no prompt token; the worker's
    carry exactly the prompts, first come first served, at most prefill_chunk tokens a forward. The
    keys and values cross once per prompt, its tokens times the per-token size: n_layer x (keys and
    values) x n_embd x 8 bytes in float64. Each first token is reported with the worker's logits,
    the plain forward's over the prompt; each side ran on its share of the CPU's threads."""
    fed = {"loop": [], "worker": []}  # per forward: (tokens, positions, torch threads of that thread)
    forward_packed = GPT.forward_packed

    def recording(model, step, cache):
        fed["worker" if on_worker() else "loop"].append((step.tokens.tolist(), step.positions.tolist(),
                                                         torch.get_num_threads()))
        return forward_packed(model, step, cache)

    def serve():  # in a caller's thread that asked for 3 threads, split as 1 and 2: the sides differ
        before = torch.get_num_threads()
        torch.set_num_threads(3)
        try:
            completions = generate(gpt, requests, n_slots=3, max_len=MAX_LEN, eos_id=None, prefill_chunk=4,
                                   disaggregate=True, on_step=reports.append)
            return completions, 3, torch.get_num_threads()
        finally:  # torch's default for threads started later, as the suite found it
            torch.set_num_threads(before)

    monkeypatch.setattr(GPT, "forward_packed", recording)
    requests, reports = random_workload(seed=3, n_requests=12), []
    got, caller_threads, threads_after = ends_within(TIMEOUT_S, serve)
    fcfs = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    # 1) The worker: every prompt, whole and in order, in forwards of at most 4 tokens.
    assert [t for tokens, _, _ in fed["worker"] for t in tokens] == [t for i in fcfs for t in requests[i].prompt]
    assert [p for _, positions, _ in fed["worker"] for p in positions] == \
        [p for i in fcfs for p in range(len(requests[i].prompt))]
    assert max(len(tokens) for tokens, _, _ in fed["worker"]) == 4
    # 2) The loop: the answers' tokens fed back, nothing else.
    loop_tokens = Counter(t for tokens, _, _ in fed["loop"] for t in tokens)
    loop_positions = Counter(p for _, positions, _ in fed["loop"] for p in positions)
    assert loop_tokens == Counter(t for c in got for t in c.tokens[:-1])
    assert loop_positions == Counter(len(r.prompt) + k for r, c in zip(requests, got) for k in range(len(c.tokens) - 1))
    # 3) The transfer: each prompt once, its exact size.
    per_token = TINY["n_layer"] * 2 * TINY["n_embd"] * 8
    assert sorted(i for report in reports for i in report.handed_over) == list(range(len(requests)))
    for report in reports:
        assert report.kv_bytes == per_token * sum(len(requests[i].prompt) for i in report.handed_over), report.step
    # 4) The worker's logits for each first token, reported as the loop's are.
    for report in reports:
        for i in report.handed_over:
            row = report.logits[report.sampled.index(i)]
            want = gpt(torch.tensor([requests[i].prompt]))[0, -1]
            assert torch.allclose(row, want, rtol=0, atol=1e-10), f"request {i}: {worst(row, want)}"
    # 5) The threads: split between the sides while it ran, the caller's setting back after.
    assert nanobatch.split_threads(caller_threads) == (1, 2)
    assert {n for _, _, n in fed["worker"]} == {1} and {n for _, _, n in fed["loop"]} == {2}
    assert threads_after == caller_threads


def test_where_the_prefill_worker_runs(monkeypatch):
    """A second GPU if there is one (the next after the loop's, round), else the loop's own device,
    and the output says which, and that one GPU is shared."""
    cpu, gpu_1 = torch.device("cpu"), torch.device("cuda", 1)
    assert nanobatch.prefill_device(cpu) == cpu
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert nanobatch.prefill_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert "one GPU, shared by both sides" in nanobatch.placement(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert nanobatch.prefill_device(torch.device("cuda", 0)) == gpu_1
    assert nanobatch.prefill_device(gpu_1) == torch.device("cuda", 0)
    assert "the prefill worker on cuda:1 with a copy of the weights" in nanobatch.placement(torch.device("cuda", 0))
    n_worker, n_loop = nanobatch.split_threads(torch.get_num_threads())
    assert f"the prefill worker on {n_worker} of torch's" in nanobatch.placement(cpu)
    assert [nanobatch.split_threads(n) for n in (1, 2, 3, 16)] == [(1, 1), (1, 1), (1, 2), (8, 8)]


if HAS_CUDA:  # collected only where torch sees a GPU, as every CUDA case is
    @pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
    def test_disaggregated_across_two_gpus(workload):
        """With two GPUs the worker prefills on the second, with a copy of the weights, and the keys and
        values cross to the first: still the reference's answers."""
        requests, eos_id, _ = workload
        model = tiny_gpt("cuda:0")
        reference = generate_sequential(model, requests, max_len=MAX_LEN, eos_id=eos_id)
        got = ends_within(TIMEOUT_S, generate, model, requests, n_slots=3, max_len=MAX_LEN, eos_id=eos_id,
                          disaggregate=True)
        assert first_difference(got, reference) == ""
else:
    def test_cuda_cases():
        """Where torch sees no GPU the CUDA cases are not collected at all: one skip says so, not one per case."""
        pytest.skip("no CUDA GPU here: the CUDA cases (the engine and the disaggregated engine against the reference, "
                    "the packed forward, the worker on a second GPU) are collected only where torch sees one; "
                    "`bash tools/gpu_check.sh OUT_DIR` runs them on a GPU")


def test_a_worker_failure_is_raised_not_hung(gpt, monkeypatch):
    """The worker fails on its third forward: generate raises that very error, its traceback through
    the worker's own frames, and leaves no thread behind and the thread setting as it was."""
    forward_packed, n_worker_forwards = GPT.forward_packed, [0]

    def failing(model, step, cache):
        if on_worker():
            n_worker_forwards[0] += 1
            if n_worker_forwards[0] == 3:
                raise RuntimeError("the prefill machine caught fire")
        return forward_packed(model, step, cache)

    def serve():  # a caller that asked for 3 threads, split 1 and 2: a setting not given back would show
        before = torch.get_num_threads()
        torch.set_num_threads(3)
        try:
            generate(gpt, random_workload(seed=1), n_slots=3, max_len=MAX_LEN, eos_id=None, disaggregate=True)
        finally:
            threads_after = torch.get_num_threads()
            torch.set_num_threads(before)  # torch's default for threads started later, as the suite set it
            assert threads_after == 3, "the caller's thread setting was not given back"

    monkeypatch.setattr(GPT, "forward_packed", failing)
    with pytest.raises(RuntimeError, match="caught fire") as error:
        ends_within(TIMEOUT_S, serve)
    frames = [frame.name for frame in traceback.extract_tb(error.value.__traceback__)]
    assert "prefill" in frames and "failing" in frames, frames
    assert worker_threads() == []


@pytest.mark.parametrize("end", ["normal", "error", "Ctrl-C"])
def test_no_thread_outlives_generate(gpt, monkeypatch, end):
    """However generate ends (all served, an error in the caller's on_step, Ctrl-C while prompts are
    still queued for the worker), the worker is joined and the caller's thread setting is back. The
    worker is slowed down, so that prompts do queue for it."""
    raised, with_worker_when_stopped = {"error": ValueError, "Ctrl-C": KeyboardInterrupt}.get(end), []
    forward_packed = GPT.forward_packed

    def slow_worker(model, step, cache):  # mid-prompt when the loop stops: a missing join would be seen
        if on_worker():
            time.sleep(0.1)
        return forward_packed(model, step, cache)

    def on_step(report):
        if raised and report.step == 2:
            with_worker_when_stopped.append(report.n_prefilling)
            raise raised("stopped from on_step")

    def serve():  # a caller that asked for 3 threads, split 1 and 2: a setting not given back would show
        before = torch.get_num_threads()
        torch.set_num_threads(3)
        try:
            generate(gpt, requests, n_slots=8, max_len=MAX_LEN, eos_id=None, disaggregate=True, on_step=on_step)
        finally:
            threads_after = torch.get_num_threads()
            torch.set_num_threads(before)  # torch's default for threads started later, as the suite set it
            assert threads_after == 3, "the caller's thread setting was not given back"

    monkeypatch.setattr(GPT, "forward_packed", slow_worker)
    requests = [Request([1] * 20, 4) for _ in range(12)]  # all at once: prompts queue for the worker
    with pytest.raises(raised) if raised else nullcontext():
        ends_within(TIMEOUT_S, serve)
    assert worker_threads() == [], "the prefill worker outlived generate"
    if raised:  # the worker holds one prompt at a time: the others were still in its inbox
        assert with_worker_when_stopped[0] >= 2, with_worker_when_stopped


# ---------------------------------------------------------------------------------------------
# 1c) The modes a caller runs generate in, and a cache that cannot fit


@pytest.mark.parametrize("disaggregate", [False, True])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "neither"])
def test_the_callers_mode(gpt, mode, disaggregate):
    """Grad and inference mode are set per thread. Inside torch.inference_mode(), torch.no_grad() or
    neither, generate serves the reference's tokens, with the prefill worker too: its thread writes
    into a cache the caller's thread made, which inference mode allows only inside inference mode."""
    requests = random_workload(seed=5, n_requests=6)
    reference = generate_sequential(gpt, requests, max_len=MAX_LEN, eos_id=None)

    def serve():  # in the test's own thread, which sets its mode itself
        with torch.inference_mode() if mode == "inference_mode" else torch.no_grad() if mode == "no_grad" \
                else nullcontext():
            return generate(gpt, requests, n_slots=3, max_len=MAX_LEN, eos_id=None, prefill_chunk=4,
                            disaggregate=disaggregate)

    assert first_difference(ends_within(TIMEOUT_S, serve), reference) == ""
    assert worker_threads() == []


def test_a_worker_failure_in_inference_mode_is_raised_not_hung(gpt, monkeypatch):
    """In the caller's inference mode too, a worker that fails makes generate raise its very error,
    with the worker's frames, and leaves no thread behind."""
    forward_packed = GPT.forward_packed

    def failing(model, step, cache):
        if on_worker() and torch.is_inference_mode_enabled():  # it fails in the mode it was given
            raise RuntimeError("the prefill machine caught fire")
        return forward_packed(model, step, cache)

    def serve():
        with torch.inference_mode():
            generate(gpt, random_workload(seed=1), n_slots=3, max_len=MAX_LEN, eos_id=None, disaggregate=True)

    monkeypatch.setattr(GPT, "forward_packed", failing)
    with pytest.raises(RuntimeError, match="caught fire") as error:
        ends_within(TIMEOUT_S, serve)
    assert "prefill" in [frame.name for frame in traceback.extract_tb(error.value.__traceback__)]
    assert worker_threads() == []


@pytest.mark.parametrize("disaggregate", [False, True])
def test_autocast_is_refused_up_front(gpt2_vocab, disaggregate):
    """Under torch.autocast the cache (in the model's dtype) and the keys (in autocast's) would
    disagree: generate refuses before any step, says what to do instead, and starts no worker."""
    steps = []
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=r"torch\.autocast.*"
                                                                     r"model\.to\(torch\.bfloat16\)"):
        generate(gpt2_vocab, [Request([1, 2, 3], 4)], max_len=MAX_LEN, on_step=steps.append, disaggregate=disaggregate)
    assert steps == [] and worker_threads() == []


def test_a_cache_that_cannot_fit_is_refused_before_it_is_made(gpt, monkeypatch):
    """With 10 MB free, 1000 slots of 32 positions (65,536 bytes each: 2 layers x keys and values x
    32 x 64 x 8 bytes) are refused, naming the size, what is free and what fits, and no cache is
    made: KVCache's constructor, patched to fail, is never reached. 152 slots fit, and serve."""
    real_available_memory, make_cache = model_py.available_memory, model_py.KVCache.__init__
    monkeypatch.setattr(model_py, "available_memory", lambda device: 10_000_000)

    def made(*args, **kwargs):
        raise AssertionError("a cache was made")

    monkeypatch.setattr(model_py.KVCache, "__init__", made)
    with pytest.raises(ValueError, match=r"a KV cache of 1000 slots x 32 positions takes 0.0655 GB, but cpu has "
                                         r"0.01 GB free: at most 152 slots fit at max_len=32"):
        generate(gpt, [Request([1, 2], 3)], n_slots=1000, max_len=MAX_LEN, eos_id=None)
    monkeypatch.setattr(model_py.KVCache, "__init__", make_cache)
    assert len(generate(gpt, [Request([1, 2], 3)], n_slots=152, max_len=MAX_LEN, eos_id=None)[0].tokens) == 3
    free = real_available_memory(torch.device("cpu"))
    assert free is None or free > 0  # what the machine really has: MemAvailable on Linux


def test_a_worker_with_weights_of_its_own_waits_for_them(gpt, monkeypatch):
    """On a second GPU the worker gets a copy of the weights, copied by load_state_dict on that GPU's
    default stream, which the worker's own stream never waits on: generate must wait for the copy
    before the worker's first forward. Pinned on the CPU: prefill_device answers cpu:0, a device
    other than the loop's 'cpu' to the code, so the worker builds its copy there, and the GPU's
    synchronize is recorded. Still the reference's tokens, from the copy, not the loop's model."""
    events, load_state_dict, forward_packed = [], GPT.load_state_dict, GPT.forward_packed
    monkeypatch.setattr(nanobatch, "prefill_device", lambda device: torch.device("cpu", 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("synchronize", str(device))))

    def loading(model, state_dict):  # the copy of the weights, which a GPU queues
        events.append(("load_state_dict", str(model.lm_head.weight.device)))
        return load_state_dict(model, state_dict)

    monkeypatch.setattr(GPT, "load_state_dict", loading)

    def recording(model, step, cache):
        if on_worker():
            events.append(("worker's forward", "the loop's model" if model is gpt else "a copy"))
        return forward_packed(model, step, cache)

    monkeypatch.setattr(GPT, "forward_packed", recording)
    requests = random_workload(seed=2, n_requests=6)
    got = ends_within(TIMEOUT_S, generate, gpt, requests, n_slots=3, max_len=MAX_LEN, eos_id=None, disaggregate=True)
    assert first_difference(got, generate_sequential(gpt, requests, max_len=MAX_LEN, eos_id=None)) == ""
    assert events[:2] == [("load_state_dict", "cpu"), ("synchronize", "cpu:0")], events[:3]  # copied, then waited for
    assert set(events[2:]) == {("worker's forward", "a copy")}, events


# ---------------------------------------------------------------------------------------------
# 2) Sampling follows its rule, written out here independently
#
# The engine and the reference share `sample`, so their equivalence cannot see a bug in it: both
# would draw the same wrong tokens. Here the rule is stated again, with math.exp on plain floats:
# P(id) = exp(logit / temperature) / sum of the same over the ids kept, the kept ids being the
# top_k largest logits (all of them when top_k is None); temperature 0 takes the largest logit.


def draw(logits, temperature, top_k=None, n_draws=1, seed=0):
    """n_draws token ids from `sample`, one call each, with one seeded generator."""
    request = Request([0], 1, temperature, top_k)
    generator = torch.Generator().manual_seed(seed)
    logits = torch.tensor(logits, dtype=torch.float64)
    return [int(sample(logits, request, generator)) for _ in range(n_draws)]  # int(): a 0-d tensor too


def test_the_draw_is_torch_multinomials():
    """sample draws as torch.multinomial(probs, 1) does, argmax(p / q) with q ~ Exp(1) from the
    request's generator, so a seed gives the same token; only multinomial's checks, which read
    values back from the device, are left out. (The frequency tests below hold it to the rule.)"""
    rng = random.Random(11)
    for seed in range(50):
        logits = torch.tensor([rng.gauss(0, 2) for _ in range(100)], dtype=torch.float64)
        got = sample(logits, Request([0], 1, temperature=0.9), torch.Generator().manual_seed(seed))
        probs = torch.softmax((logits - logits.max()) / 0.9, dim=-1)
        assert got == torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))[0], seed


def argmax(values):
    return max(range(len(values)), key=lambda i: values[i])


def softmax_probabilities(logits, temperature, top_k=None):
    """The rule, independently of the code under test: a probability for every id."""
    kept = sorted(range(len(logits)), key=lambda i: logits[i], reverse=True)[:top_k]
    weights = {i: math.exp((logits[i] - max(logits)) / temperature) for i in kept}
    return [weights.get(i, 0.0) / sum(weights.values()) for i in range(len(logits))]


def test_greedy_takes_the_largest_logit():
    """Temperature 0 is the argmax, over the whole vocabulary, whatever top_k says."""
    rng = random.Random(10)
    for _ in range(10):
        logits = [rng.gauss(0, 3) for _ in range(V)]
        for top_k in (None, 1, 50):
            assert draw(logits, 0.0, top_k) == [argmax(logits)]


def test_top_k_keeps_exactly_the_k_largest():
    """Among many draws at a high temperature (so every kept id is likely enough to show up), the
    ids drawn are exactly the top_k largest logits: none outside, every one inside. top_k=1 is the
    argmax at any temperature; a top_k past the vocabulary keeps everything."""
    logits = [0.3, 2.0, -1.0, 1.1, 0.9, -0.2, 1.7, 0.0, -2.5, 1.4]  # the largest at 1, 6, 9, 3, 4, ...
    by_size = sorted(range(len(logits)), key=lambda i: logits[i], reverse=True)
    for top_k in (1, 3, 6):
        seen = set(draw(logits, 5.0, top_k, n_draws=2000))
        assert seen == set(by_size[:top_k]), f"top_k={top_k}: drew {sorted(seen)}, want {sorted(by_size[:top_k])}"
    for temperature in (0.1, 1.0, 10.0):
        assert set(draw(logits, temperature, 1, n_draws=200)) == {argmax(logits)}, f"top_k=1 at {temperature}"
    assert set(draw(logits, 5.0, 1000, n_draws=2000)) == set(range(len(logits)))


@pytest.mark.parametrize("temperature, top_k", [(0.8, None), (2.0, None), (0.5, None), (1.5, 3)])
def test_sampling_frequencies_follow_softmax(temperature, top_k):
    """20,000 seeded draws over 5 ids: each id's frequency is within 5 standard errors of its
    probability by the rule (under 0.02 here). Multiplying by the temperature instead of dividing,
    or keeping the wrong ids, moves some probability by 0.1 or more. (At temperature 1 the two agree:
    that is why it is not among the cases.)"""
    logits = [-0.5, 1.0, -1.5, 0.5, 0.0]
    n_draws = 20_000
    want = softmax_probabilities(logits, temperature, top_k)
    drawn = draw(logits, temperature, top_k, n_draws)
    got = [drawn.count(i) / n_draws for i in range(len(logits))]
    for i, (g, w) in enumerate(zip(got, want)):
        standard_error = math.sqrt(w * (1 - w) / n_draws)
        assert abs(g - w) <= 5 * standard_error, \
            f"id {i}: frequency {g:.4f}, want {w:.4f} +- {5 * standard_error:.4f}; all: got {got}, want {want}"


# ---------------------------------------------------------------------------------------------
# 3) The cached forward computes the plain forward's logits


def test_attention_cut_by_hand():
    """The cut that reads the fewest keys, a call counted as 150 keys on a CPU and 20,000 on a GPU,
    worked out by hand; then against every possible cut, tried one by one."""
    cpu, gpu = torch.device("cpu"), torch.device("meta")  # any device but a CPU counts as a GPU
    one_long = [48] * 7 + [940]  # cut 48: 8 x 48 + 940 + 150 = 1474 keys; cut 940: 8 x 940 = 7520
    assert model_py.attention_cut(one_long, 8, cpu) == 48
    assert model_py.attention_cut([48] * 63 + [940], 64, gpu) == 48  # 3072 + 940 + 20000 < 64 x 940
    spread = [50, 186, 321, 457, 593, 729, 864, 1000]  # cut 50: 400 + 4150 + 7 x 150 = 5600, the least
    assert model_py.attention_cut(spread, 8, cpu) == 50
    assert model_py.attention_cut(spread, 8, gpu) == 1000  # on a GPU, a call is worth more than them all
    assert model_py.attention_cut([5, 5, 5], 4, cpu) == 5 and model_py.attention_cut([], 4, cpu) == 1
    rng = random.Random(13)
    for _ in range(200):
        lengths, n_slots = [rng.randint(1, 1000) for _ in range(rng.randint(1, 16))], rng.randint(16, 64)
        def keys(cut):
            return n_slots * cut + sum(length + 150 for length in lengths if length > cut)
        assert keys(model_py.attention_cut(lengths, n_slots, cpu)) == min(keys(cut) for cut in lengths), lengths


@pytest.mark.parametrize("cut", ["by cost", "split"])
@pytest.mark.parametrize("stale", ["previous sequences", "NaN"])
@pytest.mark.parametrize("device, dtype, atol", [  # atol None: judged as tools/verify.py judges
    ("cpu", torch.float32, 1e-5), ("cpu", torch.float64, 1e-10)]
    + ([("cuda", torch.float32, 1e-5), ("cuda", torch.bfloat16, None)] if HAS_CUDA else []))
def test_packed_forward_matches_forward(device, dtype, atol, stale, cut, monkeypatch):
    """Three sequences in three of five slots, fed as the engine feeds them: prompts in chunks of
    1-3 tokens, packed into the same forward as other slots' decode tokens, then one token at a time.
    Every row that is due a token must get the plain forward's logits over its own sequence. The
    slots are dirty first, either holding other sequences' keys, which the mask alone must hide, or
    NaN in every position, which the mask cannot hide (0 * NaN is NaN): cache.clear, as nanobatch
    calls it when a request leaves a slot, must leave nothing of it. The two idle slots keep their
    NaN: their dropped rows must not leak into anyone's logits. Split: in some steps, short slots'
    one-token rows attend together while a longer slot's attends alone, past the cut. In bfloat16 (on
    a GPU, where attention may take another kernel, cuDNN's, for a masked strided view) each row is
    judged by verify's rule against a float64 recomputation: rounding, not a BUG."""
    if cut == "split":
        split_attention_everywhere(monkeypatch)
    model, rng, n_split_steps = tiny_gpt(device, dtype), random.Random(6), 0
    exact_model = copy.deepcopy(model).double() if atol is None else None  # the same weights, in float64
    n_slots, max_len = 5, 24
    cache, device = model.new_cache(n_slots, max_len), torch.device(device)

    def running(slot, prompt):  # the per-slot state that pack_step reads
        return nanobatch.Running(slot, Request(prompt, max_len), slot, None, admit_step=0)

    with torch.no_grad():
        # 0) Dirty the cache: every slot full of another sequence's keys, or all NaN.
        if stale == "NaN":
            cache.kv.fill_(math.nan)
            for slot in (3, 0, 4):
                cache.clear(slot, max_len)
        else:
            old = [running(slot, random_prompt(rng, max_len)) for slot in range(n_slots)]
            model.forward_packed(nanobatch.pack_step([(run, run.request.prompt) for run in old], [], n_slots,
                                                     device)[0], cache)
        # 1) Prompts of 12, 2 and 5 tokens into slots 3, 0, 4, fed in random chunks; once a prompt is
        #    in, a random token is appended each step, as if sampled, and fed alone.
        runs = [running(slot, random_prompt(rng, n)) for slot, n in [(3, 12), (0, 2), (4, 5)]]
        n_checked = 0
        for step in range(12):
            work = []
            for run in runs:
                sequence = run.request.prompt + run.tokens
                if run.n_cached == len(sequence):  # all in: the next token, fed alone
                    run.tokens.append(rng.randrange(V))
                    work.append((run, run.tokens[-1:]))
                else:
                    n = min(rng.randint(1, 3), len(sequence) - run.n_cached)
                    work.append((run, sequence[run.n_cached:run.n_cached + n]))
            packed, due = nanobatch.pack_step(work, [], n_slots, device)
            n_alone = sum(rows.stop - rows.start == 1 for rows, _, _ in packed.chunks)
            n_split_steps += packed.n_one_token > 0 and n_alone > 0  # one-token rows on both sides of the cut
            got = model.forward_packed(packed, cache)  # (R, V)
            for row, run in zip(got, due):
                sequence = run.request.prompt + run.tokens
                want = model(torch.tensor([sequence], device=device))[0, -1]  # (V,)
                where = f"step {step}, slot {run.slot} at position {len(sequence) - 1}"
                if atol is None:
                    exact = exact_model(torch.tensor([sequence], device=device))[0, -1]
                    assert verdict(row, want, exact)[0] == "rounding", f"{where}: {verdict(row, want, exact)[1]}"
                else:
                    assert torch.allclose(row, want, rtol=0, atol=atol), f"{where}: {worst(row, want)}"
                n_checked += 1
            for run, ids in work:
                run.n_cached += len(ids)
        assert n_checked > 25, f"only {n_checked} rows were due a token: the feeding lost its teeth"
        assert n_split_steps >= 3 if cut == "split" else n_split_steps == 0, f"{n_split_steps} steps split"


# ---------------------------------------------------------------------------------------------
# 4) Loading Hugging Face checkpoints, written here by hand


CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@pytest.fixture(scope="module")
def saved():
    """A float32 GPT to save. Heads of 64 dimensions, as in GPT-2, so that it loads without a
    config.json too (the head count is in no tensor's shape)."""
    return tiny_gpt(dtype=torch.float32, seed=1, n_head=2, n_embd=128)


def hf_tensors(model, prefix="", buffers=True, lm_head=False):
    """The model's parameters named and laid out as Hugging Face stores GPT-2."""
    tensors = {}
    for name, p in model.named_parameters():  # the tied lm_head is listed once, as wte
        name = name.removeprefix("transformer.")
        tensors[prefix + name] = (p.t() if name.endswith(CONV1D) else p).detach().contiguous().clone()  # (in, out)
    if buffers:  # the causal-mask buffers that old checkpoints carry
        n = model.config.block_size
        for i in range(model.config.n_layer):
            tensors[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
            tensors[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    if lm_head:
        tensors["lm_head.weight"] = tensors[prefix + "wte.weight"].clone()
    return tensors


def write_safetensors(path, tensors):
    """The safetensors format by hand: 8 bytes of header length, a JSON header, then raw bytes."""
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        raw = ctypes.string_at(t.data_ptr(), t.nbytes)  # the tensor's memory, byte for byte, no numpy
        dtype = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16"}[t.dtype]
        header[name] = dict(dtype=dtype, shape=list(t.shape), data_offsets=[offset, offset + len(raw)])
        chunks.append(raw)
        offset += len(raw)
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format pads its header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + b"".join(chunks))
    return header


LAYOUTS = {  # name: (file, key prefix, causal-mask buffers, lm_head.weight, config.json)
    "hub safetensors": ("model.safetensors", "", True, False, True),
    "safetensors, transformer. keys, no config": ("model.safetensors", "transformer.", True, True, False),
    "bin, transformer. keys": ("pytorch_model.bin", "transformer.", True, True, True),
    "bin, bare keys, no buffers, no config": ("pytorch_model.bin", "", False, False, False),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_hf_checkpoint(saved, tmp_path, layout):
    """A checkpoint in each layout the hub has loads, from its directory or its file, into the saved
    model: same sizes, same logits. Square Conv1D weights (c_proj) left untransposed would still
    fit their shapes: only the logits catch that."""
    filename, prefix, buffers, lm_head, config_json = LAYOUTS[layout]
    tensors = hf_tensors(saved, prefix, buffers, lm_head)
    if filename.endswith(".safetensors"):
        write_safetensors(tmp_path / filename, tensors)
    else:
        torch.save(tensors, tmp_path / filename)
    c = saved.config
    if config_json:
        config = dict(n_positions=c.block_size, vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head,
                      n_embd=c.n_embd, model_type="gpt2")
        (tmp_path / "config.json").write_text(json.dumps(config))
    idx = torch.tensor([random_prompt(random.Random(8), 12)])
    with torch.no_grad():
        want = saved(idx)
        for source in (tmp_path, tmp_path / filename):
            loaded = GPT.from_pretrained(source).eval()
            assert loaded.config == saved.config
            got = loaded(idx)
            assert torch.allclose(got, want, rtol=0, atol=1e-6), f"{source.name}: {worst(got, want)}"


@pytest.mark.parametrize("damage, message", [
    ("missing tensor", r"missing.*h\.1\.mlp\.c_fc\.bias"),
    ("unexpected tensor", r"unexpected.*h\.0\.attn\.rotary\.weight"),
    ("wrong shape", r"h\.0\.ln_1\.weight.*127.*128"),  # both shapes, the file's and the model's
    ("untied lm_head", r"lm_head\.weight"),
])
def test_wrong_tensors_are_refused(saved, tmp_path, damage, message):
    """A checkpoint with a tensor missing, extra, misshapen, or an lm_head that is not wte is refused
    with a ValueError that names the tensor: never loaded half."""
    tensors = hf_tensors(saved)
    if damage == "missing tensor":
        del tensors["h.1.mlp.c_fc.bias"]
    elif damage == "unexpected tensor":
        tensors["h.0.attn.rotary.weight"] = torch.zeros(4)
    elif damage == "wrong shape":
        tensors["h.0.ln_1.weight"] = tensors["h.0.ln_1.weight"][:127].clone()
    else:
        tensors["lm_head.weight"] = tensors["wte.weight"] + 1
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(tmp_path)


@pytest.mark.parametrize("damage", ["garbage header", "header not an object", "header cut short",
                                    "absurd header length", "data cut short", "offsets past the end"])
def test_corrupt_safetensors_are_refused(tmp_path, damage):
    """A damaged file is a ValueError naming what is wrong, not a crash deep inside torch or json."""
    path = tmp_path / "model.safetensors"
    header = write_safetensors(path, {"wte.weight": torch.randn(10, 8), "wpe.weight": torch.randn(4, 8)})
    data = path.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    message = "header"
    if damage == "garbage header":
        data = data[:8] + b"\xff" * header_len + data[8 + header_len:]
    elif damage == "header not an object":
        data = struct.pack("<Q", 8) + b"[1, 2]  "
    elif damage == "header cut short":
        data = data[:8 + header_len // 2]
    elif damage == "absurd header length":
        data = struct.pack("<Q", 2**62) + data[8:]
    elif damage == "data cut short":  # the last tensor's bytes run past the end
        data, message = data[:-4], "wpe.weight"
    else:
        begin, end = header["wte.weight"]["data_offsets"]
        header["wte.weight"]["data_offsets"] = [begin + len(data), end + len(data)]
        header_bytes = json.dumps(header).encode()
        data = struct.pack("<Q", len(header_bytes)) + header_bytes + data[8 + header_len:]
        message = "wte.weight"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(path)


@pytest.mark.parametrize("damage", ["empty .bin", "text .bin", "pickled code", "both key layouts",
                                    "config.json garbled", "n_head does not divide n_embd"])
def test_other_bad_checkpoints_are_refused(saved, tmp_path, damage):
    """More ways a checkpoint can be wrong, each a ValueError with the path in it, never a traceback
    from deep inside torch, and never code run from the file."""
    tensors = hf_tensors(saved)
    path = tmp_path / "pytorch_model.bin"
    if damage == "empty .bin":
        path.write_bytes(b"")
    elif damage == "text .bin":
        path.write_text("hello world")
    elif damage == "pickled code":  # weights_only=True must refuse to call anything
        torch.save({"wte.weight": torch.zeros(2, 2), "trap": Trap()}, path)
    else:
        path = tmp_path / "model.safetensors"
        if damage == "both key layouts":
            tensors["transformer.h.0.ln_1.weight"] = torch.zeros_like(tensors["h.0.ln_1.weight"])
        write_safetensors(path, tensors)
        if damage == "config.json garbled":
            (tmp_path / "config.json").write_text("{n_head: 4")
        elif damage == "n_head does not divide n_embd":
            (tmp_path / "config.json").write_text(json.dumps({"n_head": 3}))
    with pytest.raises(ValueError, match=str(tmp_path)):
        GPT.from_pretrained(path)
    assert not Trap.called, "loading ran code from the file"


class Trap:
    """Unpickling this calls Trap.spring: a stand-in for code hidden in a checkpoint."""
    called = False

    def __reduce__(self):
        return (Trap.spring, ())

    @staticmethod
    def spring():
        Trap.called = True


def test_missing_checkpoint(tmp_path):
    """A path that is not there, or a directory without weights, is a FileNotFoundError."""
    with pytest.raises(FileNotFoundError):
        GPT.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        GPT.from_pretrained(tmp_path)


def test_download_checkpoint(saved, tmp_path, monkeypatch):
    """A name is fetched from HF_URL into the cache, the file appearing only once whole. Here HF_URL
    points at a local file, so nothing leaves the machine."""
    hub = tmp_path / "hub" / "gpt2"
    hub.mkdir(parents=True)
    write_safetensors(hub / "model.safetensors", hf_tensors(saved))
    monkeypatch.setattr(model_py, "HF_URL", f"file://{tmp_path}/hub/{{name}}/model.safetensors")
    path = model_py.download_checkpoint("gpt2", tmp_path / "cache")
    assert path.read_bytes() == (hub / "model.safetensors").read_bytes()
    assert [p.name for p in path.parent.iterdir()] == ["model.safetensors"], "a .partial file was left behind"
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(GPT.from_pretrained(path)(idx), saved(idx))
    monkeypatch.setattr(model_py, "HF_URL", "file:///nowhere/{name}")  # a second call downloads nothing
    assert model_py.download_checkpoint("gpt2", tmp_path / "cache") == path


class DroppedConnection(io.BytesIO):
    """A response that delivers 10 bytes, then loses the connection."""
    headers = {"Content-Length": "1000"}

    def read(self, size=-1):
        if self.tell():
            raise TimeoutError("the connection dropped")
        return super().read(10)


class EndedEarly(DroppedConnection):
    """A response that delivers 10 of its 1000 bytes, then ends as if complete: http.client does
    exactly this when the server closes the connection early, without raising anything."""

    def read(self, size=-1):
        return b"" if self.tell() else super().read(10)


@pytest.mark.parametrize("failure", ["no network", "dropped midway", "ended early"])
def test_failed_download(tmp_path, monkeypatch, failure):
    """Offline, or cut off halfway: a one-line ConnectionError, and no file, partial or whole, left."""
    def urlopen(url, timeout=None):
        if failure == "no network":
            raise urllib.error.URLError("Name or service not known")
        return (DroppedConnection if failure == "dropped midway" else EndedEarly)(b"x" * 1000)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    with pytest.raises(ConnectionError) as error:
        GPT.from_pretrained("gpt2", cache_dir=tmp_path)
    assert "gpt2" in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


# ---------------------------------------------------------------------------------------------
# 5) Bad input is refused before any work, naming the field


GOOD = dict(prompt=[1, 2, 3], max_new_tokens=4)
BAD_INPUTS = [  # (what is wrong, fields of the second Request, generate's arguments, the name in the message)
    ("empty prompt", dict(prompt=[]), {}, r"requests\[1\]\.prompt"),
    ("empty tensor prompt", dict(prompt=torch.tensor([], dtype=torch.long)), {}, r"requests\[1\]\.prompt"),
    ("token id past the vocabulary", dict(prompt=[1, GPT2_V]), {}, r"requests\[1\]\.prompt"),
    ("token id past the vocabulary, in a tensor", dict(prompt=torch.tensor([1, GPT2_V])), {}, r"requests\[1\]\.prompt"),
    ("negative token id", dict(prompt=[-1, 2]), {}, r"requests\[1\]\.prompt"),
    ("prompt fills max_len", dict(prompt=[1] * 16), dict(max_len=16), r"requests\[1\]\.prompt"),
    # A prompt must be one flat row of int ids: not text, not a batch, not floats, not bools.
    ("text prompt", dict(prompt="The capital of France is"), {}, r"requests\[1\]\.prompt"),
    ("no prompt", dict(prompt=None), {}, r"requests\[1\]\.prompt"),
    ("nested list prompt", dict(prompt=[[1, 2], [3, 4]]), {}, r"requests\[1\]\.prompt"),
    ("2-D tensor prompt", dict(prompt=torch.tensor([[1, 2], [3, 4]])), {}, r"requests\[1\]\.prompt"),
    ("0-D tensor prompt", dict(prompt=torch.tensor(5)), {}, r"requests\[1\]\.prompt"),
    ("float token id", dict(prompt=[1, 5.0]), {}, r"requests\[1\]\.prompt"),
    ("float tensor prompt", dict(prompt=torch.tensor([1.0, 2.0])), {}, r"requests\[1\]\.prompt"),
    ("bool token id", dict(prompt=[True, 5]), {}, r"requests\[1\]\.prompt"),
    ("bool tensor prompt", dict(prompt=torch.tensor([True, False])), {}, r"requests\[1\]\.prompt"),
    ("set prompt", dict(prompt={1, 2}), {}, r"requests\[1\]\.prompt"),  # no order
    ("generator prompt", dict(prompt=(t for t in [1, 2])), {}, r"requests\[1\]\.prompt"),
    # The numbers of a request: bools are refused wherever an int is expected, though True == 1.
    ("no new tokens", dict(max_new_tokens=0), {}, r"requests\[1\]\.max_new_tokens"),
    ("max_new_tokens True", dict(max_new_tokens=True), {}, r"requests\[1\]\.max_new_tokens"),
    ("max_new_tokens 4.0", dict(max_new_tokens=4.0), {}, r"requests\[1\]\.max_new_tokens"),
    ("max_new_tokens as text", dict(max_new_tokens="4"), {}, r"requests\[1\]\.max_new_tokens"),
    ("negative temperature", dict(temperature=-0.5), {}, r"requests\[1\]\.temperature"),
    ("NaN temperature", dict(temperature=math.nan), {}, r"requests\[1\]\.temperature"),
    ("infinite temperature", dict(temperature=math.inf), {}, r"requests\[1\]\.temperature"),
    ("minus infinite temperature", dict(temperature=-math.inf), {}, r"requests\[1\]\.temperature"),
    ("temperature as text", dict(temperature="0.8"), {}, r"requests\[1\]\.temperature"),
    ("temperature True", dict(temperature=True), {}, r"requests\[1\]\.temperature"),
    ("no temperature", dict(temperature=None), {}, r"requests\[1\]\.temperature"),
    ("top_k of 0", dict(top_k=0), {}, r"requests\[1\]\.top_k"),
    ("top_k True", dict(top_k=True), {}, r"requests\[1\]\.top_k"),
    ("top_k 2.5", dict(top_k=2.5), {}, r"requests\[1\]\.top_k"),
    ("seed as text", dict(seed="abc"), {}, r"requests\[1\]\.seed"),
    ("seed 1.5", dict(seed=1.5), {}, r"requests\[1\]\.seed"),
    ("seed True", dict(seed=True), {}, r"requests\[1\]\.seed"),
    ("seed past 64 bits", dict(seed=2**64), {}, r"requests\[1\]\.seed"),
    ("negative arrival", dict(arrival=-1), {}, r"requests\[1\]\.arrival"),
    ("arrival True", dict(arrival=True), {}, r"requests\[1\]\.arrival"),
    ("arrival 1.0", dict(arrival=1.0), {}, r"requests\[1\]\.arrival"),
    ("no arrival", dict(arrival=None), {}, r"requests\[1\]\.arrival"),
    # generate's own arguments.
    ("no slots", {}, dict(n_slots=0), r"n_slots"),
    ("n_slots True", {}, dict(n_slots=True), r"n_slots"),
    ("n_slots 2.0", {}, dict(n_slots=2.0), r"n_slots"),
    ("n_slots None", {}, dict(n_slots=None), r"n_slots"),
    ("max_len past block_size", {}, dict(max_len=TINY["block_size"] + 1), r"max_len"),
    ("max_len 16.0", {}, dict(max_len=16.0), r"max_len"),
    ("max_len as text", {}, dict(max_len="16"), r"max_len"),
    ("eos_id past the vocabulary", {}, dict(eos_id=GPT2_V), r"eos_id"),
    ("negative eos_id", {}, dict(eos_id=-1), r"eos_id"),
    ("eos_id True", {}, dict(eos_id=True), r"eos_id"),
    ("eos_id as text", {}, dict(eos_id="50256"), r"eos_id"),
    ("unknown policy", {}, dict(policy="fifo"), r"policy"),
    ("policy in a list", {}, dict(policy=["continuous"]), r"policy"),
    ("no policy", {}, dict(policy=None), r"policy"),
    ("disaggregate with static", {}, dict(policy="static", disaggregate=True), r"disaggregate=True needs"),
    ("disaggregate 1", {}, dict(disaggregate=1), r"disaggregate must be True or False"),
]


@pytest.mark.parametrize("fields, arguments, name", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_refused(gpt2_vocab, fields, arguments, name):
    """Every unservable input is a ValueError naming the field, raised before the first step: the
    good request in front of the bad one is never served. A wrong type too: never a TypeError, nor
    an error from deep inside torch."""
    requests = [Request(**GOOD), Request(**{**GOOD, **fields})]
    steps = []
    with pytest.raises(ValueError, match=name):
        generate(gpt2_vocab, requests, on_step=steps.append, **arguments)
    assert steps == [], "it failed halfway, after serving steps"
    if not {"n_slots", "policy", "disaggregate"} & arguments.keys():  # the reference refuses the same requests
        with pytest.raises(ValueError, match=name):
            generate_sequential(gpt2_vocab, requests, **arguments)


@pytest.mark.parametrize("make_requests, name", [
    (lambda: Request(**GOOD), r"requests must be"),  # one request, not in a list
    (lambda: None, r"requests must be"),
    (lambda: [Request(**GOOD), "The capital of France is"], r"requests\[1\] must be a Request, got str"),
    (lambda: [Request(**GOOD), GOOD], r"requests\[1\] must be a Request, got dict"),
    (lambda: (r for r in [Request(**GOOD), None]), r"requests\[1\] must be a Request, got NoneType"),
], ids=["a lone Request", "None", "text among them", "a dict among them", "None from a generator"])
def test_requests_must_be_requests(gpt2_vocab, make_requests, name):
    """requests may be any iterable (a generator too), each of its items a Request."""
    for serve in (generate, generate_sequential):
        with pytest.raises(ValueError, match=name):
            serve(gpt2_vocab, make_requests())


def test_bad_numpy_input_is_refused(gpt2_vocab):
    """numpy arrays pass only as one row of integer ids, as tensors do; numpy's bool is no id either."""
    np = pytest.importorskip("numpy")
    for prompt in (np.array([1.0, 2.0]), np.array([[1, 2]]), np.array([True, False]), [np.bool_(True), 2],
                   np.array([1, GPT2_V])):
        with pytest.raises(ValueError, match=r"requests\[0\]\.prompt"):
            generate(gpt2_vocab, [Request(prompt, 4)])
    with pytest.raises(ValueError, match=r"requests\[0\]\.seed"):
        generate(gpt2_vocab, [Request([1, 2], 4, seed=np.float64(1.0))])


@pytest.mark.parametrize("prefill_chunk", [0, -3, True, 2.5, "4"])
def test_bad_prefill_chunk_is_refused(gpt2_vocab, prefill_chunk):
    """check_arguments already checks prefill_chunk, the most prompt tokens one step may take in:
    None or an int >= 1."""
    with pytest.raises(ValueError, match="prefill_chunk"):
        nanobatch.check_arguments(gpt2_vocab, [Request(**GOOD)], 2, MAX_LEN, None, "continuous",
                                  prefill_chunk=prefill_chunk)


def snapshot(requests):
    """Each request's fields, and its prompt's ids copied: to check later that nothing was changed."""
    return [(dict(vars(r)), [int(t) for t in r.prompt]) for r in requests]


def assert_unchanged(requests, snapshots):
    """Every field still holds the very object it held, and every prompt the same ids."""
    for i, (r, (fields, ids)) in enumerate(zip(requests, snapshots)):
        assert all(getattr(r, name) is value for name, value in fields.items()), f"requests[{i}] was changed"
        assert [int(t) for t in r.prompt] == ids, f"requests[{i}].prompt was changed"


def test_accepted_forms_serve_the_same(gpt):
    """A prompt may be a list, a tuple, a 1-D integer tensor or numpy array, or a list of numpy
    ints; a number may be a numpy number; requests may come from a generator. Each form serves
    exactly the tokens of plain lists and Python numbers, through the engine and the reference,
    and leaves the caller's requests as they were."""
    np = pytest.importorskip("numpy")
    rng = random.Random(12)
    plain = [Request(random_prompt(rng, 5), 4), Request(random_prompt(rng, 1), 3, 0.9, 20, seed=51, arrival=1),
             Request(random_prompt(rng, 9), 5, 1.3, seed=52)]  # greedy and sampled, so seeds matter
    forms = {
        "tuple": lambda r: replace(r, prompt=tuple(r.prompt)),
        "1-D tensor": lambda r: replace(r, prompt=torch.tensor(r.prompt)),
        "1-D int32 tensor": lambda r: replace(r, prompt=torch.tensor(r.prompt, dtype=torch.int32)),
        "numpy int64 array": lambda r: replace(r, prompt=np.array(r.prompt, dtype=np.int64)),
        "list of numpy ints": lambda r: replace(r, prompt=list(np.array(r.prompt))),
        "numpy numbers": lambda r: replace(  # np.float64 holds the very same float as Python's
            r, max_new_tokens=np.int64(r.max_new_tokens), temperature=np.float64(r.temperature),
            top_k=None if r.top_k is None else np.int32(r.top_k),
            seed=None if r.seed is None else np.int64(r.seed), arrival=np.int64(r.arrival)),
    }
    if torch.cuda.is_available():  # a prompt may live on another device than the model
        forms["1-D tensor on the GPU"] = lambda r: replace(r, prompt=torch.tensor(r.prompt, device="cuda"))
    for serve, settings in [(generate, dict(n_slots=2)), (generate_sequential, {})]:
        want = serve(gpt, plain, max_len=MAX_LEN, eos_id=None, **settings)
        got = serve(gpt, (r for r in plain), max_len=MAX_LEN, eos_id=None, **settings)
        assert first_difference(got, want) == "", f"{serve.__name__}, requests from a generator"
        for form, make in forms.items():
            requests = [make(r) for r in plain]
            before = snapshot(requests)
            got = serve(gpt, requests, max_len=MAX_LEN, eos_id=None, **settings)
            assert first_difference(got, want) == "", f"{serve.__name__}, {form}"
            assert_unchanged(requests, before)


def test_check_arguments_returns_plain_copies(gpt2_vocab):
    """What the engine receives: new Request objects whose prompt is a list of ints and whose numbers
    are ints and floats, equal in value to the caller's."""
    np = pytest.importorskip("numpy")
    requests = [Request(np.array([5, 6, 7]), np.int64(3), np.float32(0.5), np.int64(4), seed=np.int64(9),
                        arrival=np.int64(2)),
                Request(torch.tensor([8]), 2, 1)]
    before = snapshot(requests)
    checked = nanobatch.check_arguments(gpt2_vocab, iter(requests), 2, MAX_LEN, None, "continuous", prefill_chunk=4)
    assert_unchanged(requests, before)
    assert [type(r) for r in checked] == [Request, Request] and checked[0] is not requests[0]
    assert checked[0] == Request([5, 6, 7], 3, 0.5, 4, seed=9, arrival=2)
    assert checked[1] == Request([8], 2, 1.0)
    for r in checked:
        assert {type(t) for t in r.prompt} == {int} and type(r.prompt) is list
        assert type(r.max_new_tokens) is int and type(r.temperature) is float and type(r.arrival) is int
        assert r.seed is None or type(r.seed) is int
        assert r.top_k is None or type(r.top_k) is int


def test_a_long_bad_prompt_gives_a_short_message(gpt2_vocab):
    """A 2000-token prompt with one bad id is named by its field, the id and its place, in a line
    a person can read: a few tokens at most, never the whole prompt echoed back."""
    prompt = random_prompt(random.Random(13), 2000)
    bad_prompts = {
        "an id past the vocabulary": prompt[:1500] + [GPT2_V] + prompt[1500:],
        "the same, in a tensor": torch.tensor(prompt[:1500] + [GPT2_V] + prompt[1500:]),
        "a float": prompt[:1500] + [5.0] + prompt[1500:],
        "a batch of one": [prompt],
        "a 2-D tensor": torch.tensor([prompt]),
        "too long for max_len": prompt,
    }
    messages = {}
    for what, bad in bad_prompts.items():
        with pytest.raises(ValueError, match=r"requests\[0\]\.prompt") as error:
            generate(gpt2_vocab, [Request(bad, 4)])
        messages[what] = str(error.value)
    with pytest.raises(ValueError, match=r"requests\[0\]\.temperature") as error:
        generate(gpt2_vocab, [Request([1, 2], 4, temperature="0." + "8" * 2000)])
    messages["a 2000-character temperature"] = str(error.value)
    for what, message in messages.items():
        assert len(message) < 200, f"{what}: {len(message)} characters: {message[:300]}"
    assert f"token id {GPT2_V} (at index 1500)" in messages["an id past the vocabulary"]


# ---------------------------------------------------------------------------------------------
# 6) The figures, on a schedule small enough to check by hand


def step(belt, n_running, n_prefilling, n_waiting, step_s, handed_over=(), kv_bytes=0, kv_s=0.0):
    """A stand-in for a StepReport: what summarize reads. The model's share of a step is 4/5 of it."""
    return SimpleNamespace(belt=belt, n_running=n_running, n_prefilling=n_prefilling, n_waiting=n_waiting,
                           step_s=step_s, model_s=0.8 * step_s, handed_over=list(handed_over), kv_bytes=kv_bytes,
                           kv_s=kv_s)


def served(slot, admit_step, first_token_step, finish_step, token_times_s):
    """A stand-in for a Completion, its token times in seconds from its request's arrival."""
    return SimpleNamespace(slot=slot, admit_step=admit_step, first_token_step=first_token_step,
                           finish_step=finish_step, token_times_s=token_times_s, ttft_s=token_times_s[0],
                           latency_s=token_times_s[-1])


# Two slots, three requests, five steps, the belt as print_step would show it:
#   step 0  |A~|  A's prompt and B's go in; A makes its first token, B's prompt needs another step
#   step 1  |AB|  A makes its second and last token; C arrives, and waits: no slot is free
#   step 2  |CB|  C takes A's slot, its first token with it
#   step 3  |CB|  C's second and last token
#   step 4  |.B|  B's fourth and last token
# The steps last 0.5, 0.25, 0.25, 0.5 and 0.25 s, so they end at 0.5, 0.75, 1, 1.5 and 1.75 s; the
# whole run took 2.5 s. C arrived as step 1 began, at 0.5 s: its tokens came 0.5 and 1 s later.
SCHEDULE = [step("A~", 1, 1, 0, 0.5), step("AB", 2, 0, 1, 0.25), step("CB", 2, 0, 0, 0.25),
            step("CB", 2, 0, 0, 0.5), step(".B", 1, 0, 0, 0.25)]
ARRIVALS = [SimpleNamespace(arrival=0), SimpleNamespace(arrival=0), SimpleNamespace(arrival=1)]
SERVED = [served(0, 0, 0, 1, [0.5, 0.75]), served(1, 0, 1, 4, [0.75, 1.0, 1.5, 1.75]), served(0, 2, 2, 3, [0.5, 1.0])]


def test_percentile_is_the_nearest_rank():
    """P50 of 4 values is the 2nd smallest (2 of 4 at or below it), P99 of 1..100 is 99, and P99 of
    fewer than 100 values is the largest."""
    assert nanobatch.percentile([40, 10, 30, 20], 50) == 20
    assert nanobatch.percentile(range(1, 101), 99) == 99
    assert nanobatch.percentile([3, 1, 2], 99) == 3


def test_summarize_by_hand():
    """Every figure of the schedule above, worked out by hand."""
    figures = nanobatch.summarize(ARRIVALS, SERVED, SCHEDULE, wall_s=2.5)
    assert figures.keys() == nanobatch.LEGEND.keys(), "a figure without its line in the legend, or the reverse"
    want = {
        "steps": 5,
        "generated tokens": 8,  # 1 + 2 + 2 + 2 + 1: A's 2, B's 4, C's 2
        "wall time (s)": 2.5,
        "tokens/s": 3.2,  # 8 / 2.5
        "tokens/s while queued": 8.0,  # only step 1 left a request waiting: 2 tokens in 0.25 s
        "mean occupancy": 0.9,  # 2 + 2 + 2 + 2 + 1 busy slots (B prefilling counts) of 5 x 2
        "occupancy while queued": 1.0,  # step 1: 2 of 2
        "latency P50/P99 (steps)": (3, 5),  # from arrival to last token: A 2 (steps 0-1), C 3 (1-3), B 5 (0-4)
        "latency P50/P99 (s)": (1.0, 1.75),  # A 0.75, C 1, B 1.75
        "TTFT P50/P99 (steps)": (2, 2),  # A 1 (step 0), B 2 (0-1), C 2 (1-2)
        "TTFT P50/P99 (s)": (0.5, 0.75),  # A 0.5, C 0.5, B 0.75
        "TBT P50/P99 (ms)": (250, 500),  # the gaps: A 250; B 250, 500, 250; C 500
        "slowest step (ms)": 500,
        "time outside the model": 0.44,  # 1 - 1.4 / 2.5: the model took 4/5 of the steps' 1.75 s
        "KV moved (MB / ms)": None,  # not disaggregated: no prefill worker, nothing handed over
    }
    for name, value in want.items():
        assert figures[name] == pytest.approx(value), f"{name}: got {figures[name]}, want {value}"


def test_summarize_kv_moved_by_hand():
    """Disaggregated, the same schedule with A's and B's prompts handed over by the worker in step
    0 (1.5 MB in 2 ms) and C's in step 2 (0.25 MB in 0.5 ms): 1.75 MB in 2.5 ms in all."""
    handovers = [dict(handed_over=[0, 1], kv_bytes=1_500_000, kv_s=0.002), {},
                 dict(handed_over=[2], kv_bytes=250_000, kv_s=0.0005), {}, {}]
    handed = [SimpleNamespace(**{**vars(report), **changes}) for report, changes in zip(SCHEDULE, handovers)]
    megabytes, milliseconds = nanobatch.summarize(ARRIVALS, SERVED, handed, wall_s=2.5)["KV moved (MB / ms)"]
    assert (megabytes, milliseconds) == (pytest.approx(1.75), pytest.approx(2.5))


def test_summarize_a_run_cut_short():
    """Ctrl-C after step 2: B and C were still running, and their tokens count all the same."""
    figures = nanobatch.summarize(ARRIVALS, [SERVED[0], None, None], SCHEDULE[:3], wall_s=1.0)
    assert figures["generated tokens"] == 5  # A's 2, B's first 2, C's first 1
    assert figures["mean occupancy"] == 1.0  # 6 busy slots of 3 x 2
    assert figures["latency P50/P99 (steps)"] == (2, 2)  # A alone finished
    assert figures["tokens/s"] == 5.0


# ---------------------------------------------------------------------------------------------
# 7) The belt as a picture: every stay drawn where and as long as it was, in its own colour


SVG = "{http://www.w3.org/2000/svg}"  # ElementTree names SVG's elements by namespace


def stay(slot, admit_step, first_token_step, finish_step):
    """A stand-in for a Completion: what belt_svg reads, and nothing else."""
    return SimpleNamespace(slot=slot, admit_step=admit_step, first_token_step=first_token_step,
                           finish_step=finish_step, tokens=[0] * (finish_step - first_token_step + 1))


def headline(n_steps):
    return {"steps": n_steps, "tokens/s": 49.3, "TTFT P50/P99 (steps)": (6, 11)}


# Six requests on a belt of 3 slots, the last unfinished (None): B and D spend steps prefilling only.
CONTINUOUS = [stay(0, 0, 0, 4), stay(1, 0, 2, 9), stay(2, 0, 0, 2), stay(2, 3, 5, 7), stay(0, 5, 5, 6), None]
STATIC = [stay(0, 0, 0, 4), stay(1, 0, 2, 9), stay(2, 0, 0, 2), stay(0, 10, 12, 14), stay(1, 10, 10, 11), None]
BELTS = [("continuous", 3, CONTINUOUS, headline(10), None), ("static", 3, STATIC, headline(15), None)]


def drawn_panels(svg):
    """The SVG parsed back -> per panel: (its px per step, {request: its stay bar}, {request: its
    prefill mark}). Parsing is the first check: a browser shows nothing of a malformed file."""
    panels = []
    for group in ET.fromstring(svg).iter(f"{SVG}g"):
        if group.get("class") == "panel":
            def by_request(kind):
                rects = [r for r in group.iter(f"{SVG}rect") if r.get("class") == kind]
                by_index = {int(r.get("data-request")): r for r in rects}
                assert len(by_index) == len(rects), f"a request with two {kind} rects"
                return by_index
            panels.append((float(group.get("data-step-width")), by_request("stay"), by_request("prefill")))
    return panels


def check_stays(svg, belts):
    """Per panel: exactly one bar per finished request, on its slot's row, from its admit step, as long
    as its stay, never over another in its slot; a hatched mark over exactly its prefill-only steps."""
    panels = drawn_panels(svg)
    assert len(panels) == len(belts)
    assert len({step_w for step_w, _, _ in panels}) == 1, "panels on different step scales"
    for (title, _, completions, _, _), (step_w, bars, prefills) in zip(belts, panels):
        # 1) Which: every finished request, and no other; hatched, those that spent steps prefilling.
        finished = {i for i, c in enumerate(completions) if c is not None}
        prefilling = {i for i in finished if completions[i].first_token_step > completions[i].admit_step}
        assert bars.keys() == finished, \
            f"{title}: bars for {sorted(bars.keys() - finished)} unfinished, none for {sorted(finished - bars.keys())}"
        assert prefills.keys() == prefilling, \
            f"{title}: marks on {sorted(prefills.keys() - prefilling)}, none on {sorted(prefilling - prefills.keys())}"
        # 2) Where: each slot on a row of its own, each bar from its admit step (step 0 at one x).
        row_of_slot, step_0_at = {}, set()
        for i, bar in bars.items():
            c = completions[i]
            y = row_of_slot.setdefault(c.slot, bar.get("y"))
            assert bar.get("y") == y, f"{title}: slot {c.slot} drawn on two rows"
            assert (int(bar.get("data-slot")), int(bar.get("data-admit"))) == (c.slot, c.admit_step)
            step_0_at.add(round(float(bar.get("x")) - c.admit_step * step_w, 1))
        assert len(set(row_of_slot.values())) == len(row_of_slot), f"{title}: two slots on one row"
        assert len(step_0_at) == 1, f"{title}: bars not at their admit steps, step 0 at x = {step_0_at}"
        # 3) How long: a stay of n steps is n step-widths; a mark covers the prefill-only steps.
        for i, bar in bars.items():
            c, width = completions[i], float(bar.get("width"))
            n_steps = c.finish_step - c.admit_step + 1
            assert width == pytest.approx(n_steps * step_w, abs=0.02), \
                f"{title}: request {i}'s bar is {width / step_w:.2f} steps long, its stay {n_steps}"
        for i, mark in prefills.items():
            c, bar = completions[i], bars[i]
            assert (mark.get("x"), mark.get("y")) == (bar.get("x"), bar.get("y")), f"request {i}'s mark"
            n_prefill_steps = c.first_token_step - c.admit_step
            assert float(mark.get("width")) == pytest.approx(n_prefill_steps * step_w, abs=0.02), f"request {i}"
        # 4) No two bars on top of each other in a slot.
        for slot in row_of_slot:
            in_slot = sorted((float(bar.get("x")), float(bar.get("width")), i) for i, bar in bars.items()
                             if completions[i].slot == slot)
            for (x, width, i), (next_x, _, j) in zip(in_slot, in_slot[1:]):
                assert x + width <= next_x + 0.02, f"{title}: requests {i} and {j} overlap in slot {slot}"


def test_belt_svg_draws_every_stay():
    """Two runs of six requests, by hand: each bar where and as long as its stay, nothing for the
    unfinished request, the headline figures in the titles."""
    svg = belt_svg.belt_svg(BELTS)
    check_stays(svg, BELTS)
    titles = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text") if t.get("font-weight") == "bold"]
    assert titles == ["continuous, 3 slots: 10 steps, 49.3 tokens/s, TTFT P50 6 steps",
                      "static, 3 slots: 15 steps, 49.3 tokens/s, TTFT P50 6 steps"], titles


def test_belt_svg_one_colour_per_request():
    """A colour names a request: the same in every panel, and different for each of the six."""
    panels = drawn_panels(belt_svg.belt_svg(BELTS))
    fills = [{i: bar.get("fill") for i, bar in bars.items()} for _, bars, _ in panels]
    assert fills[0] == fills[1], fills
    assert len(set(fills[0].values())) == len(fills[0]), fills[0]


def test_belt_svg_64_slots_300_steps():
    """A busy belt, 64 slots for 300 steps: it still parses, every stay is drawn, and every bar fits
    inside the picture."""
    rng, completions = random.Random(0), []
    for slot in range(64):  # stays one after another, now and then an idle step between
        step = rng.randrange(5)
        while step + (length := rng.randint(1, 40)) <= 300:
            n_prefill_steps = min(rng.choice([0, 0, 1, 3]), length - 1)
            completions.append(stay(slot, step, step + n_prefill_steps, step + length - 1))
            step += length + rng.randrange(3)
    completions[7] = None  # one cut short
    belts = [("continuous", 64, completions, headline(300), None)]
    svg = belt_svg.belt_svg(belts)
    check_stays(svg, belts)
    width = float(ET.fromstring(svg).get("width"))
    _, bars, _ = drawn_panels(svg)[0]
    assert max(float(bar.get("x")) + float(bar.get("width")) for bar in bars.values()) <= width


def test_belt_svg_groups_and_step_durations():
    """Two groups: the two belts above, then one run given its step durations. Each group has a step
    scale of its own, its longest run spanning the width: (1200 - 44 - 16) / 15 = 76 px a step for
    the first, (1200 - 44 - 16 - 40) / 10 = 110 for the second, which leaves 40 px for the scale of
    its durations. The run with durations gets a bar per step reported, at that step, as tall as its
    share of the group's longest step (40 px), grey where no request decoded; the runs without get
    none."""
    times = [(0, 0.1, False), (1, 0.4, True), (2, 0.2, True), (4, 0.05, True)]  # no step 3: the clock jumped
    summary = {**headline(10), "TBT P50/P99 (ms)": (5.0, 123.0)}
    svg = belt_svg.belt_svg(BELTS, [("long prompts", 3, CONTINUOUS, summary, times)])
    assert [step_w for step_w, _, _ in drawn_panels(svg)] == [76, 76, 110]
    panels = [group for group in ET.fromstring(svg).iter(f"{SVG}g") if group.get("class") == "panel"]
    bars = [[r for r in panel.iter(f"{SVG}rect") if r.get("class") == "step-time"] for panel in panels]
    assert [len(b) for b in bars] == [0, 0, 4]
    assert [(int(r.get("data-step")), float(r.get("x")), float(r.get("height"))) for r in bars[2]] == \
        [(0, 44, 10), (1, 154, 40), (2, 264, 20), (4, 484, 5)]
    assert [r.get("fill") for r in bars[2]] == ["#bbb"] + [belt_svg.STEP_COLOUR] * 3  # step 0 decoded nothing
    texts = [t.text for t in panels[2].iter(f"{SVG}text")]
    assert "400 ms" in texts and texts[0].endswith("TBT P99 123 ms"), texts


class Stop(Exception):
    """Ends a run once the test has seen what it looks at."""


def test_bench_warms_each_way_of_serving_up_before_timing_it(monkeypatch):
    """Before its first timed run, the bench serves two short requests, untimed, in each way it is
    about to time (slots, policy, prompt budget, worker): a first call's set-up (cuBLAS, kernels
    loaded, a second GPU's context and its copy of the weights) is not the work's time."""
    calls = []
    monkeypatch.setattr(bench, "generate", lambda model, requests, **kw: calls.append(
        ("untimed", len(requests), kw["n_slots"], kw["policy"], kw["prefill_chunk"], kw["disaggregate"])))

    def timed(model, requests, runs, args, eos_id, show_belt):
        calls.extend(("timed", len(requests), *run[1:]) for run in runs)
        raise Stop

    monkeypatch.setattr(bench, "run_all", timed)
    args = SimpleNamespace(seed=0, quick=True, weights=None, device=torch.device("cpu"), dtype=torch.float32,
                           call_cost=None, decode_steps=False, requests=8, arrival_rate=None, slots=3,
                           prefill_chunk=5, disaggregate=True, max_len=None)
    with pytest.raises(Stop):
        bench.bench(args)
    untimed = [call[2:] for call in calls if call[0] == "untimed"]
    timed_runs = [call[2:] for call in calls if call[0] == "timed"]
    assert calls[:len(untimed)] == [c for c in calls if c[0] == "untimed"], "a timed run before the warm-up"
    assert untimed == timed_runs == [(3, "continuous", 5, False), (3, "static", 5, False),
                                     (1, "continuous", 5, False), (3, "continuous", 5, True)], calls
    assert {call[1] for call in calls if call[0] == "untimed"} == {2}, "the warm-up is not two short requests"


def test_step_times_by_hand():
    """A step decodes when it makes more tokens than first tokens: in the schedule of section 6,
    step 0 makes A's first token and nothing else (B's prompt is still going in), step 1 makes B's
    first token and A's second, step 2 C's first and B's second."""
    assert bench.step_times([SimpleNamespace(step=i, **vars(r)) for i, r in enumerate(SCHEDULE)], SERVED) == \
        [(0, 0.5, False), (1, 0.25, True), (2, 0.25, True), (3, 0.5, True), (4, 0.25, True)]


# ---------------------------------------------------------------------------------------------
# 8) The command line, offline


def cli_env(tmp_path):
    return {**os.environ, "NANOBATCH_CACHE": str(tmp_path),  # an empty cache: no real weights found
            "OMP_NUM_THREADS": "1",  # one CPU thread for torch, as in the suite (see torch.set_num_threads above)
            "PYTHONWARNINGS": "ignore",  # torch's import-time warnings are not the CLI's output
            # Every proxy points at a closed local port: a download attempt fails at once, offline.
            "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": ""}


def run_cli(tmp_path, *args, script="nanobatch.py"):
    return subprocess.run([sys.executable, script, *args], cwd=REPO, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=100)


def default_ctrl_c():
    """In the child: Ctrl-C as a terminal delivers it, even where the suite was started with SIGINT
    ignored (a shell's background job), which Python would then keep ignoring."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_cli(tmp_path, *args):
    return subprocess.Popen([sys.executable, "nanobatch.py", *args], cwd=REPO, env=cli_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=None if sys.platform == "win32" else default_ctrl_c)


def test_cli_demo_quick(tmp_path):
    """The demo runs offline in seconds on a tiny random model: a belt line per step, the table with
    its legend, the sentence that says which rows to compare, and, run by tools/belt_svg.py, a picture
    of both runs, one bar for each of the 32 requests in each."""
    result = run_cli(tmp_path, str(tmp_path / "belt.svg"), "--quick", script="tools/belt_svg.py")
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) > 100, result.stdout[-2000:]
    for row in nanobatch.LEGEND:  # a line in the table, and a line in the legend under it
        assert [line[:24] for line in lines].count(f"{row:24}") == 1, f"{row}: not once in the table"
        assert sum(line.startswith(f"{row}: ") for line in lines) == 1, f"{row}: not once in the legend"
    assert "The rows to compare: steps and TTFT" in result.stdout
    panels = drawn_panels((tmp_path / "belt.svg").read_text())
    assert [sorted(bars) for _, bars, _ in panels] == [list(range(32))] * 2, "not one bar per request per panel"


@pytest.mark.skipif(os.environ.get("NANOBATCH_GPU_CHECK") != "1", reason=(
    "the GPU check's dry run, eleven processes that each import torch, is left out of the default run: "
    "`NANOBATCH_GPU_CHECK=1 python -m pytest -q -k gpu_check_on_the_cpu` runs it, as .ci/run does"))
def test_gpu_check_on_the_cpu(tmp_path):
    """tools/gpu_check.sh --cpu: every step of the GPU check on the CPU with tiny models, each with
    its output and its summary line, all ok. Its outputs are then read as a user would: the bench
    says why --quick's ratios are not GPT-2's, prints its table of decode steps at 8 to 64 slots,
    and draws a bar for each request of each run (continuous and static: 16; the long-prompt runs
    three ways: 16, 8 per slot); the disaggregated demo hands over every one of its 32 requests."""
    out = tmp_path / "out"
    result = subprocess.run(["bash", "tools/gpu_check.sh", str(out), "--cpu"], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**cli_env(tmp_path), "PYTHON": sys.executable})
    summary = (out / "summary.txt").read_text().splitlines()
    steps = ["machine", "pytest", "bench-2-slots-float32", "bench-4-slots-float32", "decode-steps-cost-0",
             "decode-steps-cost-2000", "decode-steps-cost-20000", "verify-bfloat16", "verify-bfloat16-disaggregated",
             "demo-quick-disaggregated", "demo-disaggregated"]
    assert [line.split()[0] for line in summary] == steps and result.stdout.splitlines() == summary, result.stdout
    assert result.returncode == 0 and all(line.split()[1] == "ok" for line in summary), summary
    assert all((out / f"{name}.txt").stat().st_size > 0 for name in steps)
    bench_out = (out / "bench-2-slots-float32.txt").read_text()
    assert "--quick: on a model this small a step's fixed cost" in bench_out, bench_out[-2000:]
    table = [line.split() for line in bench_out.splitlines() if line.split()[1:2] == ["slots"]]
    assert [row[0] for row in table] == ["8", "16", "32", "64"] and all(len(row) == 8 for row in table), table
    panels = drawn_panels((out / "bench-2-slots-float32.svg").read_text())
    assert [sorted(bars) for _, bars, _ in panels] == [list(range(16))] * 5, "not one bar per request per panel"
    assert "12 answers: " in (out / "verify-bfloat16-disaggregated.txt").read_text()
    demo = (out / "demo-quick-disaggregated.txt").read_text()
    assert "== disaggregated: 32 requests" in demo and "the prefill worker on" in demo and "== static" in demo
    handed = [word for line in demo.split("== static")[0].splitlines() if line.startswith("step ")
              for word in line.split() if word.startswith(">")]
    assert sorted(handed) == sorted(f">{nanobatch.letter(i)}" for i in range(32)), handed


@pytest.mark.parametrize("argv, message", [
    (["--demo", "--prompt", "Hi"], "nanobatch.py: error: argument --prompt: not allowed with argument --demo"),
    ([], "nanobatch.py: error: one of the arguments --demo --prompt is required"),
    (["--demo", "--slots", "0"], "nanobatch.py: error: argument --slots: must be > 0, got 0"),
    (["--demo", "--device", "gpu"], "nanobatch.py: error: argument --device: gpu is no device"),
    # What does not apply to the mode is refused, not ignored, even when it is typed with its default.
    (["--demo", "--quick", "--weights", "gpt2"],
     "nanobatch.py: error: --weights does not apply to --quick, which runs a tiny random model"),
    (["--demo", "--max-new-tokens", "64"], "nanobatch.py: error: --max-new-tokens does not apply to --demo"),
    (["--demo", "--policy", "static"], "nanobatch.py: error: --policy does not apply to --demo"),
    (["--prompt", "Hello", "--quick"], "nanobatch.py: error: --quick does not apply to --prompt"),
    (["--demo", "--requests", "10"], "nanobatch.py: error: unrecognized arguments: --requests 10"),
    # The tools: each takes its own options, and none of another's.
    ((bench, "--arrival-rate", "nan"), "tools/bench.py: error: argument --arrival-rate: must be > 0, got nan"),
    ((bench, "--temperature", "0"), "tools/bench.py: error: unrecognized arguments: --temperature 0"),
    ((bench, "--quiet"), "tools/bench.py: error: unrecognized arguments: --quiet"),
    ((bench, "--svg", "no/such/folder/belt.svg"),
     "tools/bench.py: error: argument --svg: no/such/folder/belt.svg: no such folder"),
    ((bench, "--decode-steps", "--svg", "belt.svg"),
     "tools/bench.py: error: --svg does not apply to --decode-steps, which times its own belts"),
    ((bench, "--decode-steps", "--slots", "4"),
     "tools/bench.py: error: --slots does not apply to --decode-steps, which times its own belts"),
    (["--demo", "--max-len", "0"], "nanobatch.py: error: argument --max-len: must be > 0, got 0"),
    ((belt_svg, "--slots", "4", "belt.svg"), "tools/belt_svg.py: error: the following arguments are required: FILE"),
    ((verify, "--temperature", "0.8"), "tools/verify.py: error: unrecognized arguments: --temperature 0.8"),
    ((belt_svg, "no/such/folder/belt.svg"), "tools/belt_svg.py: error: argument FILE: no/such/folder/belt.svg: "
                                            "no such folder"),
])
def test_cli_refuses_what_it_cannot_do(argv, message, capsys):
    """Flags that make no sense are refused by the parser, before any model is made: its usage
    line, then its error, exit status 2. argv: nanobatch.py's, or (a tool, its own)."""
    main, argv = (argv[0].main, list(argv[1:])) if isinstance(argv, tuple) else (nanobatch.main, argv)
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and err[-1] == message, err


@pytest.mark.parametrize("option, where", [("--bench", "tools/bench.py"), ("--verify", "tools/verify.py"),
                                           ("--svg=belt.svg", "tools/belt_svg.py FILE")])
def test_cli_says_where_the_tools_went(option, where, capsys):
    """--bench, --verify and --svg live in tools/ now: one line says where, exit status 2."""
    with pytest.raises(SystemExit) as exit:
        nanobatch.main(["--demo", option])
    err = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and len(err) == 1 and f"has moved: python {where}" in err[0], err


@pytest.mark.parametrize("argv, message", [
    (["--demo", "--quick", "--max-len", "1"], "max_len must be an int in 2..1024 (the model's block_size), got 1"),
    ((verify, "--quick", "--policy", "static", "--disaggregate"), "disaggregate=True needs policy='continuous'"),
    (["--demo", "--quick", "--slots", "100000"], "a KV cache of 100000 slots x 1024 positions takes 105 GB, but cpu "
                                                 "has 2 GB free: at most 1907 slots fit at max_len=1024"),
])
def test_cli_bad_input_is_one_line(argv, message, capsys, monkeypatch):
    """Input that generate refuses ends in one line, exit status 2, no traceback: a cache too large
    for the memory free (2 GB here, whatever the machine has) too."""
    monkeypatch.setattr(model_py, "available_memory", lambda device: 2_000_000_000)
    main, argv = (argv[0].main, list(argv[1:])) if isinstance(argv, tuple) else (nanobatch.main, argv)
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and len(err) == 1 and f": error: {message}" in err[0], err


@pytest.mark.parametrize("main, mode", [(bench.main, []), (verify.main, []), (nanobatch.main, ["--demo"])],
                         ids=["bench", "verify", "demo"])
def test_cli_missing_checkpoint_is_one_line(main, mode, tmp_path, capsys):
    """A --weights that is not there ends in one line naming it, exit status 2, in every command that
    loads weights."""
    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(SystemExit) as exit:
        main([*mode, "--weights", missing])
    err = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and len(err) == 1 and f": error: {missing}" in err[0], err


@pytest.mark.parametrize("error", [RuntimeError("shapes cannot be multiplied (8x64 and 65x64)"),
                                   ValueError("too many values to unpack (expected 5)")])
def test_cli_a_broken_loop_keeps_its_traceback(monkeypatch, error):
    """An error inside the loop, torch's or Python's, is not turned into one line: the student who
    edited the loop needs the traceback that says where it broke."""
    def broken_forward(self, packed, cache):
        raise error

    monkeypatch.setattr(GPT, "forward_packed", broken_forward)
    with pytest.raises(type(error), match=str(error).split(" (")[0]):
        nanobatch.main(["--demo", "--quick", "--quiet"])


def test_cli_closed_pipe_ends_quietly(tmp_path):
    """`python nanobatch.py --demo --quick | head -3`: the reader goes away after three lines, and the
    demo stops without a word, with the status a shell gives a program stopped by SIGPIPE."""
    process = start_cli(tmp_path, "--demo", "--quick")
    for _ in range(3):
        process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=100) == 141 and stderr == "", stderr


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
@pytest.mark.parametrize("disaggregated", [[], ["--disaggregate"]])
def test_cli_ctrl_c_shows_the_figures_so_far(tmp_path, disaggregated):
    """Ctrl-C a few steps into the demo: exit status 130, and a table of the run up to there, whose
    tokens count the requests still running and whose belt was full (the queue never emptied).
    Disaggregated too: the prefill worker is stopped and joined on the way out."""
    process = start_cli(tmp_path, "--demo", "--quick", *disaggregated)
    n_steps_seen = 0
    while n_steps_seen < 3:
        n_steps_seen += process.stdout.readline().startswith("step ")
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=100)
    assert process.returncode == 130, stderr[-2000:]
    cut = "disaggregated (cut)" if disaggregated else "continuous (cut)"
    assert "interrupted after" in stdout and cut in stdout, stdout[-2000:]
    rows = {line[:24].strip(): line[24:].split() for line in stdout.splitlines()}
    assert int(rows["generated tokens"][-1]) > 0 and int(rows["mean occupancy"][-1].rstrip("%")) >= 90, stdout


# 9) --verify: every answer identical in float64, a broken engine named, the verdict's rule


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


# ---------------------------------------------------------------------------------------------
# 10) The step made visible: the README's worked step, and the page of tools/explore.py
#
# The README works one step through pack_step, number for number; the page draws every step of a real
# run from the engine's own data (each StepReport's PackedStep), never a recomputation. Its rows and
# masks must be what the loop's forward_packed calls received (captured here, in the calling thread
# only: a prefill worker's own calls are not the loop's), its events what the StepReports said; a
# planted broken mask must show in its data; the page must stand alone; and, where Chromium is
# installed, a deep link must open on that step with those rows and cells in the DOM.


def worked_step(c_prompt_len=6):
    """The README's worked step, built by the engine's own plan_step and pack_step: A (slot 0) and B
    (slot 1) decode, C (slot 2) has 3 of its 6 prompt tokens in, D (slot 3) has a one-token prompt,
    the prompt budget is 4. Token ids are made up so that the tens name the request (A = 1..., D = 4...)
    and the units the position."""
    def running(index, slot, prompt, tokens, n_cached, arrival):
        request = Request(prompt, max_new_tokens=10, arrival=arrival)
        return nanobatch.Running(index, request, slot, None, admit_step=0, n_cached=n_cached, tokens=tokens)

    belt = [running(0, 0, [10, 11], [12], n_cached=2, arrival=0),  # A: prompt and first token in but 12, at position 2
            running(1, 1, [20, 21, 22], [23, 24, 25], n_cached=5, arrival=0),  # B: all in but 25, at position 5
            running(2, 2, list(range(30, 30 + c_prompt_len)), [], n_cached=3, arrival=1),  # C: 30..32 went in before
            running(3, 3, [40], [], n_cached=0, arrival=2)]  # D: a one-token prompt, admitted this step
    work = nanobatch.plan_step(belt, prefill_chunk=4)
    return belt, *nanobatch.pack_step(work, [], n_slots=4, device=torch.device("cpu"))


def spaced_bits(mask_row):
    """A mask's row as the README draws it: 1 or 0 per position, a space between."""
    return " ".join(str(int(visible)) for visible in mask_row)


def readme_worked_step(belt, packed, to_sample):
    """The worked step as the README prints it, made from the PackedStep: what the README must hold."""
    M, D = len(packed.tokens), packed.n_one_token
    name = [nanobatch.letter(belt[slot].request_index) for slot in packed.slots.tolist()]  # each row's request

    def line(label, values):
        return f"{label:<11}" + "".join(f"{value:>4}" for value in values)

    (chunk_rows, chunk_slot, chunk_mask), = packed.chunks
    top = [line("row", range(M)), line("request", name), line("tokens", packed.tokens.tolist()),
           line("positions", packed.positions.tolist()), line("slots", packed.slots.tolist()),
           f"n_one_token = {D}: rows 0..{D - 1} attend together; rows {chunk_rows.start}..{chunk_rows.stop - 1},"
           f" a chunk, alone over slot {chunk_slot}",
           f"logit_rows = {packed.logit_rows.tolist()}: the rows sampled, for "
           + ", ".join(nanobatch.letter(run.request_index) for run in to_sample) + ", in that order"]
    S, _, L = packed.one_token_mask.shape
    one_token_slots = packed.slots[:D].tolist()
    left = [f"one_token_mask, (S, 1, L) = ({S}, 1, {L})", f"{'query':<8}{'from':<12}" + " ".join(map(str, range(L)))]
    for slot in range(S):
        source = f"row {one_token_slots.index(slot)} ({name[one_token_slots.index(slot)]})" \
            if slot in one_token_slots else "a dummy"
        left.append(f"slot {slot}  {source:<12}{spaced_bits(packed.one_token_mask[slot, 0])}")
    right = [f"chunks[0]: rows {chunk_rows.start}..{chunk_rows.stop - 1}, slot {chunk_slot}, (T, L) = "
             f"{tuple(chunk_mask.shape)}",
             f"{'row (request, pos)':<20}" + " ".join(map(str, range(chunk_mask.size(-1))))]
    for row, mask_row in zip(range(chunk_rows.start, chunk_rows.stop), chunk_mask):
        right.append(f"row {row} ({name[row]}, {int(packed.positions[row])})        {spaced_bits(mask_row)}")
    right += [""] * (len(left) - len(right))
    return "\n".join(top + [""] + [f"{a:<42}{b}".rstrip() for a, b in zip(left, right)])


def test_readme_worked_step():
    """The README's worked step is what plan_step and pack_step make of that belt, number for number,
    the rows sampled in the order of the runs due a token; and so is its variant, C with a prompt of 8,
    which takes the whole budget and leaves D out of the step."""
    belt, packed, to_sample = worked_step()
    assert packed.tokens.tolist() == [12, 25, 40, 33, 34, 35]
    assert packed.n_one_token == 3 and packed.logit_rows.tolist() == [0, 1, 2, 5]
    assert [run.request_index for run in to_sample] == [0, 1, 3, 2]
    text = readme_worked_step(belt, packed, to_sample)
    readme = (REPO / "README.md").read_text()
    assert text in readme, "the README's worked step differs from what pack_step makes; it should read:\n" + text
    _, packed, to_sample = worked_step(c_prompt_len=8)
    variant = (f"rows `{packed.tokens.tolist()}`, `n_one_token = {packed.n_one_token}`, dummies for slots 2 and 3, "
               f"`logit_rows = {packed.logit_rows.tolist()}`")
    assert variant in " ".join(readme.split()), variant  # the README's lines wrap anywhere
    assert packed.slots[:packed.n_one_token].tolist() == [0, 1] and [run.request_index for run in to_sample] == [0, 1]


RUNS = {  # name -> generate's options: chunks beside one-token rows; static's padding; the worker's steps
    "continuous": dict(n_slots=3, policy="continuous", prefill_chunk=5),
    "static": dict(n_slots=3, policy="static", prefill_chunk=5),
    "disaggregated": dict(n_slots=3, policy="continuous", prefill_chunk=None, disaggregate=True),
}


def on_host(packed):
    """A PackedStep copied to the CPU now, so that what is compared is what the forward received."""
    return PackedStep(packed.tokens.cpu().clone(), packed.positions.cpu().clone(), packed.slots.cpu().clone(),
                      packed.n_one_token, packed.one_token_mask.cpu().clone(),
                      [(rows, slot, mask.cpu().clone()) for rows, slot, mask in packed.chunks],
                      packed.logit_rows.cpu().clone())


FORWARD_PACKED = model_py.GPT.forward_packed  # the real one, before any test wraps it


def record_forwards(monkeypatch):
    """model.GPT.forward_packed, recording the PackedStep of every call made in the main thread -> that list."""
    calls = []

    def recording(self, step, cache):
        if threading.current_thread() is threading.main_thread():  # the loop's; the worker's are its own
            calls.append(on_host(step))
        return FORWARD_PACKED(self, step, cache)

    monkeypatch.setattr(model_py.GPT, "forward_packed", recording)
    return calls


def explored(monkeypatch, name):
    """A run of RUNS[name] on a tiny model, its forward calls recorded -> (its page data, reports, calls)."""
    options = RUNS[name]
    requests, reports = random_workload(seed=3, n_requests=7), []
    calls = record_forwards(monkeypatch)
    completions = generate(tiny_gpt(), requests, max_len=MAX_LEN, eos_id=None, on_step=reports.append, **options)
    run = (name, options["n_slots"], options["policy"], options["prefill_chunk"], options.get("disaggregate", False))
    return explore.run_data(run, requests, completions, reports), reports, calls


def bits(mask):
    """(..., L) bool -> a string of 0/1 per row of L: the contract's "visible", worked out here on its own."""
    return ["".join(str(int(visible)) for visible in row) for row in mask.reshape(-1, mask.size(-1)).tolist()]


def check_against_forwards(data, reports, calls):
    """Step by step: a step with a forward has exactly that call's rows and masks; one without has none."""
    forward_steps = [(step, report) for step, report in zip(data["steps"], reports) if report.packed is not None]
    assert len(forward_steps) == len(calls), f"{len(forward_steps)} steps with a forward, {len(calls)} calls"
    for step in data["steps"]:
        if not any(step is s for s, _ in forward_steps):
            assert step["rows"] == [] and step["masks"] == [], f"step {step['step']}: rows without a forward"
    for (step, report), call in zip(forward_steps, calls):
        rows, where = step["rows"], f"step {step['step']}"
        assert [row["slot"] for row in rows] == call.slots.tolist(), where
        assert [row["position"] for row in rows] == call.positions.tolist(), where
        assert [row["token"] for row in rows] == call.tokens.tolist(), where
        n_sampled = len(report.sampled) - len(report.handed_over)  # handovers come after the forward's rows
        sampled_rows, padding_rows = call.logit_rows[:n_sampled].tolist(), call.logit_rows[n_sampled:].tolist()
        assert [i for i, row in enumerate(rows) if row["sampled"]] == sorted(sampled_rows), where
        assert [rows[i]["request"] for i in sampled_rows] == report.sampled[:n_sampled], where
        assert [i for i, row in enumerate(rows) if row["request"] is None] == sorted(padding_rows), where
        assert all(row["kind"] == "padding" for row in rows if row["request"] is None), where
        D, S = call.n_one_token, call.one_token_mask.size(0)
        want = []
        if D:  # a forward with no one-token rows has no one-token mask
            row_of_slot = {slot: i for i, slot in enumerate(call.slots[:D].tolist())}
            want.append(dict(slot=None, rows=[row_of_slot.get(s) for s in range(S)], visible=bits(call.one_token_mask)))
        want += [dict(slot=slot, rows=list(range(chunk_rows.start, chunk_rows.stop)), visible=bits(mask))
                 for chunk_rows, slot, mask in call.chunks]
        got = [dict(slot=mask["slot"], rows=mask["rows"], visible=mask["visible"]) for mask in step["masks"]]
        assert got == want, where


@pytest.fixture(scope="module")
def explored_runs():
    """Each of RUNS once, for the tests below -> {name: (its page data, reports, calls)}."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {name: explored(monkeypatch, name) for name in RUNS}


@pytest.mark.parametrize("name", RUNS)
def test_page_rows_and_masks_are_the_forwards(explored_runs, name):
    """Every step's rows and masks in the page's data equal the PackedStep the loop's forward received;
    a static run has padding rows, a disaggregated one steps with no forward."""
    data, reports, calls = explored_runs[name]
    check_against_forwards(data, reports, calls)
    kinds = {row["kind"] for step in data["steps"] for row in step["rows"]}
    if name == "static":
        assert "padding" in kinds
    if name == "disaggregated":
        assert any(not step["rows"] for step in data["steps"]), "the loop never waited for the worker"
        assert "chunk" not in kinds, "the loop fed a prompt chunk itself"
    if name == "continuous":
        assert any(step["n_one_token"] and any(row["kind"] == "chunk" for row in step["rows"])
                   for step in data["steps"]), "no chunk went in beside one-token rows"


def test_rows_past_the_cut_are_chunks_of_one(monkeypatch):
    """With attention calls made free, long one-token rows attend alone: each a chunk of one row."""
    monkeypatch.setattr(model_py, "CALL_COST_IN_KEYS", {"cpu": 0, "gpu": 0})
    data, reports, calls = explored(monkeypatch, "continuous")
    check_against_forwards(data, reports, calls)
    alone = [mask for step in data["steps"] for mask in step["masks"]
             if mask["slot"] is not None and step["rows"][mask["rows"][0]]["kind"] == "alone past the cut"]
    assert alone, "no row attended alone past the cut"
    assert all(len(mask["rows"]) == 1 and len(mask["visible"]) == 1 for mask in alone)


@pytest.mark.parametrize("name", RUNS)
def test_page_events_are_the_step_reports(explored_runs, name):
    """Every step's events and counts in the page's data are its StepReport's."""
    data, reports, _ = explored_runs[name]
    assert len(data["steps"]) == len(reports)
    for step, report in zip(data["steps"], reports):
        assert (step["step"], step["belt"]) == (report.step, report.belt)
        assert (step["admitted"], step["handed_over"]) == (report.admitted, report.handed_over)
        assert step["finished"] == [[i, c.finish_reason, len(c.tokens)] for i, c in report.finished]
        assert (step["n_waiting"], step["n_running"], step["n_prefilling"], step["n_prompt_tokens"]) == \
               (report.n_waiting, report.n_running, report.n_prefilling, report.n_prompt_tokens)
        assert len(step["waiting"]) == report.n_waiting, f"step {report.step}: the queue the page names"
        assert (step["model_s"], step["step_s"]) == (pytest.approx(report.model_s, abs=1e-5),
                                                     pytest.approx(report.step_s, abs=1e-5))


def leaks(data):
    """(step, mask slot, query row) wherever a query may see a position past its own."""
    return [(step["step"], mask["slot"], r) for step in data["steps"] for mask in step["masks"]
            for r, visible in zip(mask["rows"], mask["visible"])
            if r is not None and "1" in visible[step["rows"][r]["position"] + 1:]]


def sees_one_past_its_own(positions, L):
    """Broken on purpose: a token may see the position after its own too."""
    return torch.arange(L, device=positions.device)[None, None, :] <= positions[:, :, None] + 1  # (B, T, L)


def test_a_broken_mask_shows_in_the_page(explored_runs, monkeypatch):
    """The page draws the engine's masks, not its own: a mask that lets a row see the position after
    its own shows as a 1 past the query's position; the engine's own never does."""
    assert all(leaks(data) == [] for data, _, _ in explored_runs.values())
    monkeypatch.setattr(nanobatch, "attention_mask", sees_one_past_its_own)
    broken, reports, calls = explored(monkeypatch, "continuous")
    check_against_forwards(broken, reports, calls)
    assert leaks(broken), "the broken mask left no trace in the page's data"


# ---------------------------------------------------------------------------------------------
# The page itself: the --quick demo, written once for these tests


@pytest.fixture(scope="module")
def quick_page(tmp_path_factory):
    """tools/explore.py FILE --quick --quiet, its forwards recorded -> (the page's text, its data, calls, Shown)."""
    path = tmp_path_factory.mktemp("explore") / "belt.html"
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = record_forwards(monkeypatch)
        shown = explore.main([str(path), "--quick", "--quiet"])
    page = path.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="nanobatch-run">(.*?)</script>', page, re.S)[1])
    return path, page, data, calls, shown


def test_quick_page_data_are_the_forwards(quick_page):
    """The data the page carries (parsed back out of it) are the forwards of both demo runs, in order."""
    _, _, data, calls, shown = quick_page
    assert [run["name"] for run in data["runs"]] == ["continuous", "static"]
    for run in data["runs"]:
        n_calls = sum(report.packed is not None for report in shown.reports[run["name"]])
        check_against_forwards(run, shown.reports[run["name"]], calls[:n_calls])
        calls = calls[n_calls:]
    assert calls == []


def test_the_page_stands_alone(quick_page):
    """One file: no reference to anything outside it, and under 2 MB."""
    _, page, _, _, _ = quick_page
    assert len(page.encode()) < 2e6
    outside_the_data = re.sub(r'<script type="application/json".*?</script>', "", page, flags=re.S)
    assert not re.search(r"\b(src|href)\s*=", outside_the_data)
    assert not re.search(r"<(link|iframe|img|object|embed)\b|@import|https?:", outside_the_data, re.I)
    assert all(url == "url(#hatch)" for url in re.findall(r"url\([^)]*\)", outside_the_data))


class DrawnStep(html.parser.HTMLParser):
    """What a dumped DOM shows: #shown-step's text, each .row's (slot, position), each .cell's data-visible
    (the legend's sample cells have none)."""
    def __init__(self):
        super().__init__()
        self.step_text, self.in_step, self.rows, self.cells = "", False, [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        self.in_step = attrs.get("id") == "shown-step"
        if "row" in classes:
            self.rows.append((int(attrs["data-slot"]), int(attrs["data-position"])))
        if "cell" in classes and "data-visible" in attrs:
            self.cells.append(attrs["data-visible"])

    def handle_data(self, data):
        if self.in_step:
            self.step_text += data

    def handle_endtag(self, tag):
        self.in_step = False


def opened(path, link):
    """Headless Chromium at FILE#link -> (the DOM as text, what it shows: a DrawnStep); without Chromium, a skip."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no Chromium here to open the page in (Debian: apt-get install chromium)")
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          f"{path.as_uri()}#{link}"], capture_output=True, text=True, timeout=30, check=True).stdout
    shown = DrawnStep()
    shown.feed(dom)
    return dom, shown


@pytest.mark.parametrize("run_name, step_number", [("continuous", 5), ("static", 12)])
def test_a_deep_link_opens_on_its_step(quick_page, run_name, step_number):
    """Headless Chromium at FILE#run=NAME&step=N shows step N: its number, its rows, its mask cells."""
    path, _, data, _, _ = quick_page
    _, shown = opened(path, f"run={run_name}&step={step_number}")
    step = next(step for run in data["runs"] if run["name"] == run_name
                for step in run["steps"] if step["step"] == step_number)
    assert shown.step_text.strip() == str(step_number)
    assert shown.rows == [(row["slot"], row["position"]) for row in step["rows"]]
    assert "".join(shown.cells) == "".join("".join(mask["visible"]) for mask in step["masks"])


FOLLOW_LINKS = """<script>
// Each link as if typed into the address bar (the page reads a link on load and on hashchange, with
// one function): what it then shows, into the DOM for the test to read.
const followed = LINKS.map((link) => {
  history.replaceState(null, "", "#" + link);
  window.dispatchEvent(new HashChangeEvent("hashchange"));
  const notice = document.querySelector("#notice");
  return {step: document.querySelector("#shown-step").textContent.trim(), notice: notice.hidden ? "" : notice.textContent,
          rows: [...document.querySelectorAll("#packed .row")].map((row) => [+row.dataset.slot, +row.dataset.position]),
          cells: document.querySelectorAll(".cell[data-visible]").length, hash: location.hash,
          info: document.querySelector("#step-info").textContent};
});
document.body.dataset.followed = JSON.stringify(followed);
</script>
</body>"""


def test_deep_links_that_name_nothing_here_or_ask_a_question(quick_page, tmp_path):
    """A run not in the page opens the first run with a one-line notice naming the runs there are; a
    step that is not a number opens the first step, one past the end the last; &predict=1 opens the
    step as a question: no rows, no cells, no figure that follows from its packing, the link kept."""
    _, page, data, _, _ = quick_page
    links = ["run=Static&step=12", "run=static&step=abc", "run=static&step=100000", "run=continuous&step=12&predict=1"]
    following = tmp_path / "following.html"
    following.write_text(page.replace("</body>", FOLLOW_LINKS.replace("LINKS", json.dumps(links))))
    dom, _ = opened(following, "")
    followed = json.loads(html.unescape(re.search(r'data-followed="([^"]*)"', dom)[1]))
    steps = {run["name"]: run["steps"] for run in data["runs"]}
    wanted = [steps["continuous"][12], steps["static"][0], steps["static"][-1]]  # continuous: the first run
    for link, got, step in zip(links, followed, wanted):
        assert got["step"] == str(step["step"]), link
        assert got["rows"] == [[row["slot"], row["position"]] for row in step["rows"]], link
    assert followed[0]["notice"] == 'No run named "Static" here; the runs are: continuous, static. Showing continuous.'
    assert followed[1]["notice"] == followed[2]["notice"] == ""
    question = followed[3]
    assert question["step"] == "12" and question["rows"] == [] and question["cells"] == 0
    assert question["hash"] == "#run=continuous&step=12&predict=1" and "M = ? rows" in dom
    assert "make a token" not in question["info"] and "prompt tokens" not in question["info"]


PRESS_KEYS = """<script>
function press(key) { window.dispatchEvent(new KeyboardEvent("keydown", {key})); }
function shown() {  // the rows drawn, the address, and whether a figure that follows from the packing shows
  const text = document.getElementById("step-info").textContent + document.getElementById("packed-title").textContent;
  return document.querySelectorAll("#packed .row").length + " " + location.hash + " " +
    /make a token|prompt tokens|padding row|dumm|M = [0-9]/.test(text);
}
press("p");  // predict on: the step shown becomes the question
document.body.dataset.asked = shown();
press("ArrowRight");  // one step on: its rows, and the figures that give them away, hidden
document.body.dataset.hidden = shown();
press("Enter");  // revealed
document.body.dataset.revealed = shown();
</script>
</body>"""


def test_predict_hides_the_next_step_until_revealed(quick_page, tmp_path):
    """At continuous step 5, the key p (predict) hides step 5's packed rows and every figure that follows
    from them (M, the counts, prompt tokens spent, padding, dummies); the right arrow: step 6, as hidden,
    its address (predict kept) in the hash; Enter shows them all."""
    _, page, data, _, _ = quick_page
    pressed = tmp_path / "pressed.html"
    pressed.write_text(page.replace("</body>", PRESS_KEYS))
    dom, _ = opened(pressed, "run=continuous&step=5")
    n_rows = len(next(step for step in data["runs"][0]["steps"] if step["step"] == 6)["rows"])
    assert 'data-asked="0 #run=continuous&amp;step=5&amp;predict=1 false"' in dom
    assert 'data-hidden="0 #run=continuous&amp;step=6&amp;predict=1 false"' in dom
    assert f'data-revealed="{n_rows} #run=continuous&amp;step=6&amp;predict=1 true"' in dom


def test_rows_carry_the_token_text_where_a_tokenizer_is_loaded(explored_runs):
    """With a tokenizer, each row's text is its token decoded alone; without one, the row has no text."""
    data, reports, _ = explored_runs["continuous"]
    report = next(report for report in reports if report.packed is not None)
    tokenizer = SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")  # a stand-in: what explore calls, and nothing else
    rows, _ = explore.rows_and_masks(report.packed, report.step, explore.occupants([]), 0, tokenizer)
    assert [row["text"] for row in rows] == [f"<{token}>" for token in report.packed.tokens.tolist()]
    assert all("text" not in row for step in data["steps"] for row in step["rows"])


# ---------------------------------------------------------------------------------------------
# 11) The figures a reader reads, pinned against schedules worked by hand and torch's own draw
#
# The belt line, the time to first token, a seed's draws and a bfloat16 checkpoint: each is checked
# against a statement made independently of the code under test, so that the engine and its
# reference cannot agree on a wrong figure. Each schedule below is worked out by hand in its docstring.


def belt_lines(reports, capsys):
    """The lines print_step prints for these reports, as the demo shows them."""
    capsys.readouterr()  # whatever came before
    for report in reports:
        nanobatch.print_step(report)
    return capsys.readouterr().out.splitlines()


def test_time_to_first_token_by_hand(gpt, monkeypatch):
    """A clock that moves only while the model runs, 1 s a forward: then every time is a count of
    forwards, worked out by hand. One slot, prompts 2 tokens a step. A (3 prompt tokens, 2 new,
    arrives at step 0) takes steps 0 and 1 to go in: its first token at the end of step 1, t = 2,
    its second at t = 3. B (1 prompt token, 3 new) arrives at step 1 (t = 1) and waits for the slot
    until step 3: its tokens at t = 4, 5, 6. Time to first token is from the start of the arrival
    step to the FIRST token (A 2 s, B 3 s), latency to the last (A 3 s, B 5 s)."""
    clock = SimpleNamespace(now=0.0)
    forward_packed = GPT.forward_packed

    def one_second_forward(model, step, cache):
        clock.now += 1.0
        return forward_packed(model, step, cache)

    monkeypatch.setattr(GPT, "forward_packed", one_second_forward)
    monkeypatch.setattr(nanobatch, "time", SimpleNamespace(perf_counter=lambda: clock.now))  # the engine's clock only
    requests = [Request([1, 2, 3], 2, arrival=0), Request([4], 3, arrival=1)]
    reports = []
    a, b = generate(gpt, requests, n_slots=1, max_len=MAX_LEN, eos_id=None, prefill_chunk=2, on_step=reports.append)
    assert [(c.admit_step, c.first_token_step, c.finish_step) for c in (a, b)] == [(0, 1, 2), (3, 3, 5)]
    assert (a.token_times_s, a.ttft_s, a.latency_s) == ([2.0, 3.0], 2.0, 3.0), a
    assert (b.token_times_s, b.ttft_s, b.latency_s) == ([3.0, 4.0, 5.0], 3.0, 5.0), b
    assert [(r.model_s, r.step_s) for r in reports] == [(1.0, 1.0)] * 6, "a step is its one forward here"


def test_waiting_counts_arrived_requests_only(gpt, capsys):
    """Two slots, whole prompts. A (3 new) and B (1 new) arrive at step 0 and take both slots; B
    is done at once. C (2 new) and D (1 new) arrive at step 1: C takes B's slot, D waits (1) until
    A and C finish at step 2, then takes slot 0 at step 3. E arrives at step 6: the belt is empty
    at step 4, so the clock jumps to 6. Not yet arrived is not waiting: 0 at step 0, where C, D and
    E are still to come."""
    requests = [Request([1], 3, arrival=0), Request([2], 1, arrival=0), Request([3], 2, arrival=1),
                Request([4], 1, arrival=1), Request([5], 1, arrival=6)]
    reports = []
    generate(gpt, requests, n_slots=2, max_len=MAX_LEN, eos_id=None, on_step=reports.append)
    got = [(r.step, r.belt, r.n_waiting) for r in reports]
    assert got == [(0, "AB", 0), (1, "AC", 1), (2, "AC", 1), (3, "D.", 0), (6, "E.", 0)], got
    assert belt_lines(reports, capsys) == [
        "step    0 |AB|  2/2 waiting   0  +A +B -B(length,1)",
        "step    1 |AC|  2/2 waiting   1  +C",
        "step    2 |AC|  2/2 waiting   1  -A(length,3) -C(length,2)",
        "step    3 |D.|  1/2 waiting   0  +D -D(length,1)",
        "step    6 |E.|  1/2 waiting   0  +E -E(length,1)"]


def test_occupancy_counts_requests_that_made_a_token(gpt, capsys):
    """The belt line's k/S: k requests made a token this step, of S slots; a prompt still going in
    ('~') made none. Two slots, at most 2 prompt tokens a step, first come first served. A (prompt
    of 1, 3 new) and B (prompt of 5, 2 new) arrive at step 0. Step 0: A's prompt goes in and A makes
    its first token, 1 of B's 5 goes in: 1/2. Step 1: A's second token, 2 more of B's: 1/2. Step 2:
    A's last token, B's last 2 go in and B makes its first: 2/2. Step 3: B's last token: 1/2."""
    requests = [Request([1], 3), Request([2, 3, 4, 5, 6], 2)]
    reports = []
    generate(gpt, requests, n_slots=2, max_len=MAX_LEN, eos_id=None, prefill_chunk=2, on_step=reports.append)
    got = [(r.step, r.belt, r.n_running, r.n_prefilling, r.n_prompt_tokens) for r in reports]
    assert got == [(0, "A~", 1, 1, 2), (1, "A~", 1, 1, 2), (2, "AB", 2, 0, 2), (3, ".B", 1, 0, 0)], got
    assert belt_lines(reports, capsys) == [
        "step    0 |A~|  1/2 waiting   0  +A +B",
        "step    1 |A~|  1/2 waiting   0",
        "step    2 |AB|  2/2 waiting   0  -A(length,3)",
        "step    3 |.B|  1/2 waiting   0  -B(length,2)"]


def test_a_seed_draws_what_torch_multinomial_draws(gpt):
    """The seed rule, stated with torch's own sampler: a request with seed s draws its tokens as
    torch.multinomial(probs, 1) does with one torch.Generator seeded s, draw after draw, probs the
    softmax of the plain forward's logits over its text so far, divided by its temperature. Three
    requests batched in three slots, each with its own seed (a large one too): batch-mates never
    move a request's draws. (A seed of s + 1 draws other tokens: at temperature 1.5 over 512 ids the
    chance that 4 draws agree is nil.)"""
    requests = [Request([7, 8, 9], 4, temperature=1.5, seed=seed) for seed in (0, 1, 2**40 + 3)]
    got = generate(gpt, requests, n_slots=3, max_len=MAX_LEN, eos_id=None)
    with torch.no_grad():
        for request, completion in zip(requests, got):
            generator, want = torch.Generator().manual_seed(request.seed), []
            for _ in range(request.max_new_tokens):
                logits = gpt(torch.tensor([request.prompt + want]))[0, -1]  # (V,)
                probs = torch.softmax(logits / request.temperature, dim=-1)
                want.append(int(torch.multinomial(probs, 1, generator=generator)))
            assert completion.tokens == want, f"seed {request.seed}: drew {completion.tokens}, torch draws {want}"


def test_load_a_bfloat16_safetensors_checkpoint(tmp_path):
    """Fine-tuned GPT-2s are often saved in bfloat16. Such a .safetensors file loads into a float32
    model with every weight the very bfloat16 value (bfloat16 to float32 is exact). Its bits read as
    float16 instead would be other numbers altogether."""
    saved = tiny_gpt(dtype=torch.bfloat16, seed=1, n_head=2, n_embd=128)
    header = write_safetensors(tmp_path / "model.safetensors", hf_tensors(saved, buffers=False))
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}
    loaded = GPT.from_pretrained(tmp_path / "model.safetensors")
    assert loaded.config == saved.config
    for (name, got), want in zip(loaded.named_parameters(), saved.parameters()):
        assert got.dtype == torch.float32 and torch.equal(got, want.float()), f"{name}: {worst(got, want.float())}"


# ---------------------------------------------------------------------------------------------
# 12) The labs of docs/labs.md, each pinned by a test whose name holds `lab`
#
#     python -m pytest -q -k lab        (every lab's claim, checked on main; seconds each)
#
# A lab's change is read from the lab's own ```diff block and applied here, to the source of the one
# function it touches, never to the files: so the page and its test cannot drift apart, and a diff
# that no longer applies fails its lab by name. Each test then checks what its lab says happens: the
# tests it names fail (called in this process with the change applied), or the figures move as
# stated, in steps and tokens wherever the claim allows; the timing claims compare runs made in one
# process, with a wide margin. The labs' excerpts are checked line by line against what their
# commands print, where the line does not hold a time.

LABS = REPO / "docs" / "labs.md"
TIMELESS_ROWS = ("steps", "generated tokens", "mean occupancy", "occupancy while queued", "latency P50/P99 (steps)",
                 "TTFT P50/P99 (steps)")  # the summary's rows that hold no time: the same in every run


# ---------------------------------------------------------------------------------------------
# Reading docs/labs.md: a lab's section, its diffs, its commands, its excerpts


def lab(number):
    """Lab `number`'s section of docs/labs.md: from its heading to the next heading of its level."""
    match = re.search(rf"^## Lab {number}\. .*?(?=^## |\Z)", LABS.read_text(), re.M | re.S)
    assert match, f"docs/labs.md has no '## Lab {number}. ...'"
    return match.group(0)


def diffs(section):
    """Each ```diff block of a lab -> (the file it changes, its lines before, its lines after): a
    line marked '-' is before only, '+' after only, ' ' (context) both."""
    found = []
    for block in re.findall(r"```diff\n(.*?)```", section, re.S):
        lines = block.splitlines()
        assert lines[0].startswith("--- a/") and lines[1].startswith("+++ b/"), f"no file header: {block}"
        body = lines[2:]
        assert all(line[:1] in " -+" for line in body), f"a line neither ' ', '-' nor '+': {block}"
        before = "".join(line[1:] + "\n" for line in body if line[:1] in " -")
        after = "".join(line[1:] + "\n" for line in body if line[:1] in " +")
        found.append((lines[1][len("+++ b/"):], before, after))
    return found


def functions_of(module):
    """(owner, name, function) for every function defined in module, methods of its classes included."""
    for name, value in vars(module).items():
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            yield module, name, value
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            for method_name, method in vars(value).items():
                if inspect.isfunction(method):
                    yield value, method_name, method


def source_of(function):
    """function's source, or '' for one made at run time (a dataclass's __init__, say)."""
    try:
        return inspect.getsource(function)
    except OSError:
        return ""


def apply_lab(monkeypatch, section, which=0):
    """A lab's diff applied, as a student applies it, to this process only: the one function whose
    source holds the diff's lines is compiled again with them changed, in its module's namespace, and
    monkeypatched in, where its module and this file hold it -> its name."""
    path, before, after = diffs(section)[which]
    module = {"nanobatch.py": nanobatch, "model.py": model_py}[path]
    assert (REPO / path).read_text().count(before) == 1, f"the lab's diff no longer applies to {path}:\n{before}"
    [(owner, name, function)] = [found for found in functions_of(module) if before in source_of(found[2])]
    source = textwrap.dedent(inspect.getsource(function).replace(before, after))
    defined = {}
    exec(compile(source, f"<{path}, {name}, as the lab changes it>", "exec"), vars(module), defined)
    for holder in (owner, sys.modules[__name__]) if owner is module else (owner,):
        if getattr(holder, name, None) is function:
            monkeypatch.setattr(holder, name, defined[name])
    return name


def commands(section):
    """The commands of a lab's ```bash blocks, each as its argv up to a pipe: a line, or the lines
    that a quoted argument spans (python -c "...")."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        pending = ""
        for line in block.splitlines():
            pending += line + "\n"
            try:
                argv = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the argument goes on on the next line
                continue
            if argv:
                found.append(argv[:argv.index("|")] if "|" in argv else argv)
            pending = ""
        assert not pending, f"a quote left open in:\n{block}"
    return found


def excerpt_lines(section):
    """The lines of a lab's ```text excerpts that hold no time: belt lines and the summary's timeless rows."""
    lines = [line for block in re.findall(r"```text\n(.*?)```", section, re.S) for line in block.splitlines()]
    return [line for line in lines if line.startswith("step ") or line.startswith(TIMELESS_ROWS)]


def check_excerpt(section, printed, width=None):
    """Every timeless line of the lab's excerpts is a line its command printed (its first `width`
    characters: the columns that hold no time)."""
    lines = {line[:width] for line in printed.splitlines()}
    missing = [line for line in excerpt_lines(section) if line[:width] not in lines]
    assert not missing, "lines of the lab's excerpt that the run did not print:\n" + "\n".join(missing)


def demo(*options):
    """nanobatch.py --demo --quick, in this process -> (what it ran, what it printed)."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        shown = nanobatch.main(["--demo", "--quick", *options])
    return shown, printed.getvalue()


def ttft_steps(shown, name, i):
    return shown.completions[name][i].first_token_step - shown.requests[i].arrival + 1


def workload_for(model, sampled):
    """test_nanobatch's `workload` fixture, for a call outside pytest's fixtures: the requests, an
    eos_id the model emits mid-answer, and the reference's answers."""
    requests = random_workload(seed=9, sampled=sampled)
    no_eos = nanobatch.generate_sequential(model, requests, max_len=MAX_LEN, eos_id=None)
    eos_id = next(c.tokens[k] for c in no_eos for k in range(1, len(c.tokens)) if c.tokens[k] not in c.tokens[:k])
    return requests, eos_id, nanobatch.generate_sequential(model, requests, max_len=MAX_LEN, eos_id=eos_id)


def matches_sequential(model, monkeypatch, n_slots, policy="continuous", prefill_chunk=None, sampled=False):
    """Does test_generate_matches_sequential pass on this case (its cut 'by cost')?"""
    try:
        test_generate_matches_sequential(model, workload_for(model, sampled), n_slots, policy, prefill_chunk,
                                               "by cost", monkeypatch)
    except AssertionError:
        return False
    return True


def recorded_masks(model, requests, n_slots):
    """Every mask the forwards of a run attended under, as the page draws them (from StepReport.packed)."""
    reports = []
    nanobatch.generate(model, requests, n_slots=n_slots, max_len=MAX_LEN, eos_id=None, on_step=reports.append)
    return [[report.packed.one_token_mask.tolist()] + [mask.tolist() for _, _, mask in report.packed.chunks]
            for report in reports]


@pytest.fixture(scope="module")
def main_demo():
    """The quick demo as main runs it, once: what it ran and what it printed."""
    return demo()


def test_lab_commands_parse(monkeypatch):
    """Every command the labs give is one a fresh clone takes: nanobatch.py's and tools/bench.py's
    options parse (parsed only, not run), tools/explore.py takes the demo's, each -k selection names
    tests of the suite, and the page's deep links are the form tools/explore.py prints."""
    text = LABS.read_text()
    parsed = []
    monkeypatch.setattr(nanobatch, "run_cli", lambda run, args: parsed.append(args))
    suite_text = Path(__file__).read_text()
    for number in range(1, 9):
        for argv in commands(lab(number)):
            if argv[:2] == ["python", "nanobatch.py"]:
                nanobatch.main(argv[2:])
            elif argv[:2] == ["python", "tools/bench.py"]:
                bench.main(argv[2:])
            elif argv[:2] == ["python", "tools/explore.py"]:
                assert (REPO / "tools" / "explore.py").is_file()
                nanobatch.main(["--demo", *argv[3:]])  # FILE, then the options of --demo
            elif argv[:4] == ["python", "-m", "pytest", "-q"]:
                selection = argv[argv.index("-k") + 1]
                for word in set(re.findall(r"\w+", selection)) - {"and", "or", "not"}:
                    assert word in suite_text, f"lab {number}: -k {selection!r}: no test of the suite holds {word!r}"
            elif argv[:2] == ["python", "-c"]:
                compile(argv[2], f"lab {number}'s python -c", "exec")
            elif argv[0] != "git":
                raise AssertionError(f"lab {number}: a command these checks do not know: {argv}")
        assert "**Predict.**" in lab(number) and "**Why.**" in lab(number), f"lab {number} lacks its parts"
    assert parsed, "no command of nanobatch.py or tools/bench.py was parsed"
    assert len(text.splitlines()) <= 300, "docs/labs.md is over 300 lines"
    for link in re.findall(r"file:///tmp/belt\.html#[^`\s]+", text):
        assert re.fullmatch(r"file:///tmp/belt\.html#run=(continuous|static)&step=\d+", link), link


# ---------------------------------------------------------------------------------------------
# Lab 1: read the belt


def test_lab_1_read_the_belt(main_demo):
    """The belt's excerpt is the demo's; L takes F's slot the step after F's last token, and its
    37-token prompt goes in over two steps (32, the budget, then 5); I, admitted into slot 0 at
    step 2, waits for a share of the budget until step 5; step 8 packs 7 one-token rows and L's
    first 32 tokens, 39 rows."""
    shown, printed = main_demo
    check_excerpt(lab(1), printed)
    completions, reports = shown.completions["continuous"], shown.reports["continuous"]
    F, I, L = (ord(name) - ord("A") for name in "FIL")
    assert (completions[F].slot, completions[F].finish_step) == (5, 7)
    assert (completions[L].slot, completions[L].admit_step, completions[L].first_token_step) == (5, 8, 9)
    assert len(shown.requests[L].prompt) == 37 and nanobatch.DEMO_PREFILL_CHUNK == 32
    assert (completions[I].slot, completions[I].admit_step, completions[I].first_token_step) == (0, 2, 6)
    into_slot_0 = [[rows.stop - rows.start for rows, slot, _ in reports[step].packed.chunks if slot == 0]
                   for step in range(2, 7)]
    assert into_slot_0 == [[], [], [], [17], [4]], "I's prompt: nothing at steps 2-4, 17 tokens at 5, 4 at 6"
    step_8 = reports[8].packed
    assert step_8.n_one_token == 7 and step_8.tokens.numel() == 39
    assert [(rows.stop - rows.start, slot) for rows, slot, _ in step_8.chunks] == [(32, 5)]


# ---------------------------------------------------------------------------------------------
# Lab 2: static from continuous


def test_lab_2_static_from_continuous(monkeypatch, main_demo):
    """Static refilling once half the belt is free: static's 198 steps become 125 and its median
    TTFT 45 steps 19; continuous, which never reads the changed condition, stays at 111 and 10."""
    before, _ = main_demo
    assert [before.summaries[name]["steps"] for name in ("continuous", "static")] == [111, 198]
    assert [before.summaries[name]["TTFT P50/P99 (steps)"] for name in ("continuous", "static")] == [(10, 16),
                                                                                                   (45, 106)]
    assert apply_lab(monkeypatch, lab(2)) == "slots_to_fill"
    after, printed = demo("--quiet")
    check_excerpt(lab(2), printed)
    assert [after.summaries[name]["steps"] for name in ("continuous", "static")] == [111, 125]
    assert [after.summaries[name]["TTFT P50/P99 (steps)"] for name in ("continuous", "static")] == [(10, 16),
                                                                                                  (19, 28)]


# ---------------------------------------------------------------------------------------------
# Lab 3: the mask


def test_lab_3a_the_mask_sees_past_its_position(monkeypatch):
    """A token that may see one position past its own: the equivalence fails wherever the call's L
    reaches past a row (3 slots), and holds where every row attends alone over exactly its own
    prefix (one slot, a token a step); the teeth test's control fails; the masks the forward ran
    under, which the page draws, change."""
    gpt, rng_requests = tiny_gpt(), random_workload(seed=2, n_requests=8)
    masks_before = recorded_masks(gpt, rng_requests, n_slots=3)
    assert apply_lab(monkeypatch, lab(3), which=0) == "attention_mask"
    assert not matches_sequential(gpt, monkeypatch, n_slots=3)
    assert matches_sequential(gpt, monkeypatch, n_slots=1, prefill_chunk=1)
    with pytest.raises(AssertionError):
        test_a_broken_mask_is_caught(gpt, monkeypatch, decode_sees_everything)
    assert recorded_masks(gpt, rng_requests, n_slots=3) != masks_before, "the page's grid would not show it"
    # The page at the demo's step 8: a 1 past each row's own position, but for E's (39, the last of
    # the one-token call's L = 40) and the last of L's chunk (31 of 32).
    step_8 = demo("--quiet")[0].reports["continuous"][8]
    D, packed = step_8.packed.n_one_token, step_8.packed
    sees_past = {slot: bool(packed.one_token_mask[slot, 0, position + 1:].any())
                 for slot, position in zip(packed.slots[:D].tolist(), packed.positions[:D].tolist())}
    assert [slot for slot, seen in sees_past.items() if not seen] == [4] and step_8.belt[4] == "E"
    [(_, _, chunk_mask)] = packed.chunks  # L's first 32 prompt tokens, at positions 0..31
    assert [bool(chunk_mask[t, t + 1:].any()) for t in range(32)] == [True] * 31 + [False]


def test_lab_3b_the_mask_reads_another_slots_keys(monkeypatch):
    """Each one-token row scoring its neighbour's keys: the equivalence fails with 3 slots and holds
    with one (one slot rolled is itself); the teeth test's control fails; yet every mask the forward
    ran under is main's, so the page's grid cannot show it: which slot is read is the cache's index."""
    gpt, rng_requests = tiny_gpt(), random_workload(seed=2, n_requests=8)
    masks_before = recorded_masks(gpt, rng_requests, n_slots=3)
    assert apply_lab(monkeypatch, lab(3), which=1) == "attend_packed"
    assert not matches_sequential(gpt, monkeypatch, n_slots=3)
    assert matches_sequential(gpt, monkeypatch, n_slots=1)
    with pytest.raises(AssertionError):
        test_a_broken_mask_is_caught(gpt, monkeypatch, decode_sees_everything)
    assert recorded_masks(gpt, rng_requests, n_slots=3) == masks_before, "the masks changed"


# ---------------------------------------------------------------------------------------------
# Lab 4: the dirty slot


def test_lab_4_the_dirty_slot(monkeypatch):
    """No wipe as a request leaves: the teeth test fails, its request 2 answering all 0s (argmax of
    NaN logits); a slot left with finite keys still answers right, the mask giving them weight 0."""
    assert apply_lab(monkeypatch, lab(4)) == "generate"
    with pytest.raises(AssertionError, match=re.escape("got  length [0, 0, 0, 0, 0, 0, 0]")):
        test_a_slot_is_cleaned_for_its_new_occupant(monkeypatch)
    test_reused_slot_gives_the_same_answer(tiny_gpt())


# ---------------------------------------------------------------------------------------------
# Lab 5: stalls


def test_lab_5_stalls():
    """The bench's long-prompt runs on the quick model: in steps, whole prompts feed 600 prompt
    tokens into one step, chunks at most 64, the prefill worker's loop none; chunks take the TTFT
    P50/P99 from 4/14 steps to 9/26. In time, the steps that take a long prompt whole last over
    twice the median step (measured: 3.1x)."""
    torch.manual_seed(0)
    model = nanobatch.GPT(nanobatch.TINY).eval()
    args = argparse.Namespace(seed=0, slots=8, max_len=None, prefill_chunk=None, device=torch.device("cpu"))
    reports, run_all = {}, bench.run_all

    def recording(*arguments, **keywords):  # the step reports of the three runs, which long_prompts keeps to itself
        summaries, completions, all_reports = run_all(*arguments, **keywords)
        reports.update(all_reports)
        return summaries, completions, all_reports

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as printed:
        patch.setattr(bench, "run_all", recording)
        panels = bench.long_prompts(model, args)
    summaries = {name: summary for name, _, _, summary, _ in panels}
    assert list(summaries) == ["whole prompts", "chunks of 64", "disaggregated"]
    check_excerpt(lab(5), printed.getvalue(), width=24 + 2 * 18)  # the table's label, then whole prompts and chunks
    assert summaries["whole prompts"]["TTFT P50/P99 (steps)"] == (4, 14)
    assert summaries["chunks of 64"]["TTFT P50/P99 (steps)"] == (9, 26)
    most = {name: max(report.n_prompt_tokens for report in reports[name]) for name in summaries}
    assert most == {"whole prompts": 600, "chunks of 64": 64, "disaggregated": 0}
    whole = reports["whole prompts"]
    long_steps = [report.step_s for report in whole if report.n_prompt_tokens >= 600]
    assert len(long_steps) == 4
    assert min(long_steps) > 2 * statistics.median(report.step_s for report in whole)


# ---------------------------------------------------------------------------------------------
# Lab 6: fairness


def test_lab_6_fairness(monkeypatch, main_demo):
    """Shortest job first on the demo: the median TTFT falls from 10 steps to 4, its P99 rises from
    16 to 36, and C (41 tokens, first in the queue) waits 36 steps for its first token instead of 2.
    Every answer is main's token for token: only the clock's first-come-first-served check fails."""
    before, _ = main_demo
    C = ord("C") - ord("A")
    assert apply_lab(monkeypatch, lab(6)) == "generate"
    after, printed = demo()
    check_excerpt(lab(6), printed)
    assert before.summaries["continuous"]["TTFT P50/P99 (steps)"] == (10, 16)
    assert after.summaries["continuous"]["TTFT P50/P99 (steps)"] == (4, 36)
    assert (ttft_steps(before, "continuous", C), ttft_steps(after, "continuous", C)) == (2, 36)
    assert before.requests[C].max_new_tokens == 41 and before.requests[C].arrival == 0
    for name in ("continuous", "static"):
        assert first_difference(after.completions[name], before.completions[name]) == ""
    with pytest.raises(AssertionError, match="admit_step out of arrival order"):
        check_clock(after.requests, after.completions["continuous"], 8, "continuous",
                          nanobatch.DEMO_PREFILL_CHUNK)


# ---------------------------------------------------------------------------------------------
# Lab 7: batch size


def test_lab_7_batch_size():
    """On a CPU a decode step's cost grows with its rows: 64 slots take well over twice the time of
    one per step (measured on the quick model: 5.3x), yet make well over 4 times its tokens a second
    (12x). The lab's own command runs, here on the quick model instead of GPT-2 124M."""
    torch.manual_seed(0)
    model = nanobatch.GPT(nanobatch.TINY).eval()
    one, sixty_four = (bench.time_decode_steps(model, [[47] * n_slots], max_len=64)[0] for n_slots in (1, 64))
    assert sixty_four > 2 * one, f"a step of 64 slots {sixty_four:.4f} s, of one {one:.4f} s"
    assert 64 / sixty_four > 4 * (1 / one), f"tokens/s: 64 slots {64 / sixty_four:.0f}, one {1 / one:.0f}"
    [snippet] = [argv[2] for argv in commands(lab(7)) if argv[:2] == ["python", "-c"]]
    assert snippet.count("GPTConfig()") == 1
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(snippet.replace("GPTConfig()", "GPTConfig(n_layer=1, n_head=1, n_embd=8)"), {})
    assert [line.split(":")[0].strip() for line in printed.getvalue().splitlines()] == \
        [f"{n} slots" for n in (1, 2, 4, 8, 16, 32, 64)]


# ---------------------------------------------------------------------------------------------
# Lab 8: sampling


def test_lab_8_sampling(monkeypatch):
    """Per-request generators: seeded, batched equals sequential; seed=None, two runs of the same
    request differ, so nothing can equal them. The lab's snippet prints what its excerpt shows for
    a seed. One generator shared by every request: every sampled case fails, one slot included (the
    reference left the generator elsewhere), and every greedy case passes."""
    gpt = tiny_gpt()
    assert matches_sequential(gpt, monkeypatch, n_slots=3, sampled=True)
    unseeded = nanobatch.Request([1, 2, 3], 16, temperature=1.0, seed=None)
    first, second = (nanobatch.generate(gpt, [unseeded], max_len=MAX_LEN, eos_id=None)[0].tokens for _ in range(2))
    assert first != second, "two unseeded runs drew the same 16 tokens"
    [snippet] = [argv[2] for argv in commands(lab(8)) if argv[:2] == ["python", "-c"]]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(snippet, {})
    seeded_line = printed.getvalue().splitlines()[0]
    assert seeded_line in re.findall(r"```text\n(.*?)```", lab(8), re.S)[-1].splitlines()
    assert apply_lab(monkeypatch, lab(8)) == "new_sampler"
    assert not matches_sequential(gpt, monkeypatch, n_slots=3, sampled=True)
    assert not matches_sequential(gpt, monkeypatch, n_slots=1, sampled=True)
    assert matches_sequential(gpt, monkeypatch, n_slots=3, sampled=False)
    with pytest.raises(AssertionError):
        test_needle_among_fillers(gpt)
