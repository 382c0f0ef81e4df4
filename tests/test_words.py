"""
The words of Parts 3 and 4, each rule pinned by a run that it predicts. The README says the rules of
the paged cache and of the prefix cache in short, docs/api.md in full: which block a step takes, who
is admitted (blocks found count as held, a kept block found is not free, room to grow only beside
others), when blocks are keyed, what a preempted request does when it comes back, and what the
StepReport's fields hold. docs/api.md works one run by hand, paged and prefix-cached, with a
preemption and a comeback, and sets a second to predict, chunked, with refusals, a preemption and
evictions: a test holds every cell of each table to the engine's reports, so that the text cannot
drift from the code. The other runs are worked out here, each in a comment that reads the rule it
pins, on two slots, eos_id=None (each request makes exactly its tokens), a tiny model.
"""
import inspect
import io
import re
import threading
from contextlib import redirect_stdout

import pytest

import nanobatch
from nanobatch import (LiveRequests, Request, generate, generate_sequential, letter, print_step, print_table,
                       summarize)
from tests.common import MAX_LEN, REPO, TIMEOUT_S, tiny_gpt

# ---------------------------------------------------------------------------------------------
# The runs, and their steps as tables: a column per field, `-` for none; a request by its letter;
# block tables a string of block ids per slot, '/' between; events as the belt prints them.


def served(requests, **options):
    """generate on two slots, eos_id=None, every report kept -> (completions, reports, the lines printed)."""
    reports, printed = [], io.StringIO()

    def on_step(report):
        reports.append(report)
        with redirect_stdout(printed):
            print_step(report)

    completions = generate(tiny_gpt(), requests, n_slots=2, max_len=MAX_LEN, eos_id=None, on_step=on_step, **options)
    return completions, reports, printed.getvalue().splitlines()


def events(line):
    """The events print_step printed after the belt and the queue: '-' for none."""
    return line.split("waiting")[1].split(maxsplit=1)[1] if len(line.split("waiting")[1].split()) > 1 else "-"


def as_printed(report, line):
    """A report's fields as this file's tables spell them."""
    def letters(indices):
        return "".join(letter(i) for i in indices) or "-"

    def blocks(block_ids):
        return "".join(str(block) for block in block_ids) or "-"

    return dict(step=str(report.step), belt=report.belt, events=events(line),
                block_tables="/".join(blocks(table) for table in report.block_tables),
                cached_free=blocks(report.cached_free), evicted=blocks(report.evicted or []),
                waiting=letters(report.waiting), prompt_tokens=str(report.n_prompt_tokens),
                kv_used=str(report.kv_used), kv_kept=str(report.kv_kept),
                found_cached=",".join(str(n) for n in report.found_cached) or "-")


def table_rows(table):
    """A table of this file or of docs/api.md -> [{column: cell}], its cells split by two spaces or more."""
    header, *lines = [line for line in table.strip("\n").splitlines() if line.strip()]
    columns = header.split()
    return [dict(zip(columns, re.split(r"\s{2,}", line.strip()))) for line in lines]


def check_against(table, reports, lines):
    """Every step of the table is the run's, cell by cell, and the run took no other step."""
    wanted = table_rows(table)
    assert [row["step"] for row in wanted] == [str(report.step) for report in reports], "the steps the run took"
    for want, report, line in zip(wanted, reports, lines):
        got = {column: as_printed(report, line)[column] for column in want}
        assert got == want, f"step {report.step}:\n  got  {got}\n  want {want}"


# ---------------------------------------------------------------------------------------------
# docs/api.md's run worked by hand: two requests sharing five blocks, a preemption and a comeback

SHARED = list(range(100, 120))  # 20 tokens: five full blocks of 4
WORKED = [Request(SHARED + [1], 8), Request(SHARED + [2], 6, arrival=1)]
WORKED_OPTIONS = dict(kv_blocks=8, kv_block_size=4, prefix_cache=True)


def worked_table():
    """The table of docs/api.md's section "A paged, prefix-cached run, worked by hand"."""
    text = (REPO / "docs" / "api.md").read_text()
    section = text[text.index("### A paged, prefix-cached run, worked by hand"):]
    start = section.index("```text\n") + len("```text\n")
    return section[start:section.index("\n```", start)]


@pytest.fixture(scope="module")
def worked():
    return served(WORKED, **WORKED_OPTIONS)


def test_the_run_worked_in_docs_api_is_the_engines(worked):
    """Every cell of docs/api.md's table is the engine's: the belt, the events printed after it (B
    preempted at step 5 as `!B`, found 20 positions, then 24), each slot's blocks, the kept and the
    evicted blocks, the queue, the prompt tokens fed, kv_used and kv_kept."""
    _, reports, lines = worked
    check_against(worked_table(), reports, lines)


def test_a_comeback_that_finds_all_it_had_decodes_at_once(worked):
    """B, preempted at step 5 with positions 0 to 23 in whole blocks, comes back at step 8, finds
    them all (0 to 4 shared with A, kept; 6 its own, kept) and feeds only its newest token: one row,
    at position 24, a one-token row, sampled; no '~' on the belt and no prompt token. Its answer is
    still the reference's."""
    completions, reports, _ = worked
    comeback = reports[8]
    assert (comeback.admitted, comeback.found_cached, comeback.belt, comeback.n_prompt_tokens) == ([1], [24], "B.", 0)
    packed = comeback.packed
    assert (packed.positions.tolist(), packed.slots.tolist(), packed.n_one_token) == ([24], [0], 1)
    assert comeback.sampled == [1]
    reference = generate_sequential(tiny_gpt(), WORKED, max_len=MAX_LEN, eos_id=None)
    assert [c.tokens for c in completions] == [c.tokens for c in reference]


def test_finish_step_is_the_step_of_the_last_token_after_a_preemption(worked):
    """B made tokens at steps 1 to 4, was preempted at 5, came back at 8 and ended at 9: finish_step
    is 9, the step of its last token (first_token_step + len(tokens) - 1 would say 6); admit_step
    its first admission, slot its last."""
    completions, reports, _ = worked
    b = completions[1]
    steps_sampled = [report.step for report in reports if 1 in report.sampled]
    assert steps_sampled == [1, 2, 3, 4, 8, 9]
    assert (b.finish_step, b.first_token_step, len(b.tokens), b.admit_step, b.slot) == (9, 1, 6, 1, 0)


def test_prefix_cache_hits_count_a_comeback_finding_its_own_blocks(worked):
    """The figures' hits: 20 positions found at B's admission and 24 at its comeback, of those and
    the 21 + 1 prompt tokens fed: 44 of 66. A preempted request's own blocks count."""
    completions, reports, _ = worked
    assert summarize(WORKED, completions, reports, wall_s=1.0)["prefix cache hits"] == 44 / 66


def test_a_refused_admission_leaves_n_found_as_its_last_admission(worked, monkeypatch):
    """B's tries at steps 6 and 7 find 24 positions and are refused: its n_found stays 20, what it
    found at its last admission (step 1), and is 24 only once the comeback is admitted."""
    seen, admit = [], nanobatch.PrefixCache.admit

    def noting(pool, run, slot, belt):
        admitted = admit(pool, run, slot, belt)
        seen.append((run.request_index, admitted, run.n_found))
        return admitted

    monkeypatch.setattr(nanobatch.PrefixCache, "admit", noting)
    served(WORKED, **WORKED_OPTIONS)
    assert seen == [(0, True, 0), (1, True, 20), (1, False, 20), (1, False, 20), (1, True, 24)]


def test_each_blocks_key_is_made_once(worked, monkeypatch):
    """A block's key, (its parent's key, its tokens), is made once for its request (Running.block_keys), and
    kept with it: not again at each admission for every request in a slot, nor at each try of a request
    refused, nor when a preempted one comes back. In docs/api.md's run: A's 7 full blocks; B's 5 looked up
    at step 1 and its sixth as it was preempted; none at its tries, steps 6, 7 and 8: 13 keys, each one
    tuple of tokens. Made again at each of B's tries, they were 31; at each admission for the belt, 64."""
    made = []
    monkeypatch.setattr(nanobatch, "tuple", lambda tokens: made.append(tokens) or tuple(tokens), raising=False)
    served(WORKED, **WORKED_OPTIONS)
    assert len(made) == 7 + 5 + 1


def test_a_request_refused_for_many_steps_keys_its_prompt_once(monkeypatch):
    """A (4 tokens, 20 to make) holds a pool of 14 blocks of 2 while B (25 tokens: 12 full blocks before its
    last one) is refused at every step from 1 to 19: B's 12 keys are made at its first try and kept with
    it (dropped at each refusal, they were made at every try: 19 x 12 = 228). The pool keeps nothing of a
    request that waits, its keys being the request's own: one that leaves the queue (Part 5: cancelled)
    leaves nothing in the cache to forget."""
    made_for_b, refusals = [], []
    keys, admit = nanobatch.PrefixCache.keys, nanobatch.PrefixCache.admit

    def counting(pool, run, n_blocks):  # the keys made for B: those its list lacked before the call
        n_before = len(run.block_keys)
        found = keys(pool, run, n_blocks)
        made_for_b.extend(run.block_keys[n_before:] if run.request_index == 1 else [])
        return found

    def noting(pool, run, slot, belt):
        n_before = len(made_for_b)
        admitted = admit(pool, run, slot, belt)
        if not admitted:  # keys made at this try; the pool's per-request counts: only those in a slot
            refusals.append((len(made_for_b) - n_before, set(pool.n_keyed) == {0}))
        return admitted

    monkeypatch.setattr(nanobatch.PrefixCache, "keys", counting)
    monkeypatch.setattr(nanobatch.PrefixCache, "admit", noting)
    requests = [Request(list(range(1, 5)), 20), Request(list(range(100, 125)), 2, arrival=1)]
    _, reports, _ = served(requests, kv_blocks=14, kv_block_size=2, prefix_cache=True)
    assert [report.step for report in reports if report.waiting == [1]] == list(range(1, 20))
    assert refusals == [(12, True)] + [(0, True)] * 18, refusals
    assert len(made_for_b) == 12 + 1  # and its 13th block's key, made as it retires


def second_run_section():
    """docs/api.md's section "A second run: predict it before you read on", up to the next heading."""
    text = (REPO / "docs" / "api.md").read_text()
    section = text[text.index("### A second run: predict it before you read on"):]
    return section[:section.index("\n## ")]


def test_the_second_run_in_docs_api_is_the_engines(monkeypatch):
    """docs/api.md's exercise, run as its own code block says (generate's call recorded, then run with
    every report kept): every cell of its table, the Completions and the prefix cache hits it states."""
    section = second_run_section()
    code = section[section.index("```python\n") + len("```python\n"):section.index("\n```", section.index("```python"))]
    calls = []
    monkeypatch.setattr(nanobatch, "generate", lambda model, requests, **options: calls.append((requests, options)))
    exec(code, {})
    [(requests, options)] = calls
    monkeypatch.undo()
    reports, printed = [], io.StringIO()

    def on_step(report):
        reports.append(report)
        with redirect_stdout(printed):
            print_step(report)

    completions = generate(tiny_gpt(), requests, **dict(options, on_step=on_step))
    start = section.index("```text\n") + len("```text\n")
    check_against(section[start:section.index("\n```", start)], reports, printed.getvalue().splitlines())
    c = completions[2]
    says = " ".join(section.split())
    assert f"`admit_step` {c.admit_step}, `finish_step` {c.finish_step}, `slot` {c.slot}" in says
    hits = summarize(requests, completions, reports, wall_s=1.0)["prefix cache hits"]
    assert f"16 of 39, {hits:.0%}" in says and hits == 16 / 39
    assert [len(c.tokens) for c in completions] == [request.max_new_tokens for request in requests]
    reference = generate_sequential(tiny_gpt(), requests, max_len=options["max_len"], eos_id=None)
    assert [c.tokens for c in completions] == [c.tokens for c in reference]


# ---------------------------------------------------------------------------------------------
# Admission: blocks found count as held, a kept block found is not free, room to grow beside others

# A ([1, 2, 5], 1 token) runs alone at step 0 in a pool of 5 blocks of 2 and leaves: its full block
# 0 ([1, 2]) is kept, at the back of the line, its part-full block 1 wiped, at the front (1 2 3 4 0).
# B ([7, 8], 6 tokens) comes at step 1, alone: it takes block 1. C ([1, 2, 9], 1 token) comes at
# step 2: it finds block 0, kept, and takes it out of the line, which keeps 2, 3, 4. It lacks 3 - 1 =
# 2 blocks for its 3 tokens and 3 more, B 3 - 1 = 2 for its 3 and 3 more: 4, and 3 are free: refused
# (a kept block found is not free: counted free, 4 would be; without room to grow, 1 + 1 would do).
# It lets block 0 go, back to the line. So each step, B growing, until B ends at step 6. At step 7 C,
# alone, finds block 0 (2 positions) and lacks 2 - 1 = 1: admitted. Its third position takes the
# front of the line: block 4, B's part-full block, wiped and put at the front as B left (1, 2, 3,
# full, kept, joined the back): plain blocks are taken before kept ones.
ADMISSION = """
step  belt  events                   block_tables  cached_free  waiting  found_cached
   0  A.    +A -A(length,1)          01/-          -            -        0
   1  B.    +B                       1/-           0            -        0
   2  B.    -                        12/-          0            C        -
   3  B.    -                        12/-          0            C        -
   4  B.    -                        123/-         0            C        -
   5  B.    -                        123/-         0            C        -
   6  B.    -B(length,6)             1234/-        0            C        -
   7  C.    +C(2 found) -C(length,1)  04/-          123          -        2
"""


def test_admission_counts_found_blocks_as_held_and_kept_ones_as_not_free():
    """The admission rule as docs/api.md and the README word it, on a run where a kept block found
    decides: refused while B runs, admitted alone, with what it found."""
    requests = [Request([1, 2, 5], 1), Request([7, 8], 6, arrival=1), Request([1, 2, 9], 1, arrival=2)]
    _, reports, lines = served(requests, kv_blocks=5, kv_block_size=2, prefix_cache=True)
    check_against(ADMISSION, reports, lines)


# Paged (Part 3, no prefix cache), 3 blocks of 4. A ([1, 2, 3, 4], 8 tokens) comes alone at step 0:
# it needs 1 block, with no room to grow, and takes block 0. B ([5, 6], 1 token) comes at step 1: A
# lacks 2 - 1 = 1 block for its 5 tokens and 3 more, B 2 for its 2 and 3 more: 3, and 2 are free:
# refused, and so until A ends at step 7 (without room to grow, 1 + 1 would do at step 1). A's
# blocks join the back of the line in table order (0, 1, 2): at step 8 B, alone, takes block 0.
ROOM = """
step  belt  events                   block_tables  waiting
   0  A.    +A                       0/-           -
   1  A.    -                        01/-          B
   2  A.    -                        01/-          B
   3  A.    -                        01/-          B
   4  A.    -                        01/-          B
   5  A.    -                        012/-         B
   6  A.    -                        012/-         B
   7  A.    -A(length,8)             012/-         B
   8  B.    +B -B(length,1)          0/-           -
"""


def test_room_to_grow_beside_others_and_none_alone():
    """Beside a request in a slot, each counts 3 tokens of room (B waits); onto an empty belt, none:
    a request whose whole sequence fills the pool exactly (7 tokens and 1 to make, 2 blocks of 4)
    is admitted, where 7 + 3 would need 3 blocks."""
    _, reports, lines = served([Request([1, 2, 3, 4], 8), Request([5, 6], 1, arrival=1)], kv_blocks=3,
                               kv_block_size=4)
    check_against(ROOM, reports, lines)
    completions, reports, _ = served([Request([1, 2, 3, 4, 5, 6, 7], 1)], kv_blocks=2, kv_block_size=4)
    assert reports[0].admitted == [0] and completions[0].tokens


# ---------------------------------------------------------------------------------------------
# Which block: the step's order, the front of the line; kept and evicted within one step

# A and B ([11..14], [21..24], 6 tokens each) come together into 4 blocks of 4: A alone needs 1
# block, then B beside A lacks 2, A 2 (for 4 tokens and 3 more): 4 free, both admitted. The step
# takes blocks in its order: A's prompt 0, B's 1; at step 1 both decode into position 4, A (request
# 0) first: A takes 2, B 3. At step 5 both reach position 8 and none is free: B, admitted last, is
# preempted; as it leaves, its blocks 1 and 3, full, are keyed and kept, joining the line in that
# order; A takes the front one, 1, kept a moment ago, now evicted: in no report's cached_free, in
# this step's evicted. A ends; B comes back at step 6 but finds nothing (its first block is gone)
# and feeds its 9 tokens again, evicting its own 3 and A's 0 after the plain 1 (A's part-full block).
KEPT_AND_EVICTED = """
step  belt  events                   block_tables  cached_free  evicted  waiting  kv_kept
   0  AB    +A +B                    0/1           -            -        -        0
   1  AB    -                        02/13         -            -        -        0
   2  AB    -                        02/13         -            -        -        0
   3  AB    -                        02/13         -            -        -        0
   4  AB    -                        02/13         -            -        -        0
   5  A.    -A(length,6) !B          021/-         3            1        B        4
   6  B.    +B -B(length,6)          130/-         2            30       -        4
"""


def test_a_block_kept_and_evicted_in_one_step_is_reported():
    """StepReport.evicted: the kept blocks a step's new work took, block 1 kept and evicted within
    step 5 among them; blocks taken in the step's order from the front of the line."""
    requests = [Request([11, 12, 13, 14], 6), Request([21, 22, 23, 24], 6)]
    _, reports, lines = served(requests, kv_blocks=4, kv_block_size=4, prefix_cache=True)
    check_against(KEPT_AND_EVICTED, reports, lines)


# A ([1, 2, 3]) and B ([4, 5, 6]), a token each, run alone at steps 0 and 1 and leave their first
# blocks kept: 0, then 1 (the line: 2 3 4 0 1). C ([7, 8], 6 tokens) comes at step 2 and takes 2.
# D ([1, 2, 9]) comes at step 3, finds 0 and is refused (it lacks 2, C 2, and 3 are free once 0 is
# out): it lets 0 go, to the back of the line, behind 1. The refusal reordered the kept blocks: at
# step 7 C needs a block when only kept ones are free, and evicts 1, not 0; at step 8 D, alone, still
# finds 0 (2 positions).
REORDER = """
step  belt  cached_free  evicted  waiting  found_cached
   0  A.    -            -        -        0
   1  B.    0            -        -        0
   2  C.    01           -        -        0
   3  C.    10           -        D        -
   4  C.    10           -        D        -
   5  C.    10           -        D        -
   6  C.    10           -        D        -
   7  C.    0            1        D        -
   8  D.    234          -        -        2
"""


def test_a_refused_admission_keys_blocks_and_reorders_the_kept_ones(monkeypatch):
    """A refused admission lets the kept blocks it found go again, to the back of the line, and so
    reorders them (least recently used first); it also keys what the requests in slots wrote: C's
    full block 2 ([7, 8]), keyed at D's first try, before C leaves."""
    keyed_at_refusal, admit = [], nanobatch.PrefixCache.admit

    def noting(pool, run, slot, belt):
        admitted = admit(pool, run, slot, belt)
        if not admitted:
            keyed_at_refusal.append(sorted(pool.key_of))
        return admitted

    monkeypatch.setattr(nanobatch.PrefixCache, "admit", noting)
    requests = [Request([1, 2, 3], 1), Request([4, 5, 6], 1, arrival=1), Request([7, 8], 6, arrival=2),
                Request([1, 2, 9], 1, arrival=3)]
    _, reports, lines = served(requests, kv_blocks=5, kv_block_size=2, prefix_cache=True)
    check_against(REORDER, reports, lines)
    assert keyed_at_refusal[0] == [0, 1, 2]


# ---------------------------------------------------------------------------------------------
# The rules a reader predicting by hand must hold exactly: room to grow, when a block is keyed, the
# order of blocks freed together, a prompt's last token fed alone, max_len's default, a cancel's step


@pytest.mark.parametrize("n_blocks, admitted", [(4, True), (3, False)])
def test_room_to_grow_is_ceil_of_n_plus_3_and_not_capped_by_what_is_left(n_blocks, admitted):
    """Admission counts ceil((n + 3) / block_size) blocks for n tokens, less those held, 3 tokens of room
    even when fewer are left to make. At step 1 A ([1, 2, 3, 4], 6 to make) has 5 tokens in block 0; B
    ([5, 6, 7]) wants 1 token. A lacks ceil(8 / 4) - 1 = 1, B ceil(6 / 4) = 2: 3. In 4 blocks (3 free) B
    is admitted, where ceil(n / 4) + ceil(3 / 4) would ask 2 + 2; in 3 blocks (2 free) it is refused,
    where room capped by B's 1 token left would ask 1 + 1."""
    _, reports, _ = served([Request([1, 2, 3, 4], 6), Request([5, 6, 7], 1, arrival=1)], kv_blocks=n_blocks,
                           kv_block_size=4)
    assert (reports[1].admitted == [1]) == admitted


# A and B ([1, 2, 3, 4, 5], the same prompt) come together into 8 blocks of 2, A to make 3 tokens, B 1:
# both admitted at step 0 (A alone lacks 3, then A 4 and B 4 with room: 8), their prompts computed
# twice, A's into 0 1 2, B's into 3 4 5. Nobody waits, so no admission is tried and nothing is keyed
# until B leaves at step 0: its full blocks 3 and 4 take the keys of [1, 2] and [3, 4] and join the
# back, kept; 5 (part-full), wiped, the front (the line: 5 6 7 3 4). A's position 6 takes 5 at step 2,
# and A leaves: its 0 and 1 stay plain (B's blocks hold their keys), 2 ([5, its first token]) is keyed.
# Its blocks go one by one in table order: 0 to the front, then 1 before it, 2 to the back, 5 to the
# front: 5 1 0 6 7 3 4 2. C ([7, 8, 9, 10, 11]) at step 3 finds nothing and takes 5, 1, 0: the plain
# ones, reversed.
FREED_TOGETHER = """
step  belt  events                   block_tables  cached_free
   0  AB    +A +B -B(length,1)       012/345       -
   1  A.    -                        012/-         34
   2  A.    -A(length,3)             0125/-        34
   3  C.    +C -C(length,1)          510/-         342
"""


def test_plain_blocks_freed_together_go_to_the_front_reversed():
    """A leaving request's blocks go one by one in table order: its plain ones, each to the front of the
    line, stand there reversed. And a block is keyed only at an admission tried or as its request
    leaves: nobody waiting, B's copy of the shared prompt leaves first and keeps the keys, A's stays plain."""
    requests = [Request([1, 2, 3, 4, 5], 3), Request([1, 2, 3, 4, 5], 1), Request([7, 8, 9, 10, 11], 1, arrival=3)]
    _, reports, lines = served(requests, kv_blocks=8, kv_block_size=2, prefix_cache=True)
    check_against(FREED_TOGETHER, reports, lines)


def test_a_prompts_last_token_fed_alone_is_a_prompt_token():
    """Chunks of 4: A's 5-token prompt goes in as 4, then its last token alone, a one-token row that
    samples, but a prompt token: counted in n_prompt_tokens, and first from the step's budget by arrival,
    so B (4 tokens, arriving at step 1) gets the other 3, and its own last token comes alone at step 2."""
    requests = [Request([1, 2, 3, 4, 5], 3), Request([6, 7, 8, 9], 2, arrival=1)]
    _, reports, _ = served(requests, prefill_chunk=4)
    steps = [(report.belt, report.n_prompt_tokens, report.packed.n_one_token, report.packed.tokens.numel())
             for report in reports[:3]]
    assert steps == [("~.", 4, 0, 4), ("A~", 4, 1, 4), ("AB", 1, 2, 2)], steps


def test_max_len_defaults_to_the_models_block_size():
    """docs/api.md: max_len's default is the model's block_size (the tiny model's 64), not 1024."""
    assert inspect.signature(generate).parameters["max_len"].default is None
    with pytest.raises(ValueError, match="max_len=64"):
        generate(tiny_gpt(), [Request([1] * 64, 1)], eos_id=None)
    [completion] = generate(tiny_gpt(), [Request([1] * 63, 5)], eos_id=None)  # 63 positions, then its slot is full
    assert (len(completion.tokens), completion.finish_reason) == (1, "context")
    assert "`max_len` is the most positions a request may fill, a slot's (`None`, the default: the model's " \
           "`block_size`" in " ".join((REPO / "docs" / "api.md").read_text().split())


def test_a_cancel_that_empties_the_belt_is_a_step_of_its_own():
    """Live (Part 5): A, alone, is cancelled after step 2. Step 3 lets it go and runs nothing (no forward,
    an empty belt, A in `finished`, "abort"), yet counts: A's finish_step is 3, and B, submitted once the
    loop waits, is admitted at step 4."""
    reports, held, go = [], threading.Event(), threading.Event()

    def on_step(report):
        reports.append(report)
        if report.step == 2:
            held.set()
            assert go.wait(TIMEOUT_S), "the test never let the engine go on"

    with LiveRequests(tiny_gpt(), n_slots=2, max_len=MAX_LEN, eos_id=None, on_step=on_step) as live:
        a = live.submit(Request([1, 2, 3], 20))
        assert held.wait(TIMEOUT_S), "step 2 never came"
        a.cancel()
        go.set()
        assert list(a)[-1] == (None, "abort")
        b = live.submit(Request([4, 5], 1))
        assert list(b)[-1][1] == "length"
    cancel_step = reports[3]
    assert (cancel_step.step, cancel_step.belt, cancel_step.packed, cancel_step.sampled) == (3, "..", None, [])
    assert [(i, c.finish_reason) for i, c in cancel_step.finished] == [(0, "abort")]
    assert (a.completion.finish_step, b.completion.admit_step) == (3, 4)


# ---------------------------------------------------------------------------------------------
# The StepReport's words, and the figures


def test_kv_kept_is_the_kept_blocks_positions_and_kv_used_leaves_them_out(worked):
    """kv_kept: kv_block_size positions for each block of cached_free. kv_used: the positions of the
    requests in slots, a shared block's once; with the kept ones, never more than the pool."""
    _, reports, _ = worked
    for report in reports:
        assert report.kv_kept == 4 * len(report.cached_free), f"step {report.step}"
        assert report.kv_used + report.kv_kept <= report.kv_total, f"step {report.step}"
    assert [report.kv_kept for report in reports] == [0] * 5 + [4] * 5


@pytest.mark.parametrize("options", [dict(), dict(kv_blocks=8, kv_block_size=4)], ids=["per slot", "paged"])
def test_without_a_prefix_cache_hits_print_a_dash(options):
    """Without a prefix cache, nothing is evicted (None) and the hits do not apply: '-', as any
    figure that does not apply; with one, a share ('67%' in docs/api.md's run)."""
    table = {}
    for name, prefix_options in (("without", options), ("with", WORKED_OPTIONS)):
        completions, reports, _ = served(WORKED, **prefix_options)
        table[name] = summarize(WORKED, completions, reports, wall_s=1.0)
        assert all((report.evicted is None) == (name == "without") for report in reports)
    printed = io.StringIO()
    with redirect_stdout(printed):
        print_table(table)
    [hits] = [line for line in printed.getvalue().splitlines() if line.startswith("prefix cache hits")]
    assert hits.split()[3:] == ["-", "67%"]


def test_the_legend_in_docs_api_is_the_tables():
    """docs/api.md lists each figure's meaning as nanobatch.LEGEND says it, word for word."""
    text = (REPO / "docs" / "api.md").read_text()
    section = text[text.index("## The figures of a run"):]
    section = section[:section.find("\n## ", 1) % (len(section) + 1)]  # up to the next section, if one follows
    listed = dict(re.findall(r"^- \*\*(.+?)\*\*: (.+)$", section, re.M))
    assert listed == nanobatch.LEGEND


class Drawn(Exception):
    """Raised in place of running the demo: its requests, as drawn."""


def test_the_demos_prompts_are_as_long_as_the_readme_says(monkeypatch):
    """The README: offline, the demo's prompts are 5 to 39 random tokens with seed 0 (each drawn from
    4 to 40). Its requests are drawn as `--demo --quick` draws them, then the run is stopped."""
    def stop(model, requests, *args, **kwargs):
        raise Drawn(requests)

    monkeypatch.setattr(nanobatch, "run_all", stop)
    with pytest.raises(Drawn) as drawn, redirect_stdout(io.StringIO()):
        nanobatch.main(["--demo", "--quick", "--quiet"])
    lengths = sorted(len(request.prompt) for request in drawn.value.args[0])
    assert (lengths[0], lengths[-1]) == (5, 39)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "with prompts of 5 to 39 random tokens (offline, seed 0;" in readme
