"""
Part 5, the engine live (issue 40, section 1): LiveRequests runs the loop on a thread of its own while
other threads submit requests, read each one's Stream and cancel. Proved here in float64 on the tiny
seeded models, against generate_sequential, as a story in four acts:
1) Streaming. Each token reaches its Stream in the step that samples it (timed against the steps'
   reports), the finish reason on the last item only, the Completion set by then, and the tokens the
   reference's, greedy and sampled, from several threads submitting at once while the loop runs. The
   list form of generate is unchanged.
2) Cancel, from another thread. In a slot, the request retires at the next step boundary: its slot is
   refilled in that very step and its blocks go back (a prefix cache keeps what it wrote, found by a
   later request). Waiting, it leaves the queue; finished, nothing happens. Every other request keeps
   the reference's tokens, per slot, chunked, paged (preempting) and prefix-cached. At the prefill
   worker, it leaves once handed back. Many at once, and one just submitted.
3) Idle, the engine blocks: it uses no CPU, and a submission wakes it.
4) A clean stop. close drains; close(abort=True) aborts; an exception in the `with` aborts and is
   raised; the engine's error reaches every reader and the `with`. Bad options and bad requests are
   refused up front. No thread outlives the `with`.
Each run goes through ends_within (tests/common.py): a hang fails its test, never the suite. A cancel
or a close that must land at a known step does so because on_step holds the engine until the test's
thread has acted (Held, below), never because of a sleep.
"""
import queue
import random
import threading
import time

import pytest

import nanobatch
from model import GPT
from nanobatch import LiveRequests, Request, Stream, generate, generate_sequential
from tests.common import (MAX_LEN, TIMEOUT_S, V, WORKER, ends_within, first_difference, on_worker, random_prompt,
                          random_workload)

ENGINE = "nanobatch engine"  # the name of LiveRequests' thread
LIVE = dict(max_len=MAX_LEN, eos_id=None)  # the tiny model has no EOS of GPT-2's: answers end by length


def engine_threads():  # the engine's threads alive now: LiveRequests' and the prefill worker's
    return {thread for thread in threading.enumerate() if thread.name in (ENGINE, WORKER)}


def reference(gpt, requests):
    return generate_sequential(gpt, requests, max_len=MAX_LEN, eos_id=None)


def submit_at_once(live, requests):
    """Submit them all under the lock the engine takes them in by: it takes them in at one step, however
    slowly this thread runs on a busy machine."""
    with live.changed:
        return [live.submit(request) for request in requests]


def tokens_of(items):  # the tokens of a stream's items, [(token, finish_reason)]; an abort's None left out
    return [token for token, _ in items if token is not None]


class Held:
    """An on_step that records every report and, at the first step where `when(report)` holds, keeps the
    engine in that step until the test's thread has acted (a cancel, a submission) and called release():
    the act lands at the boundary before the next step. With until_closed, it waits instead for the
    test to close `live` (close notifies the condition that this waits on)."""

    def __init__(self, when, until_closed=False):
        self.when, self.until_closed, self.reports, self.live, self.held = when, until_closed, [], None, None
        self.reached, self.released = threading.Event(), threading.Event()

    def __call__(self, report):
        self.reports.append(report)
        if self.reached.is_set() or not self.when(report):
            return
        self.held = report
        self.reached.set()
        if self.until_closed:
            with self.live.changed:
                assert self.live.changed.wait_for(lambda: self.live.is_closed, TIMEOUT_S), "never closed"
        else:
            assert self.released.wait(TIMEOUT_S), "the test never released the engine"

    def wait(self):  # -> the report of the step it holds
        assert self.reached.wait(TIMEOUT_S), "the step to hold at never came"
        return self.held

    def release(self):
        self.released.set()

    def n_tokens(self, request_index):  # tokens the request has made so far
        return sum(request_index in report.sampled for report in self.reports)

    def finished(self, step):  # {request index: finish reason} of a step's report
        return {i: completion.finish_reason for i, completion in self.reports[step].finished}


# ---------------------------------------------------------------------------------------------
# 1) Streaming


class TimedItems(queue.Queue):
    """A Stream's items that note, as each is put, how many steps had ended (their on_step returned):
    while step s runs, s. A token put in the step that samples it is noted with that step's number."""

    def __init__(self, steps_ended):
        super().__init__()
        self.steps_ended, self.log = steps_ended, []  # log: (item, steps ended when it was put)

    def put(self, item, *args, **kwargs):
        self.log.append((item, self.steps_ended[0]))
        super().put(item, *args, **kwargs)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_each_token_reaches_its_stream_in_the_step_that_samples_it(gpt, monkeypatch, sampled):
    """A long request starts the loop; once its first token is read, four threads submit three requests
    each at once and read them. Each item was put in the step whose report samples that token (the step
    after would be a step late), the finish reason is on the last item only, as the report that finishes
    the request says, .completion holds it by the time the last item is read, and the tokens and reasons
    are the reference's, request by request."""
    steps_ended, reports = [0], []

    def on_step(report):  # runs on the engine's thread, after the step's items were put
        reports.append(report)
        steps_ended[0] += 1

    stream_init = Stream.__init__

    def timed_stream(stream, *args):
        stream_init(stream, *args)
        stream.items = TimedItems(steps_ended)
        stream.put = stream.items.put  # where the engine's thread hands each item (no on_item here)

    monkeypatch.setattr(Stream, "__init__", timed_stream)
    rng = random.Random(5)
    requests = [Request(random_prompt(rng, 3), 2 * MAX_LEN, 0.8 if sampled else 0.0, seed=99)]  # runs to its slot's end
    requests += random_workload(seed=6, n_requests=12, sampled=sampled)  # their arrival steps mean nothing live
    streams, read, completions = {}, {}, {}  # by the request's place in `requests`

    def submit_and_read(numbers, all_at_once, live):
        all_at_once.wait(TIMEOUT_S)
        for n in numbers:
            streams[n] = live.submit(requests[n])
        for n in numbers:
            read[n] = list(streams[n])
            completions[n] = streams[n].completion  # as the last item is read

    def serve():
        with LiveRequests(gpt, n_slots=3, on_step=on_step, **LIVE) as live:
            streams[0] = live.submit(requests[0])
            first = next(iter(streams[0]))  # the loop runs
            all_at_once = threading.Barrier(4)
            shares = [range(1 + 3 * k, 4 + 3 * k) for k in range(4)]  # requests 1-3, 4-6, 7-9, 10-12
            submitters = [threading.Thread(target=submit_and_read, args=(share, all_at_once, live)) for share in shares]
            for thread in submitters:
                thread.start()
            read[0] = [first] + list(streams[0])
            completions[0] = streams[0].completion
            for thread in submitters:
                thread.join(TIMEOUT_S)
            assert not any(thread.is_alive() for thread in submitters), "a reader hangs"

    ends_within(TIMEOUT_S, serve)
    assert [report.step for report in reports] == list(range(len(reports)))  # live, the clock never jumps
    want = reference(gpt, requests)
    for n, stream in streams.items():
        i = stream.request_index
        sampled_in = [report.step for report in reports if i in report.sampled]
        [finished_in] = [report.step for report in reports if i in dict(report.finished)]
        assert [item for item, _ in stream.items.log] == read[n], f"request {n}: read is not what was put"
        assert [steps for _, steps in stream.items.log] == sampled_in, \
            f"request {n}: its tokens were put after the steps that ended {[s for _, s in stream.items.log]}, " \
            f"sampled in steps {sampled_in}"
        assert [reason for _, reason in read[n]] == [None] * (len(read[n]) - 1) + [want[n].finish_reason], n
        assert finished_in == sampled_in[-1], f"request {n} finished in step {finished_in}, not {sampled_in[-1]}"
        assert (completions[n].tokens, completions[n].finish_reason) == (tokens_of(read[n]), read[n][-1][1]), n
    got = [completions[n] for n in range(len(requests))]
    assert first_difference(got, want) == ""


def test_the_list_form_is_unchanged(gpt):
    """generate(model, a list) returns each request's Completion in request order with the reference's
    tokens, and the schedule the loop made before Part 5 (recorded at commit 3edb795): each request's
    admit, first-token and finish steps and its slot: per slot, and in two pools that preempt, paged
    and prefix-cached, both chunked."""
    before_part_5 = {  # admit_step,first_token_step,finish_step,slot for each request, in request order
        "per slot": "0,0,2,0 0,0,2,1 0,0,0,2 6,6,18,2 19,19,19,2 4,4,21,1 1,1,5,2 3,3,30,0",
        "paged, preempting": "0,1,3,0 4,7,9,0 10,12,12,0 19,20,55,1 56,61,61,0 13,15,46,0 10,14,18,1 13,15,42,0",
        "prefix-cached": "0,1,3,0 0,5,7,1 4,8,8,0 15,16,35,0 39,44,44,0 9,11,28,0 8,10,14,1 8,11,38,2"}
    modes = {"per slot": {}, "paged, preempting": dict(kv_blocks=9, kv_block_size=4, prefill_chunk=6),
             "prefix-cached": dict(kv_blocks=12, kv_block_size=4, prefix_cache=True, prefill_chunk=6)}
    requests = random_workload(seed=4, n_requests=8, sampled=True)
    want = reference(gpt, requests)
    for mode, options in modes.items():
        reports = []
        got = generate(gpt, requests, n_slots=3, on_step=reports.append, **LIVE, **options)
        assert first_difference(got, want) == "", mode
        schedule = " ".join(f"{c.admit_step},{c.first_token_step},{c.finish_step},{c.slot}" for c in got)
        assert schedule == before_part_5[mode], f"{mode} changed:\n  got  {schedule}\n  want {before_part_5[mode]}"
        assert any(report.preempted for report in reports) == bool(options), f"{mode}: preempted as it should?"


# ---------------------------------------------------------------------------------------------
# 2) Cancel


CACHES = {  # the caches and prompt budgets a cancel must leave the others' tokens unchanged in
    "per slot": {},
    "chunked": dict(prefill_chunk=3),
    "paged, preempting": dict(kv_blocks=8, kv_block_size=4),
    "prefix-cached": dict(kv_blocks=14, kv_block_size=4, prefix_cache=True, prefill_chunk=5),
}


def captured_pools(monkeypatch):
    """The BlockPool (or PrefixCache) each generate makes, kept in a list as it is made."""
    pools, block_pool_init = [], nanobatch.BlockPool.__init__

    def init(pool, *args):
        block_pool_init(pool, *args)
        pools.append(pool)

    monkeypatch.setattr(nanobatch.BlockPool, "__init__", init)
    return pools


@pytest.mark.parametrize("cache", CACHES)
def test_a_cancelled_request_leaves_at_the_next_step_boundary(gpt, monkeypatch, cache):
    """Two slots. V (its prompt two full blocks of four and one token more) and F take them; F makes its
    two tokens and finishes, B takes its slot, and C, W, E wait. Once V has three tokens (and no one
    finishes in the step), the engine is held between steps while the test's thread cancels V (in a
    slot), W (waiting) and F (finished). The next step: V and W leave, told "abort" as their last item,
    with Completions that say so; V's slot is free in that very step and C takes it; V's blocks are
    free (or taken afresh by that step's work); W is never admitted; F's stream and Completion stay as
    they were. Then G, whose prompt begins with V's two full blocks, is submitted: with a prefix cache
    it finds them. Every request but V and W makes the reference's tokens, and V made the reference's
    first tokens. At the end every block of a pool is free again."""
    pools, options = captured_pools(monkeypatch), CACHES[cache]
    rng = random.Random(7)
    prompt_v = random_prompt(rng, 9)
    requests = [Request(prompt_v, 20, 0.8, top_k=50, seed=1),  # 0: V, cancelled in its slot
                Request(random_prompt(rng, 2), 2),  # 1: F, finished before the cancel
                Request(random_prompt(rng, 5), 20, 1.5, seed=2),  # 2: B
                Request(random_prompt(rng, 4), 6),  # 3: C, takes V's slot
                Request(random_prompt(rng, 6), 8, 0.8, seed=3),  # 4: W, cancelled while it waits
                Request(random_prompt(rng, 3), 10),  # 5: E
                Request(prompt_v[:8] + random_prompt(rng, 2), 5)]  # 6: G, after V has gone
    free_blocks = []  # each step's free blocks, as on_step sees them

    def when(report):  # V in a slot with three tokens, F finished before, W waiting, no slot freed by this step
        return hold.n_tokens(0) >= 3 and 0 in report.occupants and 4 in report.waiting and \
            any(1 in dict(r.finished) for r in hold.reports[:-1]) and report.finished == []

    hold = Held(when)

    def on_step(report):
        free_blocks.append(list(pools[0].free_blocks) if pools else [])
        hold(report)

    def serve():
        with LiveRequests(gpt, n_slots=2, on_step=on_step, **LIVE, **options) as live:
            streams = submit_at_once(live, requests[:6])
            before = hold.wait()
            read_f = list(streams[1])  # ended, two steps or more ago
            for n in (0, 4, 1):
                streams[n].cancel()
            hold.release()
            read = {n: list(streams[n]) for n in (0, 4)}  # V and W: ended at the next boundary
            streams.append(live.submit(requests[6]))  # after V has left
            read.update((n, list(streams[n])) for n in (2, 3, 5, 6))
            assert streams[1].items.empty(), "F's stream, cancelled once finished, has an item more"
        return before, read_f, read, streams

    before, read_f, read, streams = ends_within(TIMEOUT_S, serve)
    read_v, read_w, read[1] = read[0], read[4], read_f
    s, slot = before.step, before.occupants.index(0)
    after = hold.reports[s + 1]
    want = reference(gpt, requests)
    # V: out of its slot at the next boundary, the slot taken by C in that same step.
    assert hold.finished(s + 1).get(0) == "abort", f"V not retired at step {s + 1}: {hold.finished(s + 1)}"
    assert after.occupants[slot] == 3 and 3 in after.admitted, f"V's slot {slot} at step {s + 1}: {after.occupants}"
    assert all(0 not in report.occupants for report in hold.reports[s + 1:])
    assert read_v[-1] == (None, "abort") and all(reason is None for _, reason in read_v[:-1])
    assert tokens_of(read_v) == want[0].tokens[:len(tokens_of(read_v))] and len(tokens_of(read_v)) >= 3
    assert (streams[0].completion.tokens, streams[0].completion.finish_reason) == (tokens_of(read_v), "abort")
    # W: out of the queue, never in a slot, never a token.
    assert hold.finished(s + 1).get(4) == "abort" and 4 not in after.waiting
    assert all(4 not in report.occupants for report in hold.reports[s + 1:])
    assert read_w == [(None, "abort")] and streams[4].completion.tokens == []
    # F: cancelled after it had finished, nothing happens.
    assert read_f[-1][1] == "length" and streams[1].completion.finish_reason == "length"
    assert [i for report in hold.reports for i in dict(report.finished)].count(1) == 1
    # Everyone else: the reference's tokens, whoever was cancelled beside them.
    for n in (1, 2, 3, 5, 6):
        got = streams[n].completion
        assert (got.tokens, got.finish_reason) == (want[n].tokens, want[n].finish_reason), f"request {n} ({cache})"
        assert tokens_of(read[n]) == want[n].tokens
    if pools:  # paged: V's blocks back to the free list at once (or taken by that very step's work)
        [pool], v_blocks = pools, before.block_tables[slot]
        tables_before = {i: table for i, table in zip(before.occupants, before.block_tables) if i is not None}
        taken_afresh = {block for i, table in zip(after.occupants, after.block_tables) if i is not None
                        for block in table if block not in tables_before.get(i, [])}  # by a request, in step s + 1
        assert set(v_blocks) <= set(free_blocks[s + 1]) | taken_afresh, f"V's blocks {v_blocks} not freed"
        assert sorted(pool.free_blocks) == list(range(options["kv_blocks"])) and pool.holders == [], "a block leaked"
    if cache == "paged, preempting":
        assert any(report.preempted for report in hold.reports), "the pool is not tight: nothing preempted"
    if options.get("prefix_cache"):  # V's two full blocks kept, and found by G
        assert set(v_blocks[:2]) <= set(after.cached_free), f"V's full blocks {v_blocks[:2]} not kept"
        [found] = [report.found_cached[report.admitted.index(6)] for report in hold.reports if 6 in report.admitted]
        assert found == 8, f"G found {found} positions cached, not V's 8"


def test_a_cancel_at_the_prefill_worker_waits_for_the_handover(gpt, monkeypatch):
    """Disaggregated, V is cancelled while the worker holds its prompt (the test keeps it there until a
    step has run after the cancel). V stays in its slot, its keys on their way, for as long as the
    worker has it; the worker hands it back with its first token, which V's stream gets; V leaves at the
    next boundary, told "abort". A, decoding beside it all along, makes the reference's tokens."""
    rng = random.Random(8)
    requests = [Request(random_prompt(rng, 3), 20), Request(random_prompt(rng, 6), 8, 0.8, seed=4)]  # A, V
    worker_may_go, forward_packed = threading.Event(), GPT.forward_packed

    def held_worker(model, step, cache):
        if on_worker() and step.tokens.tolist() == requests[1].prompt:
            assert worker_may_go.wait(TIMEOUT_S), "the worker was never let go"
        return forward_packed(model, step, cache)

    monkeypatch.setattr(GPT, "forward_packed", held_worker)
    hold, a_step_after = Held(lambda report: 1 in report.at_worker), threading.Event()

    def on_step(report):
        hold(report)
        if hold.held is not None and report.step > hold.held.step:
            a_step_after.set()  # a step has run since the cancel, V still at the worker

    def serve():
        with LiveRequests(gpt, n_slots=2, disaggregate=True, on_step=on_step, **LIVE) as live:
            streams = [live.submit(request) for request in requests]
            hold.wait()
            streams[1].cancel()
            hold.release()
            assert a_step_after.wait(TIMEOUT_S), "no step ran after the cancel"
            worker_may_go.set()
            return [list(stream) for stream in streams]

    before = engine_threads()  # none, unless a test before this one hung
    read = ends_within(TIMEOUT_S, serve)
    assert engine_threads() <= before, "the engine's thread or the prefill worker outlived the with"
    cancelled_at = hold.held.step
    [handed_over] = [report.step for report in hold.reports if 1 in report.handed_over]
    [left] = [report.step for report in hold.reports if 1 in dict(report.finished)]
    assert handed_over > cancelled_at and left == handed_over + 1, (cancelled_at, handed_over, left)
    assert all(1 in report.occupants for report in hold.reports[cancelled_at:left])  # in its slot till then
    assert 1 not in hold.reports[left].occupants
    want = reference(gpt, requests)
    assert read[1] == [(want[1].tokens[0], None), (None, "abort")]
    assert tokens_of(read[0]) == want[0].tokens


def test_many_cancelled_at_once_and_one_just_submitted(gpt):
    """Eight requests on three slots, held between steps: seven threads cancel seven of them at once, and
    the test's thread submits a ninth and cancels it at once. The next step, all eight leave, told
    "abort": the ninth with no token and no times, never in a slot. The one left makes the reference's
    tokens."""
    rng = random.Random(9)
    requests = [Request(random_prompt(rng, rng.randint(1, 8)), 2 * MAX_LEN, 0.8, seed=i) for i in range(9)]
    hold, survivor = Held(lambda report: len(report.waiting) == 5), 2

    def serve():
        with LiveRequests(gpt, n_slots=3, on_step=hold, **LIVE) as live:
            streams = submit_at_once(live, requests[:8])
            held_at = hold.wait().step
            all_at_once = threading.Barrier(7)
            cancellers = [threading.Thread(target=lambda s=stream: (all_at_once.wait(TIMEOUT_S), s.cancel()))
                          for n, stream in enumerate(streams) if n != survivor]
            for thread in cancellers:
                thread.start()
            streams.append(live.submit(requests[8]))
            streams[8].cancel()
            for thread in cancellers:
                thread.join(TIMEOUT_S)
            hold.release()
            return held_at, [list(stream) for stream in streams], streams

    held_at, read, streams = ends_within(TIMEOUT_S, serve)
    aborted = {n for n in range(9) if n != survivor}
    assert survivor in hold.held.occupants and len(hold.held.waiting) == 5
    assert {i for i, reason in hold.finished(held_at + 1).items() if reason == "abort"} == aborted
    assert all(read[n][-1] == (None, "abort") for n in aborted)
    just_submitted = streams[8].completion
    assert read[8] == [(None, "abort")] and just_submitted.tokens == [] and just_submitted.admit_step is None
    assert (just_submitted.ttft_s, just_submitted.latency_s, just_submitted.token_times_s) == (None, None, [])
    assert all(8 not in report.occupants for report in hold.reports)
    assert tokens_of(read[survivor]) == reference(gpt, [requests[survivor]])[0].tokens


def test_a_step_whose_only_arrival_is_cancelled(gpt):
    """A one-token request's step is held; meanwhile B is submitted and cancelled. The next step takes B
    in and lets it go at once: a step with nothing to feed and no forward to show. C, submitted after,
    is served as ever."""
    rng = random.Random(10)
    requests = [Request(random_prompt(rng, 4), 1), Request(random_prompt(rng, 4), 5), Request(random_prompt(rng, 5), 6)]
    hold = Held(lambda report: report.step == 0)

    def serve():
        with LiveRequests(gpt, n_slots=2, on_step=hold, **LIVE) as live:
            streams = [live.submit(requests[0])]
            hold.wait()
            streams.append(live.submit(requests[1]))
            streams[1].cancel()
            hold.release()
            read_b = list(streams[1])
            streams.append(live.submit(requests[2]))
            return [list(streams[0]), read_b, list(streams[2])]

    read = ends_within(TIMEOUT_S, serve)
    assert read[1] == [(None, "abort")]
    [step_1] = [report for report in hold.reports if report.step == 1]
    assert hold.finished(1) == {1: "abort"} and step_1.packed is None and step_1.sampled == []
    want = reference(gpt, requests)
    assert [tokens_of(read[n]) for n in (0, 2)] == [want[0].tokens, want[2].tokens]


# ---------------------------------------------------------------------------------------------
# 3) Idle


@pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="reads a thread's CPU clock (Unix only)")
def test_an_idle_engine_blocks_and_wakes_for_a_submission(gpt):
    """The engine's own CPU time, read from its thread's clock, hardly moves over 0.3 s idle, before a
    request and after one (a loop that polled would burn most of it, even on a busy machine's share);
    a submission wakes it, and it serves the request."""
    request = Request([1, 2, 3], 6)

    def idle_cpu_s(engine):  # the engine's CPU seconds over 0.3 s of the test's sleep
        clock = time.pthread_getcpuclockid(engine.ident)
        start = time.clock_gettime(clock)
        time.sleep(0.3)  # the time measured over, not a synchronization
        return time.clock_gettime(clock) - start

    def serve():
        others = engine_threads()  # none, unless a test before this one hung
        with LiveRequests(gpt, n_slots=2, **LIVE) as live:
            [engine] = engine_threads() - others
            before = idle_cpu_s(engine)
            read = list(live.submit(request))
            after = idle_cpu_s(engine)
        return before, read, after

    before, read, after = ends_within(TIMEOUT_S, serve)
    # Blocked, it measured about 0.00005 s; a poll burns what share of a core it gets (0.08 s of 0.3 on
    # the shared two cores, busy; 0.3 idle): 0.01 s lies far from both.
    assert before < 0.01 and after < 0.01, f"idle, the engine used {before:.4f} s and {after:.4f} s of CPU in 0.3 s"
    assert tokens_of(read) == reference(gpt, [request])[0].tokens


# ---------------------------------------------------------------------------------------------
# 4) A clean stop


def test_close_drains_then_refuses(gpt):
    """close() waits for every request submitted to finish as it would have; then a submission raises
    RuntimeError, and no engine thread is left."""
    requests = random_workload(seed=11, n_requests=6)

    def serve():
        with LiveRequests(gpt, n_slots=2, **LIVE) as live:
            streams = [live.submit(request) for request in requests]
            live.close()
            with pytest.raises(RuntimeError, match="closed"):
                live.submit(requests[0])
        return [stream.completion for stream in streams], [list(stream) for stream in streams]

    before = engine_threads()  # none, unless a test before this one hung
    got, read = ends_within(TIMEOUT_S, serve)
    assert engine_threads() <= before, "the engine's thread outlived the with"
    assert first_difference(got, reference(gpt, requests)) == ""
    assert [tokens_of(items) for items in read] == [c.tokens for c in got]


@pytest.mark.parametrize("how", ["close(abort=True)", "an exception in the with"])
def test_an_abort_ends_every_request_in_flight(gpt, how):
    """Two requests in slots, three waiting, two submitted while the step is held: the engine closed with
    abort (or left by an exception, raised again by the `with`), every one of them ends at the next
    boundary, told "abort" as its last item; those in a slot keep the reference's first tokens. A
    submission after raises RuntimeError; no engine thread is left."""
    rng = random.Random(12)
    requests = [Request(random_prompt(rng, 2), 2 * MAX_LEN, 0.8, seed=i) for i in range(7)]
    hold = Held(lambda report: len(report.waiting) == 3, until_closed=True)

    streams, read = [], []

    def serve():
        try:
            with LiveRequests(gpt, n_slots=2, on_step=hold, **LIVE) as live:
                hold.live = live  # before any submission: the engine waits for one
                streams.extend(submit_at_once(live, requests[:5]))
                hold.wait()
                streams.extend(live.submit(request) for request in requests[5:])  # not taken in yet
                if how == "close(abort=True)":
                    live.close(abort=True)
                else:
                    raise KeyError("the caller's own error")
        finally:  # read here, where a stream that never ends fails the test and hangs nothing
            read.extend(list(stream) for stream in streams)

    before = engine_threads()  # none, unless a test before this one hung
    if how == "close(abort=True)":
        ends_within(TIMEOUT_S, serve)
    else:
        with pytest.raises(KeyError, match="the caller's own error"):
            ends_within(TIMEOUT_S, serve)
    assert engine_threads() <= before, "the engine's thread outlived the with"
    held_at = hold.held.step
    assert hold.finished(held_at + 1) == {n: "abort" for n in range(7)}, hold.finished(held_at + 1)
    assert len(hold.reports) == held_at + 2, "steps ran after the abort"
    want = reference(gpt, requests[:2])
    for n, (stream, items) in enumerate(zip(streams, read)):
        assert items[-1] == (None, "abort") and all(reason is None for _, reason in items[:-1]), n
        assert (len(items) > 1) == (n < 2), f"request {n}: {len(items) - 1} tokens, in a slot {n < 2}"
        assert n >= 2 or tokens_of(items) == want[n].tokens[:len(items) - 1], n
        assert (stream.completion.tokens, stream.completion.finish_reason) == (tokens_of(items), "abort")
    with pytest.raises(RuntimeError, match="closed"):
        hold.live.submit(requests[0])


def test_an_engine_error_reaches_every_reader_and_the_with(gpt, monkeypatch):
    """The forward fails on its fourth call, once the test has submitted a third request as it runs: the
    error is raised in each thread that reads a stream (the request in the slot, one waiting, one not
    taken in yet), by the `with`, and by a submission after it; no engine thread is left."""
    forward_packed, n_forwards, failing_now, go = GPT.forward_packed, [0], threading.Event(), threading.Event()

    def failing(model, step, cache):
        n_forwards[0] += 1
        if n_forwards[0] == 4:
            failing_now.set()
            assert go.wait(TIMEOUT_S), "the test never let the forward fail"
            raise RuntimeError("the engine caught fire")
        return forward_packed(model, step, cache)

    monkeypatch.setattr(GPT, "forward_packed", failing)
    rng = random.Random(13)
    requests = [Request(random_prompt(rng, 3), 20) for _ in range(3)]
    raised, live = {}, []

    def read(n, stream):
        try:
            list(stream)
        except RuntimeError as error:
            raised[n] = error

    def serve():
        with LiveRequests(gpt, n_slots=1, **LIVE) as started:
            live.append(started)
            streams = [started.submit(request) for request in requests[:2]]
            assert failing_now.wait(TIMEOUT_S), "the fourth forward never came"
            streams.append(started.submit(requests[2]))  # the engine is in its forward: not taken in
            readers = [threading.Thread(target=read, args=(n, stream)) for n, stream in enumerate(streams)]
            for thread in readers:
                thread.start()
            go.set()
            for thread in readers:
                thread.join(TIMEOUT_S)

    before = engine_threads()  # none, unless a test before this one hung
    with pytest.raises(RuntimeError, match="caught fire") as error:
        ends_within(TIMEOUT_S, serve)
    assert engine_threads() <= before, "the engine's thread outlived the with"
    assert sorted(raised) == [0, 1, 2] and all(e is error.value for e in raised.values()), raised
    with pytest.raises(RuntimeError, match="closed") as refused:
        live[0].submit(requests[0])
    assert refused.value.__cause__ is error.value


@pytest.mark.parametrize("options, error", [
    (dict(n_slots=0), ValueError), (dict(kv_block_size=8), ValueError), (dict(policy="fastest"), ValueError),
    (dict(slots=2), TypeError)], ids=["n_slots=0", "kv_block_size without kv_blocks", "policy", "unknown option"])
def test_bad_options_raise_as_the_with_starts(gpt, options, error):
    """Options generate would refuse are raised by the `with` statement itself, before its body runs
    (TypeError for an option generate does not take), and no engine thread is left."""
    entered = []

    def serve():
        with LiveRequests(gpt, **{**LIVE, **options}):
            entered.append(True)

    before = engine_threads()  # none, unless a test before this one hung
    with pytest.raises(error):
        ends_within(TIMEOUT_S, serve)
    assert entered == [] and engine_threads() <= before


def test_a_bad_request_raises_at_submit_and_the_others_go_on(gpt):
    """A request generate would refuse raises ValueError in the submitting thread, naming what is wrong;
    the engine goes on serving the good one with the reference's tokens."""
    good = Request([1, 2, 3], 5)
    bad = [(Request([], 4), "prompt"), (Request([V], 4), "prompt"), (Request([1] * MAX_LEN, 1), "no room"),
           (Request([1], 0), "max_new_tokens"), (Request([1], 4, temperature=-1.0), "temperature"),
           ("hello", "must be a Request"), (Request([1] * 10, 20), "kv_blocks=1 cannot hold"),
           (Request([1], 4, ignore_eos=1), "ignore_eos must be True or False")]

    def serve():
        with LiveRequests(gpt, n_slots=2, kv_blocks=1, kv_block_size=16, **LIVE) as live:
            stream = live.submit(good)
            for request, message in bad:
                with pytest.raises(ValueError, match=message):
                    live.submit(request)
            return list(stream)

    assert tokens_of(ends_within(TIMEOUT_S, serve)) == reference(gpt, [good])[0].tokens


def test_on_item_takes_each_item_in_the_engine_thread(gpt):
    """submit(request, on_item): each item goes to on_item instead of the Stream's queue, in order, called in the
    engine's thread in the step that samples the token (an event loop's call_soon_threadsafe, in tools/serve.py);
    the queue stays empty, and the tokens are the reference's. Two requests on one slot: the second waits its turn."""
    requests = [Request([1, 2, 3], 4), Request([4, 5], 3, temperature=0.9, seed=7)]
    got = [[], []]

    def serve():
        with LiveRequests(gpt, n_slots=1, **LIVE) as live:
            streams = [live.submit(request, on_item=lambda item, n=n: got[n].append(
                (item, threading.current_thread().name))) for n, request in enumerate(requests)]
        return streams

    streams = ends_within(TIMEOUT_S, serve)  # the with drains: every item was handed over
    for n, (stream, want) in enumerate(zip(streams, reference(gpt, requests))):
        items = [item for item, _ in got[n]]
        assert {thread for _, thread in got[n]} == {ENGINE}, "on_item called outside the engine's thread"
        assert items == [(token, None) for token in want.tokens[:-1]] + [(want.tokens[-1], "length")], n
        assert stream.items.empty() and stream.completion.tokens == want.tokens
