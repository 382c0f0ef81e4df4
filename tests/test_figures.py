"""
The figures nanobatch reports (summarize's table, the belt line, the time to first token, a seed's
draws), each pinned against a schedule worked out by hand, or torch's own sampler.
"""
from types import SimpleNamespace

import pytest
import torch

import nanobatch
from model import GPT
from nanobatch import Request, generate
from tests.common import MAX_LEN, random_workload, tiny_gpt


# ---------------------------------------------------------------------------------------------
# The figures, on a schedule small enough to check by hand


def step(belt, n_running, n_prefilling, n_waiting, step_s, kv_used, handed_over=(), kv_bytes=0, kv_s=0.0):
    """A stand-in for a StepReport: what summarize reads. The model's share of a step is 4/5 of it;
    the cache is 2 slots of max_len 10, 20 positions."""
    return SimpleNamespace(belt=belt, n_running=n_running, n_prefilling=n_prefilling, n_waiting=n_waiting,
                           step_s=step_s, model_s=0.8 * step_s, handed_over=list(handed_over), kv_bytes=kv_bytes,
                           kv_s=kv_s, kv_used=kv_used, kv_total=20, preempted=[], found_cached=[], n_prompt_tokens=0,
                           evicted=None)  # evicted None: no prefix cache ran


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
# The cache, 20 positions: A's prompt is 3 tokens, B's 5 (2 in step 0, 3 in step 1), C's 2. After
# each step's forward, A + B + C hold 3 + 2 = 5, then 4 + 5 = 9, 0 + 6 + 2 = 8 (A has left), 7 + 3
# = 10, and 8 (C has left).
SCHEDULE = [step("A~", 1, 1, 0, 0.5, 5), step("AB", 2, 0, 1, 0.25, 9), step("CB", 2, 0, 0, 0.25, 8),
            step("CB", 2, 0, 0, 0.5, 10), step(".B", 1, 0, 0, 0.25, 8)]
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
        "KV cache in use": (0.4, 0.5),  # (5 + 9 + 8 + 10 + 8) / (5 x 20) = 40 / 100; the peak 10 / 20
        "preemptions": 0,  # per slot, none
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


def test_summarize_preemptions_by_hand():
    """Paged, the same schedule with B preempted in step 2 and again in step 3, and C in step 3: 3 in all."""
    preempted = [[], [], [1], [1, 2], []]
    paged = [SimpleNamespace(**{**vars(report), "preempted": ids}) for report, ids in zip(SCHEDULE, preempted)]
    assert nanobatch.summarize(ARRIVALS, SERVED, paged, wall_s=2.5)["preemptions"] == 3


def test_summarize_prefix_cache_hits_by_hand():
    """Part 4, the same schedule: A finds 16 positions cached at step 0 and feeds 4 prompt tokens; B
    finds none and feeds 12 over steps 1 and 2; C finds 32 and feeds 8 at step 3. Found 48 of the
    48 + 24 positions the admissions brought into the cache: 2/3. Without a hit, 0; with nothing fed, None."""
    found, fed = [[16], [0], [], [32], []], [4, 6, 6, 8, 0]
    hits = [SimpleNamespace(**{**vars(report), "found_cached": f, "n_prompt_tokens": n, "evicted": []})
            for report, f, n in zip(SCHEDULE, found, fed)]
    assert nanobatch.summarize(ARRIVALS, SERVED, hits, wall_s=2.5)["prefix cache hits"] == 48 / 72
    no_hit = [SimpleNamespace(**{**vars(report), "n_prompt_tokens": n, "evicted": []})
              for report, n in zip(SCHEDULE, fed)]
    assert nanobatch.summarize(ARRIVALS, SERVED, no_hit, wall_s=2.5)["prefix cache hits"] == 0
    assert nanobatch.summarize(ARRIVALS, SERVED, SCHEDULE, wall_s=2.5)["prefix cache hits"] is None


def test_summarize_a_run_cut_short():
    """Ctrl-C after step 2: B and C were still running, and their tokens count all the same."""
    figures = nanobatch.summarize(ARRIVALS, [SERVED[0], None, None], SCHEDULE[:3], wall_s=1.0)
    assert figures["generated tokens"] == 5  # A's 2, B's first 2, C's first 1
    assert figures["mean occupancy"] == 1.0  # 6 busy slots of 3 x 2
    assert figures["latency P50/P99 (steps)"] == (2, 2)  # A alone finished
    assert figures["tokens/s"] == 5.0

# ---------------------------------------------------------------------------------------------
# The figures a reader reads, pinned against schedules worked by hand and torch's own draw
#
# The belt line, the time to first token and a seed's draws: each is checked
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


def test_positions_in_use_count_a_shared_block_once():
    """StepReport.kv_used, by hand. Paged, blocks of 4: A holds blocks 0 and 1 with 6 positions written
    (4 + 2), B shares block 0 and holds block 2 with 5 written (4 + 1): 4 + 2 + 1 = 7 positions, not
    the 11 its requests count. Per slot, each slot's block is its n_cached: 3 + 0 + 9."""
    a = SimpleNamespace(block_table=[0, 1], n_cached=6)
    b = SimpleNamespace(block_table=[0, 2], n_cached=5)
    assert nanobatch.positions_in_use([a, None, b], block_size=4) == 7
    slots = [SimpleNamespace(block_table=[0], n_cached=3), None, SimpleNamespace(block_table=[2], n_cached=9)]
    assert nanobatch.positions_in_use(slots, block_size=16) == 12


def test_kv_used_after_counts_what_the_next_step_finds():
    """StepReport.kv_used_after (the server's kv_cache_usage_perc): the positions of the requests still in a
    slot once phase 7 has retired the step's finished ones. Per slot nothing is shared, so it is the sum of the
    n_cached of the slots whose occupant did not finish, by hand; the requests' prompts run past a head's
    count of positions, so a block size read off the wrong axis of the cache shows."""
    reports, model = [], tiny_gpt()
    generate(model, random_workload(seed=3, n_requests=8), n_slots=3, max_len=MAX_LEN, eos_id=None,
             on_step=reports.append)
    assert any(n > model.config.n_head for report in reports for n in report.n_cached)
    for report in reports:
        finished = {index for index, _ in report.finished}
        assert report.kv_used_after == sum(n for who, n in zip(report.occupants, report.n_cached)
                                           if who is not None and who not in finished), report.step
    assert reports[-1].kv_used_after == 0
