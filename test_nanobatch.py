"""
The proof that batching changes *when* tokens are computed, never *which*, told as a story in the
manner of minGPT's test_huggingface_import.

Everything is checked against an independent reference: `GPT.forward`, the textbook causal forward
with no cache, and `generate_sequential`, which serves one request at a time through it. The models
are tiny (2 layers, 4 heads, 64 dimensions, a vocabulary of 512) and seeded, so every run sees the
same numbers; float64 on CPU makes "the same tokens" a fair demand. Chapter by chapter:

1)  The engine serves exactly what the reference serves: the same tokens and finish reasons, greedy
    and sampled, in one slot, a few or more than there are requests, continuous and static, whole
    prompts or chunks, one-token rows attending together or alone past the attention cut; on the
    clock the schedule promises. Then the teeth: a slot reused after a long request, a seeded needle
    among fillers, a broken mask caught, a slot wiped for its new occupant.
1b) Disaggregated prefill: the prompts on a worker thread of their own, the same answers.
1c) The modes a caller runs generate in (inference mode, no_grad, neither): the same answers.
2)  Sampling follows its rule, written out here independently: `sample` is the one thing the engine
    and the reference share, so the one thing their equivalence cannot see.
3)  The cached forward computes the plain forward's logits, row by row, over dirty slots.
4)  Paged attention (Part 3): the same answers from a pool of blocks, with requests preempted and
    taken in again; the blocks' bookkeeping; and the teeth, a block table read one block off.
5)  Prefix caching (Part 4): blocks shared by requests with a common prefix, kept after their
    requests leave, evicted and reused, the same answers; each block's count of tables and no shared
    block written; and the teeth: a key blind to its parent, a block matched before its forward has
    run, a hit that leaves the last prompt token unfed.

Everything else sits in tests/, a file per subject: loading checkpoints (test_loading.py), bad
input (test_bad_input.py), the figures (test_figures.py), the belt as a picture and the bench
(test_belt_svg.py), the prefill worker's thread (test_worker.py), the command line (test_cli.py),
tools/verify.py (test_verify.py), the worked step and the page (test_page.py), and the labs of
docs/labs.md (test_labs.py). All share one set of helpers and fixtures, tests/common.py: this file
imports the fixtures it uses by name (`offline`, autouse, keeps every test off the network), and
tests/conftest.py hands them to every file under tests/.

    python -m pytest -q                      (everything: a minute or so on two CPU cores; no network)
    python -m pytest -q test_nanobatch.py    (the proof alone)
"""
import copy
import math
import random
from collections import Counter
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

import model as model_py
import nanobatch
from model import GPT, GPTConfig, slot_positions
from nanobatch import POLICIES, BlockPool, Request, attention_mask, generate, generate_sequential, sample
from tests.common import gpt, gpt_on, offline  # noqa: F401 (fixtures, found by name)
from tests.common import (HAS_CUDA, MAX_LEN, TIMEOUT_S, TINY, V, ends_within, first_difference, random_prompt,
                          random_workload, tiny_gpt, worker_threads, worst)
from verify import varying_ops, verdict  # noqa: E402 (tools/, put on the path by tests.common)


# ---------------------------------------------------------------------------------------------
# 1) The engine serves exactly what the reference serves


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
    """A step's one-token rows split at a cut (the shortest together, every longer one alone over its own
    slot) wherever their lengths differ, even in these tiny models (where the real cost of a call keeps them
    together): the cut at the shortest length -> the cuts chosen, as (cut, longest) pairs."""
    cuts = []

    def at_the_shortest(lengths, n_slots, device):
        cuts.append((min(lengths, default=1), max(lengths, default=0)))
        return cuts[-1][0]

    monkeypatch.setattr(model_py, "attention_cut", at_the_shortest)
    return cuts


# The cases: 1, 3 or 16 slots (one, a few, more slots than requests), both policies, whole prompts or
# a token a step or a few, one-token rows split at a cut only when it pays or wherever. One slot takes
# continuous's case by cost only: a lone slot refills the step it frees under either policy, and a cut
# over one row is its length, so its static and split runs are that run, step for step (as
# test_one_slot_is_one_schedule shows); they were a quarter of this test's cases, and proved no more.
CASES = [(n_slots, policy, prefill_chunk, cut) for n_slots in (1, 3, 16) for policy in POLICIES
         for prefill_chunk in (None, 1, 5) for cut in ("by cost", "split")
         if n_slots > 1 or (policy, cut) == ("continuous", "by cost")]


@pytest.mark.parametrize("n_slots, policy, prefill_chunk, cut", CASES)
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


def test_one_slot_is_one_schedule(gpt, monkeypatch):
    """With one slot, static batching and a cut wherever it splits rows are continuous batching by
    cost, step for step: the same reports, rows and logits. So test_generate_matches_sequential runs
    one slot's case once. Prompts fed a token a step: the most one-token rows a cut could split."""
    requests = random_workload(seed=9, sampled=True)

    def steps(policy):
        reports = []
        completions = generate(gpt, requests, n_slots=1, max_len=MAX_LEN, eos_id=None, policy=policy, prefill_chunk=1,
                               on_step=reports.append)
        return [(c.tokens, c.admit_step, c.finish_step) for c in completions], torch.cat(
            [r.logits for r in reports]), [(r.step, r.belt, r.sampled, r.admitted, r.waiting, None if r.packed is None
                                            else (r.packed.tokens.tolist(), r.packed.positions.tolist(),
                                                  [(rows, slot) for rows, slot, _ in r.packed.chunks]))
                                           for r in reports]

    def same(one, other):
        return one[0] == other[0] and torch.equal(one[1], other[1]) and one[2] == other[2]

    continuous = steps("continuous")
    assert same(steps("static"), continuous), "one slot, static: another schedule"
    cuts = split_attention_everywhere(monkeypatch)
    assert same(steps("continuous"), continuous), "one slot, a cut wherever it splits: another schedule"
    assert cuts and all(cut == longest for cut, longest in cuts), "a cut over one slot's row split it"


@pytest.mark.parametrize("prefill_chunk", [None, 3])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n_slots", [1, 2, 5])
def test_clock(gpt, n_slots, policy, prefill_chunk):
    """The schedule, on random workloads: one token per step after the first, prompts within their
    budget, first come first served, continuous never idles a slot while a request waits, static
    admits only into an empty belt. Each schedule judged by the other policy's rules must fail. One
    workload of 16 requests: its queue and its other policy's failure show that each case has teeth
    (a second seed, measured, had them in every case too, and doubled the time)."""
    requests, reports = random_workload(seed=1, n_requests=16), []
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
        model.lm_head.weight[poison] = math.nan  # token 7's embedding: row 7 of the tied head (model.GPT)
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


# ---------------------------------------------------------------------------------------------
# 1c) The modes a caller runs generate in


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
    """5,000 seeded draws over 5 ids: each id's frequency is within 5 standard errors of its
    probability by the rule (under 0.04 here). Multiplying by the temperature instead of dividing,
    or keeping the wrong ids, moves some probability by 0.1 or more, so 5,000 draws see it as 20,000
    did, in a quarter of the time. (At temperature 1 the two agree: that is why it is not among the
    cases.)"""
    logits = [-0.5, 1.0, -1.5, 0.5, 0.0]
    n_draws = 5_000
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
    spread = [50, 186, 321, 457, 593, 729, 864, 1000]  # cut 0, each alone: 4200 + 8 x 150 = 5400, the least
    assert model_py.attention_cut(spread, 8, cpu) == 0  # (cut 50: 8 x 50 + 4150 + 7 x 150 = 5600)
    assert model_py.attention_cut(spread[:1] * 8, 8, cpu) == 50 and model_py.attention_cut([24], 2, cpu) == 24
    assert model_py.attention_cut(spread, 8, gpu) == 1000  # on a GPU, a call is worth more than them all
    assert model_py.attention_cut([5, 5, 5], 4, cpu) == 5 and model_py.attention_cut([], 4, cpu) == 1
    two_long = [500, 500]  # on 16 slots, cut 0 (each alone): 1000 + 2 x 150 = 1300 keys; cut 500: 16 x 500 = 8000
    assert model_py.attention_cut(two_long, 16, cpu) == 0 and model_py.attention_cut(two_long, 2, cpu) == 500
    rng = random.Random(13)
    for _ in range(200):
        lengths = [rng.randint(1, 1000) for _ in range(rng.randint(1, 16))]
        n_slots = rng.randint(len(lengths), 64)
        def keys(cut):  # the keys read, and 150 for each row alone (cut 0: every row)
            return n_slots * cut + sum(length + 150 for length in lengths if length > cut)
        best = min(keys(cut) for cut in [0] + lengths)
        assert keys(model_py.attention_cut(lengths, n_slots, cpu)) == best, lengths


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
                cache.clear([slot], max_len)
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
# 4) Paged attention (Part 3): the same answers from a pool of blocks, preempted or not
#
# The cache becomes a pool of kv_blocks blocks of kv_block_size positions, shared by the slots; a
# request's block table says where each of its positions lives. The mask speaks of positions only,
# so the answers must not change, and neither may the schedule while the pool never runs short. A
# pool too small for every slot at once must preempt: the request admitted last gives its blocks
# back, waits at the head of the queue, and is fed its prompt and answer again when taken in. Its
# generator carries on, so even a sampled answer must come out as the reference's. The pools below:
# ample holds every slot's longest sequence at once; tight holds one and a third, so that with several
# slots requests are preempted, and taken in again, more than once a run (2 or 3 times, measured; one
# and a half preempted only once in some runs, as admission keeps room to grow: BlockPool.admit).


def pool_size(pool, n_slots, block_size):
    one_sequence = math.ceil(MAX_LEN / block_size)  # the blocks of the longest sequence the workload has
    return n_slots * one_sequence if pool == "ample" else one_sequence + max(1, one_sequence // 3)


def served_paged(model, requests, eos_id, n_slots, kv_blocks, block_size, prefill_chunk, monkeypatch):
    """generate with a paged cache -> (its completions, its step reports, the BlockPool it used)."""
    pools, reports = [], []
    monkeypatch.setattr(nanobatch, "BlockPool", lambda *args: pools.append(BlockPool(*args)) or pools[-1])
    got = generate(model, requests, n_slots=n_slots, max_len=MAX_LEN, eos_id=eos_id, prefill_chunk=prefill_chunk,
                   on_step=reports.append, kv_blocks=kv_blocks, kv_block_size=block_size)
    return got, reports, pools[0]


def check_blocks(reports, pool, kv_blocks, block_size):
    """The bookkeeping, step by step: no block in two tables, every table within the pool and
    holding its slot's positions; at the end every block free again and nobody holding one."""
    for report in reports:
        held = [block for table in report.block_tables for block in table]
        assert len(held) == len(set(held)), f"step {report.step}: a block held twice: {report.block_tables}"
        assert all(0 <= block < kv_blocks for block in held), f"step {report.step}: {report.block_tables}"
        assert report.kv_used <= len(held) * block_size and report.kv_total == kv_blocks * block_size, report.step
        assert all(not table for table, i in zip(report.block_tables, report.occupants) if i is None), \
            f"step {report.step}: an empty slot holds blocks: {report.block_tables}"
    assert sorted(pool.free_blocks) == list(range(kv_blocks)), f"blocks not given back: {sorted(pool.free_blocks)}"
    assert not pool.holders, pool.holders


@pytest.mark.parametrize("prefill_chunk", [None, 5])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("n_slots, pool", [(4, "tight"), (16, "ample"), (16, "tight")])
def test_paged_equals_sequential(gpt_on, workload, n_slots, block_size, prefill_chunk, pool, monkeypatch):
    """Paged, the same tokens and finish reasons as one request at a time through the plain forward:
    greedy and sampled, whole prompts and chunks, blocks of one position, of three (a sequence's
    positions straddle blocks) and of 16 (most sequences in one or two), 4 and 16 slots. An ample
    pool keeps the per-slot schedule step for step; a tight one preempts, several times a run, and
    hands the freed blocks to others. (One slot proved nothing these do not, at a third of
    this test's time: with nobody to preempt, an ample pool is 16 slots' case with fewer rows, and a
    tight one would only show admission waiting for blocks.)"""
    requests, eos_id, reference = workload
    kv_blocks = pool_size(pool, n_slots, block_size)
    got, reports, used_pool = served_paged(gpt_on, requests, eos_id, n_slots, kv_blocks, block_size, prefill_chunk,
                                           monkeypatch)
    assert first_difference(got, reference) == ""
    check_blocks(reports, used_pool, kv_blocks, block_size)
    # Recompute refeeds keys, never tokens: each token was sampled exactly once, from one row of logits.
    n_rows = Counter(i for report in reports for i in report.sampled)
    assert [n_rows[i] for i in range(len(requests))] == [len(c.tokens) for c in got], "a token sampled twice"
    n_preempted = sum(len(report.preempted) for report in reports)
    if pool == "ample":  # nothing to preempt, so the schedule is the per-slot one, step for step
        per_slot = generate(gpt_on, requests, n_slots=n_slots, max_len=MAX_LEN, eos_id=eos_id,
                            prefill_chunk=prefill_chunk)
        assert n_preempted == 0
        assert [(c.admit_step, c.first_token_step, c.finish_step, c.slot) for c in got] == \
            [(c.admit_step, c.first_token_step, c.finish_step, c.slot) for c in per_slot]
    else:
        assert n_preempted >= 2, f"only {n_preempted} preemptions: the pool lacks teeth"
        resumed = {i for report in reports for i in report.preempted} & {i for r in reports for i in r.admitted}
        assert resumed, "no preempted request was taken in again"


@pytest.mark.parametrize("group_bytes", [1, 50_000])  # a slot a group; a few slots a group
def test_paged_groups_equal_sequential(gpt_on, workload, group_bytes, monkeypatch):
    """Paged, the one-token call reads its slots a group at a time (model.paged_group_size), so that
    each group's copies are still in the CPU's cache when attention reads them: GPT-2 on a CPU, at 64
    rows of 49 keys, in 4 groups of 16. A tiny model's slots all fit in one group, so here the
    groups are made small: one slot each, then a few. The same tokens as one request at a time."""
    requests, eos_id, reference = workload
    sizes, group_size = [], model_py.paged_group_size  # (slots the call reads, slots in each group)
    monkeypatch.setattr(model_py, "PAGED_GROUP_BYTES", {"cpu": group_bytes, "gpu": group_bytes})
    monkeypatch.setattr(model_py, "paged_group_size",
                        lambda n_slots, *args: sizes.append((n_slots, group_size(n_slots, *args))) or sizes[-1][1])
    got, _, _ = served_paged(gpt_on, requests, eos_id, 16, pool_size("ample", 16, 3), 3, None, monkeypatch)
    assert first_difference(got, reference) == ""
    if group_bytes == 1:
        assert {size for _, size in sizes} == {1} and max(n for n, _ in sizes) > 1, sizes
    else:
        assert any(1 < size < n_slots for n_slots, size in sizes), f"no call in groups of several slots: {sizes}"


def test_a_block_table_read_one_block_off_is_caught(gpt, monkeypatch):
    """Teeth: let attention read each slot's blocks one entry along its block table (block j's keys
    read where block j - 1's belong), while the writes stay right. The masks, which speak of
    positions, are all unchanged; only the answers can show it, and they must."""
    requests = random_workload(seed=3, n_requests=8)
    reference = generate_sequential(gpt, requests, max_len=MAX_LEN, eos_id=None)

    def one_block_off(cache, gathered, block_tables, slots, L):
        if block_tables is None:
            return slot_positions(cache, gathered, block_tables, slots, L)
        return slot_positions(cache, gathered, block_tables.roll(-1, dims=1), slots, L)

    def paged():
        return generate(gpt, requests, n_slots=4, max_len=MAX_LEN, eos_id=None, kv_blocks=48, kv_block_size=3)

    assert first_difference(paged(), reference) == "", "the engine itself is broken"
    monkeypatch.setattr(model_py, "slot_positions", one_block_off)
    assert first_difference(paged(), reference) != "", "a block table read one block off went unnoticed"


# ---------------------------------------------------------------------------------------------
# 5) Prefix caching (Part 4): a shared prompt's blocks computed once, and not one token changed
#
# A request may take into its block table full blocks that another request's forward wrote, and
# feed only the rest. That may change when tokens come, never which: every answer must still be
# the reference's, computed one request at a time through the plain forward. The workload holds each
# way a block is shared: a system prompt most requests start with, two identical prompts, a prompt
# that shares only part of a block, a late request whose sharers have all left (their blocks free,
# kept), and, in the tight pool, blocks evicted and reused and sharers preempted.

SYSTEM = random_prompt(random.Random(7), 20)  # 20 tokens: whole blocks of 1 and 3 positions, one of 16 and 4 over


def shared_prefix_workload():
    """(requests, eos_id, the reference's completions): greedy and sampled requests that share SYSTEM."""
    rng = random.Random(8)
    requests = [Request(SYSTEM + random_prompt(rng, rng.randint(1, 6)), rng.randint(1, 10), 0.8 * (i % 2), None,
                        seed=i, arrival=i // 2) for i in range(10)]
    requests += [Request(list(requests[0].prompt), 8, arrival=5),  # identical to request 0's
                 Request(SYSTEM[:7] + random_prompt(rng, 4), 6, arrival=5),  # shares 7 tokens: part of a block
                 Request(SYSTEM + random_prompt(rng, 3), 6, 0.8, None, seed=12, arrival=40)]  # after all have left
    return requests, None, generate_sequential(tiny_gpt(), requests, max_len=MAX_LEN, eos_id=None)


@pytest.fixture(scope="module")
def shared_prefix():
    return shared_prefix_workload()


def served_with_prefix_cache(model, requests, n_slots, kv_blocks, block_size, prefill_chunk, monkeypatch, check):
    """generate with the prefix cache, check(report, pool) after every step -> (completions, reports, pool,
    the steps at which a kept block was evicted)."""
    pools, reports, evicted_at = [], [], []
    monkeypatch.setattr(nanobatch, "PrefixCache", lambda *args: pools.append(nanobatch_PrefixCache(*args)) or pools[-1])

    def take_block(pool):  # PrefixCache.take_block, noting each eviction
        if pool.free_blocks and pool.free_blocks[0] in pool.key_of:
            evicted_at.append(len(reports))
        return REAL_PREFIX_CACHE["take_block"](pool)

    monkeypatch.setattr(nanobatch_PrefixCache, "take_block", take_block, raising=False)

    def on_step(report):
        reports.append(report)
        check(report, pools[0])

    got = generate(model, requests, n_slots=n_slots, max_len=MAX_LEN, eos_id=None, prefill_chunk=prefill_chunk,
                   on_step=on_step, kv_blocks=kv_blocks, kv_block_size=block_size, prefix_cache=True)
    return got, reports, pools[0], evicted_at


nanobatch_PrefixCache = nanobatch.PrefixCache  # the real one, before a test wraps it
REAL_PREFIX_CACHE = dict(vars(nanobatch_PrefixCache))  # and its methods, before a test replaces one


def check_shared_blocks(report, pool):
    """The bookkeeping of one step: each block's count of tables is the tables that list it; no block
    listed by two tables is written; a kept block is listed by none."""
    listed = Counter(block for table in report.block_tables for block in table)
    assert [listed[block] for block in range(len(pool.n_tables))] == pool.n_tables, f"step {report.step}: counts"
    if report.packed is not None:
        block_size = pool.block_size
        written = report.packed.block_tables[report.packed.slots, report.packed.positions // block_size].tolist()
        shared = sorted({block for block in written if listed[block] > 1})
        assert not shared, f"step {report.step}: blocks {shared} written while two requests hold them"
    assert not set(report.cached_free) & set(listed), f"step {report.step}: a kept block is held"


@pytest.mark.parametrize("prefill_chunk", [None, 5])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("pool", ["ample", "tight"])
def test_prefix_cache_equals_sequential(gpt, shared_prefix, block_size, prefill_chunk, pool, monkeypatch):
    """With the prefix cache, the reference's tokens and finish reasons, greedy and sampled, whole and
    chunked, blocks of 1, 3 and 16: and every kind of sharing happened. Ample: the late request
    found the blocks its sharers left, free and kept. Tight (a pool of one and a half sequences, 4
    slots): kept blocks were evicted and reused, a request found blocks after an eviction, and
    sharers were preempted; but for blocks of 16, where the pool's 3 blocks serve one request at a
    time (admission keeps room to grow) beside SYSTEM's block, which is never free to evict."""
    requests, eos_id, reference = shared_prefix
    kv_blocks = pool_size(pool, 4, block_size)
    got, reports, used, evicted_at = served_with_prefix_cache(gpt, requests, 4, kv_blocks, block_size, prefill_chunk,
                                                              monkeypatch, check_shared_blocks)
    assert first_difference(got, reference) == ""
    assert sorted(used.free_blocks) == list(range(kv_blocks)) and not any(used.n_tables), "blocks not given back"
    assert not used.holders
    found = {i: n for report in reports for i, n in zip(report.admitted, report.found_cached)}
    assert found[10] >= (len(SYSTEM) // block_size) * block_size, "the identical prompt found less than SYSTEM"
    n_rows = Counter(i for report in reports for i in report.sampled)
    assert [n_rows[i] for i in range(len(requests))] == [len(c.tokens) for c in got], "a token sampled twice"
    if pool == "ample":
        assert found[12] > 0 and not evicted_at, "the late request found nothing its sharers left"
    elif block_size < 16:  # 3 blocks of 16 serve one request at a time, beside SYSTEM's block, never free
        hits_after = [n for report in reports[evicted_at[0] + 1:] for n in report.found_cached] if evicted_at else []
        assert any(hits_after), "no hit after an eviction"
        assert sum(len(report.preempted) for report in reports) >= 1, "no sharer preempted"


def served_prefix_cached(model, requests, **options):
    """generate with the prefix cache, stopped after 300 steps (a run that never ends is a defect too)."""
    def at_most_300(report):
        if report.step > 300:
            raise RuntimeError("still running after 300 steps")
    return generate(model, requests, max_len=MAX_LEN, eos_id=None, on_step=at_most_300, prefix_cache=True, **options)


def test_a_key_that_ignores_the_parent_is_caught(gpt, monkeypatch):
    """Teeth: keys made of a block's tokens alone. B's first block has the tokens of A's third, at
    other positions after another prefix: B must not take it, and the answers show it if it does."""
    rng = random.Random(9)
    a, b_tail = random_prompt(rng, 12), random_prompt(rng, 5)
    requests = [Request(a, 4), Request(a[6:9] + b_tail, 6, arrival=3)]
    reference = generate_sequential(gpt, requests, max_len=MAX_LEN, eos_id=None)
    options = dict(n_slots=2, kv_blocks=24, kv_block_size=3)
    assert first_difference(served_prefix_cached(gpt, requests, **options), reference) == "", "the engine is broken"

    def keys_of_tokens_alone(pool, run, n_blocks):
        return [(None, key[1]) for key in REAL_PREFIX_CACHE["keys"](pool, run, n_blocks)]

    monkeypatch.setattr(nanobatch_PrefixCache, "keys", keys_of_tokens_alone)
    assert first_difference(served_prefix_cached(gpt, requests, **options), reference) != "", \
        "a key that ignores its parent went unnoticed"


def test_a_block_matched_before_its_forward_is_caught(gpt, monkeypatch):
    """Teeth: key a block as soon as its tokens are known, before the forward that writes all of it
    has run. B, admitted while A's prompt goes in in chunks, takes A's half-written last block, which
    A then writes while B holds it: the step's bookkeeping must catch it."""
    prompt = random_prompt(random.Random(10), 24)
    requests = [Request(prompt, 4), Request(prompt, 4, arrival=1)]
    options = dict(n_slots=2, kv_blocks=24, block_size=3, prefill_chunk=5)
    served_with_prefix_cache(gpt, requests, **options, monkeypatch=monkeypatch, check=check_shared_blocks)

    def key_when_known(pool, runs):  # PrefixCache.key_written, a partly written last block keyed too
        for run in runs:
            n_known = -(-run.n_cached // pool.block_size)
            for block, key in zip(run.block_table, REAL_PREFIX_CACHE["keys"](pool, run, n_known)):
                if key not in pool.block_with:
                    pool.key_of[block], pool.block_with[key] = key, block

    monkeypatch.setattr(nanobatch_PrefixCache, "key_written", key_when_known)
    with pytest.raises(AssertionError, match="written while two requests hold them"):
        served_with_prefix_cache(gpt, requests, **options, monkeypatch=monkeypatch, check=check_shared_blocks)


def test_a_hit_that_skips_the_last_prompt_token_is_caught(gpt, monkeypatch):
    """Teeth: let a hit run to the end of the prompt. A prompt of whole blocks, found whole, leaves
    nothing to feed, and no token to sample: the run must fail, not end as if all were well (here
    plan_step, taking it for a decoding request, finds no newest token)."""
    prompt = random_prompt(random.Random(11), 12)
    requests = [Request(prompt, 4), Request(prompt, 4, arrival=8)]
    options = dict(n_slots=2, kv_blocks=24, kv_block_size=3)
    served_prefix_cached(gpt, requests, **options)
    real_keys = REAL_PREFIX_CACHE["keys"]

    def one_block_more(pool, run, n_blocks):
        return real_keys(pool, run, (len(run.request.prompt) + len(run.tokens)) // pool.block_size)

    monkeypatch.setattr(nanobatch_PrefixCache, "keys", one_block_more)
    with pytest.raises((IndexError, RuntimeError)):
        served_prefix_cached(gpt, requests, **options)


# ---------------------------------------------------------------------------------------------
# 6) Batch invariance (model.py): in float32, the very bits of every logit, whatever shares a step
#
# In float64 the engine's logits come within rounding of the reference's; in float32 their last bits
# differ, and a near-tie can flip a token (tools/verify.py judges such a flip "rounding"). A model built
# batch-invariant (GPTConfig.batch_invariant) computes each row the same way in any call, so that every
# sampled row's logits are bitwise the reference's in every mode. First the premise, on this machine:
# each op of the step gives a row the same bits in any call; an op that does not is named.

INVARIANT_MODES = {  # generate's options in each mode the engine runs; "live": the same, through LiveRequests
    "per slot": dict(n_slots=3), "static": dict(n_slots=3, policy="static"),
    "chunked": dict(n_slots=3, prefill_chunk=5), "one token a step": dict(n_slots=16, prefill_chunk=1),
    "paged, preempted": dict(n_slots=4, kv_blocks=14, kv_block_size=4),
    "prefix-cached, preempted": dict(n_slots=4, kv_blocks=14, kv_block_size=4, prefix_cache=True, prefill_chunk=6),
    "disaggregated": dict(n_slots=3, disaggregate=True), "live": dict(n_slots=3, prefill_chunk=7),
}


def invariant_gpt(dtype=torch.float32, batch_invariant=True):
    """tiny_gpt's weights, batch-invariant (or not), in float32: the dtype whose last bits batching moves."""
    model = GPT(GPTConfig(**TINY, batch_invariant=batch_invariant)).to(dtype).eval()
    model.load_state_dict(tiny_gpt(dtype=dtype).state_dict())
    return model


def test_every_batch_invariant_op_gives_a_row_the_same_bits_in_any_call():
    """The premise, measured here (tools/verify.py --ops prints the table): each op of a batch-invariant step,
    a row in calls of 1 to 100 rows and attention over more keys, in a batch, as a prompt's row, against the same
    row in the largest call. The default path's linear layers and attention differ: what the proof below needs."""
    varying = {op: where for op, where in varying_ops(invariant_gpt()).items() if where}
    assert not varying, f"on this machine, batch-invariant ops that differ: {varying}"
    default = varying_ops(invariant_gpt(batch_invariant=False))
    assert default["attention"] and all(default[op] for op in default if op.startswith(("linear", "LM head"))), default


def logits_and_reference(model, requests, mode):
    """Every sampled row's logits from generate in this mode, each beside the reference's for the same prefix
    (GPT.forward over the whole sequence) -> [(request index, token index, engine's row, reference's row)]."""
    options, rows = dict(INVARIANT_MODES[mode]), []
    on_step = lambda report: rows.extend(zip(report.sampled, report.logits.clone()))  # noqa: E731
    if mode == "live":
        with nanobatch.LiveRequests(model, max_len=MAX_LEN, eos_id=None, on_step=on_step, **options) as live:
            streams = [live.submit(request) for request in requests]
        completions = [stream.completion for stream in streams]
    else:
        completions = generate(model, requests, max_len=MAX_LEN, eos_id=None, on_step=on_step, **options)
    seen, paired = Counter(), []
    with torch.no_grad():
        for i, row in rows:
            k, seen[i] = seen[i], seen[i] + 1
            prefix = torch.tensor([requests[i].prompt + completions[i].tokens[:k]])  # (1, T)
            paired.append((i, k, row, model(prefix)[0, -1]))
    assert [seen[i] for i in range(len(requests))] == [len(c.tokens) for c in completions]
    return paired


@pytest.mark.parametrize("mode", INVARIANT_MODES)
def test_batch_invariant_logits_are_the_references_bit_for_bit(mode):
    """float32, greedy and sampled: every sampled row's logits torch.equal to the reference's, in every mode
    (paged and prefix-cached in pools small enough to preempt); the same model on the default path does not."""
    requests = random_workload(seed=21, n_requests=12, sampled=True)
    paired = ends_within(TIMEOUT_S, logits_and_reference, invariant_gpt(), requests, mode)
    unequal = [(i, k, worst(row, want)) for i, k, row, want in paired if not torch.equal(row, want)]
    assert not unequal, f"{len(unequal)} of {len(paired)} rows differ, first: request {unequal[0][0]}, " \
                        f"token {unequal[0][1]}: {unequal[0][2]}"
    if mode == "per slot":  # the teeth: without invariance, most rows' bits differ
        default = logits_and_reference(invariant_gpt(batch_invariant=False), requests, mode)
        assert sum(not torch.equal(row, want) for _, _, row, want in default) > len(default) // 2


def test_a_product_of_a_few_rows_left_to_its_own_kernel_is_caught(monkeypatch):
    """The teeth: MIN_ROWS_INVARIANT = 2, so that a product of 8 rows or fewer (a decode step's, mostly) takes
    MKL's kernel for a few columns again, not the general one the reference's long rows take. The proof must see
    it (where the machine's BLAS splits calls so), and the ops' check name the linear layers."""
    monkeypatch.setattr(model_py, "MIN_ROWS_INVARIANT", 2)
    varying = varying_ops(invariant_gpt())
    assert varying[f"linear {TINY['n_embd']} -> {3 * TINY['n_embd']}"], varying
    paired = logits_and_reference(invariant_gpt(), random_workload(seed=21, n_requests=12), "per slot")
    assert any(not torch.equal(row, want) for _, _, row, want in paired)
