"""
Every StepReport, field by field, against a schedule worked by hand: the six requests of HAND_WORKED
(tests/common.py) on two slots, served continuous, static, paged in a pool that preempts, the same
pool with a prefix cache, and disaggregated with the worker's turns set by the test. The page draws
these fields (tests/test_page.py checks that it draws them as recorded); here the records themselves
are checked, so that a field that keeps a request a step too long, or drops it a step too soon, fails
where a reader would trust it.
"""
import threading

import pytest

from model import GPT
from nanobatch import generate
from tests.common import HAND_WORKED, TIMEOUT_S, ends_within, hand_worked_requests, on_worker, tiny_gpt


# ---------------------------------------------------------------------------------------------
# The schedules, worked by hand
#
# A (prompt of 3, 5 tokens), B (2, 6), C (3, 1) arrive at step 0; D (3, 2), E (1, 1), F (3, 1) at 10.
# A, C, D and F begin with the same two tokens (SYSTEM), which only the prefix cache makes use of.
# A column per field, named on the table's first line; a request by its letter; '-' an empty list;
# in `occupants` a letter per slot, '.' an empty one (as the belt prints it); n_cached a number per
# slot, ',' between; block_tables a table per slot, '/' between ('-' none); rows: the forward's rows
# ('-': no forward). Whole prompts (no prefill_chunk): a prompt goes in in one step, a chunk of its
# own, but a one-token feed (E's prompt; with the prefix cache, the last token of a prompt whose
# first block was found), a one-token row; the rows sampled, one-token rows first (decoding ones,
# then prompts), then chunks. (On two slots the cut always takes in every one-token row: one more
# attention call costs 150 keys, a longer cut here a few.)
#
# Continuous: A and B take both slots, their whole prompts in step 0, and C waits; A's fifth token,
# at step 4, is its last; at step 5 C takes A's slot, makes its one token, and B its sixth. The belt
# empty and nobody waiting, the clock jumps to step 10, when D, E and F arrive: D and E take the
# slots, E's one token comes first in the step (a one-token row), F waits for E's slot.
CONTINUOUS = """
step  belt  admitted  sampled  finished  occupants  waiting  n_cached  prompt_tokens  rows
   0  AB    AB        AB       -         AB         C        3,2       5              5
   1  AB    -         AB       -         AB         C        4,3       0              2
   2  AB    -         AB       -         AB         C        5,4       0              2
   3  AB    -         AB       -         AB         C        6,5       0              2
   4  AB    -         AB       A         AB         C        7,6       0              2
   5  CB    C         BC       BC        CB         -        3,7       3              4
  10  DE    DE        ED       E         DE         F        3,1       4              4
  11  DF    F         DF       DF        DF         -        4,3       3              4
"""
# Static: a slot refills only once the belt is empty. At step 5 slot 0 is free, but B still runs:
# C waits, and slot 0 computes a padding row for no one; at step 6 C goes in, slot 1 pads. So again
# at step 11, D still running: F waits for step 12.
STATIC = """
step  belt  admitted  sampled  finished  occupants  waiting  n_cached  prompt_tokens  rows
   0  AB    AB        AB       -         AB         C        3,2       5              5
   1  AB    -         AB       -         AB         C        4,3       0              2
   2  AB    -         AB       -         AB         C        5,4       0              2
   3  AB    -         AB       -         AB         C        6,5       0              2
   4  AB    -         AB       A         AB         C        7,6       0              2
   5  .B    -         B        B         .B         C        0,7       0              2
   6  C.    C         C        C         C.         -        3,0       3              4
  10  DE    DE        ED       E         DE         F        3,1       4              4
  11  D.    -         D        D         D.         F        4,0       0              2
  12  F.    F         F        F         F.         -        3,0       3              4
"""
# Paged, a pool of 6 blocks of 2 positions (free blocks are taken from the front of the free list,
# given back to its end). Admission takes a request only if the free blocks hold, for it and each
# request on the belt, its whole sequence so far and ROOM_TO_GROW = 3 tokens more (alone on the belt,
# its sequence only): at step 0 A's 3 + 3 and B's 2 + 3 take 3 + 3 blocks, the 6 free. By step 3 A
# holds blocks 0, 1, 4 and B 2, 3, 5: at step 4 A's position 6 needs a fourth block and none is
# free, so B, admitted last, is preempted (a bystander), its blocks 2, 3, 5 freed, and goes back to
# the head of the queue; A takes block 2 and ends. At step 5 B comes back, alone, into slot 0 with its
# prompt and 4 tokens (6 tokens fed again, counted as prompt tokens), in blocks 3, 5, 0, while C waits
# (B's 6 + 3 and C's 3 + 3 take 5 + 3 blocks, 6 free); at step 6 still (B's 7 + 3 take 2 more, C's 3
# + 3 three, 3 free). At step 10 D's 3 + 3 and E's 1 + 3 take 3 + 2 of the 6 free; at step 11 F
# waits (D's 4 + 3 take 2 more, F's 3 + 3 three, 4 free).
PAGED = """
step  belt  admitted  sampled  finished  occupants  waiting  n_cached  prompt_tokens  rows  preempted  block_tables
   0  AB    AB        AB       -         AB         C        3,2       5              5     -          01/2
   1  AB    -         AB       -         AB         C        4,3       0              2     -          01/23
   2  AB    -         AB       -         AB         C        5,4       0              2     -          014/23
   3  AB    -         AB       -         AB         C        6,5       0              2     -          014/235
   4  A.    -         A        A         A.         BC       7,0       0              1     B          0142/-
   5  B.    B         B        -         B.         C        6,0       6              6     -          350/-
   6  B.    -         B        B         B.         C        7,0       0              1     -          3501/-
   7  C.    C         C        C         C.         -        3,0       3              3     -          42/-
  10  DE    DE        ED       E         DE         F        3,1       4              4     -          35/0
  11  D.    -         D        D         D.         F        4,0       0              1     -          35/-
  12  F.    F         F        F         F.         -        3,0       3              3     -          14/-
"""
# The same pool with a prefix cache (Part 4): a full block, once written, is keyed by its tokens and
# its parent's key; a request admitted takes the longest run of its blocks found (wholly before its
# last token: found_cached, its positions), and a block whose last holder leaves is kept with its
# keys (cached_free, after the step, least recently used first). New work takes plain free blocks
# first, then kept ones, least recently used first. As paged to step 3, then: at step 4 B's full
# blocks 2, 3 are kept, 5 wiped, which A takes; as A leaves, its full blocks 0, 1, 4 are kept. At
# step 5 B finds its own 2, 3 (4 positions) and feeds 2 tokens into block 5; C finds block 0 but
# waits (B's 6 + 3 take 3 beside its 2, C's 3 + 3 two beside block 0, 3 free), its try making
# block 0 the most recently used. At step 6 C waits again (B's 7 + 3 take 2 more, C's two, 2 free)
# and B's position 6 evicts block 1, the least recently used. At step 7 C finds block 0 and feeds
# its one last prompt token (a one-token row). At step 10 D finds block 0 too (one token fed, into
# block 1), and E evicts block 4; both are one-token feeds, in the loop's order (by request). At step
# 11 F finds block 0, which D holds: shared, and counted once in kv_used (D's 4 and F's 3 positions,
# 2 of them the same: 5); F gets in where paged F waited (F's 3 + 3 take two beside block 0, 4 free).
PREFIX_CACHE = """
step  belt  admitted  sampled  finished  occupants  waiting  n_cached  prompt_tokens  rows  preempted  block_tables  found_cached  cached_free  kv_used
   0  AB    AB        AB       -         AB         C        3,2       5              5     -          01/2          0,0           -            5
   1  AB    -         AB       -         AB         C        4,3       0              2     -          01/23         -             -            7
   2  AB    -         AB       -         AB         C        5,4       0              2     -          014/23        -             -            9
   3  AB    -         AB       -         AB         C        6,5       0              2     -          014/235       -             -            11
   4  A.    -         A        A         A.         BC       7,0       0              1     B          0145/-        -             23           7
   5  B.    B         B        -         B.         C        6,0       2              2     -          235/-         4             140          6
   6  B.    -         B        B         B.         C        7,0       0              1     -          2351/-        -             40           7
   7  C.    C         C        C         C.         -        3,0       1              1     -          01/-          2             4235         3
  10  DE    DE        DE       E         DE         F        3,1       2              2     -          01/4          2,0           235          4
  11  DF    F         DF       DF        DF         -        4,3       1              2     -          01/04         2             235          5
"""
# Disaggregated, the worker's turns set by the test (gated_worker): it prefills one prompt to start
# with, and one more each time the loop reports a step after which nobody decodes, so that the loop,
# with nothing to decode, waits for that prompt. A prompt's first token comes back with it (handed
# over, its n_cached its prompt's length); the loop feeds no prompt token, and runs no forward in a
# step with nothing to decode. At step 0 A is handed over at once and B held at the worker; at step 4
# A ends and nobody decodes: B's turn, and at step 5 the loop waits for B, while C, admitted, waits
# at the worker. D, E and F arrive at step 10 to a full belt (C at the worker, B's last token); each
# takes the slot freed a step before, and is handed over a step after the one before it.
DISAGGREGATED = """
step  belt  admitted  sampled  finished  occupants  waiting  n_cached  prompt_tokens  rows  handed_over  at_worker
   0  A~    AB        A        -         AB         C        3,0       0              -     A            B
   1  A~    -         A        -         AB         C        4,0       0              1     -            B
   2  A~    -         A        -         AB         C        5,0       0              1     -            B
   3  A~    -         A        -         AB         C        6,0       0              1     -            B
   4  A~    -         A        A         AB         C        7,0       0              1     -            B
   5  ~B    C         B        -         CB         -        0,2       0              -     B            C
   6  ~B    -         B        -         CB         -        0,3       0              1     -            C
   7  ~B    -         B        -         CB         -        0,4       0              1     -            C
   8  ~B    -         B        -         CB         -        0,5       0              1     -            C
   9  ~B    -         B        -         CB         -        0,6       0              1     -            C
  10  ~B    -         B        B         CB         DEF      0,7       0              1     -            C
  11  C~    D         C        C         CD         EF       3,0       0              -     C            D
  12  ~D    E         D        -         ED         F        0,3       0              -     D            E
  13  ~D    -         D        D         ED         F        0,4       0              1     -            E
  14  E~    F         E        E         EF         -        1,0       0              -     E            F
  15  .F    -         F        F         .F         -        0,3       0              -     F            -
"""


def by_hand(table):
    """A table above, its first line the fields' names -> {step: {field: its value}}, each field as
    the StepReport holds it."""
    def letters(cell):
        return [] if cell == "-" else [ord(c) - ord("A") for c in cell]

    steps = {}
    columns, *lines = table.strip("\n").splitlines()
    for line in lines:
        cells = dict(zip(columns.split(), line.split()))  # the words after the last column: a comment
        row = dict(step=int(cells.pop("step")), belt=cells.pop("belt"),
                   occupants=[None if c == "." else ord(c) - ord("A") for c in cells.pop("occupants")],
                   n_cached=[int(n) for n in cells.pop("n_cached").split(",")],
                   n_prompt_tokens=int(cells.pop("prompt_tokens")), rows=cells.pop("rows"))
        row["rows"] = None if row["rows"] == "-" else int(row["rows"])
        if "block_tables" in cells:
            row["block_tables"] = [[] if blocks == "-" else [int(b) for b in blocks]
                                   for blocks in cells.pop("block_tables").split("/")]
        if "found_cached" in cells:  # Part 4: positions found a request admitted, ','; the kept blocks; kv_used
            found, kept = cells.pop("found_cached"), cells.pop("cached_free")
            row["found_cached"] = [] if found == "-" else [int(n) for n in found.split(",")]
            row["cached_free"] = [] if kept == "-" else [int(b) for b in kept]
            row["kv_used"] = int(cells.pop("kv_used"))
        row.update((field, letters(cell)) for field, cell in cells.items())
        steps[row["step"]] = row
    return steps


# ---------------------------------------------------------------------------------------------
# The runs, and each report against its step worked by hand


def gated_worker(monkeypatch):
    """The prefill worker takes a prompt only on a turn: one to start with, then one each time the
    loop reports a step after which nobody decodes -> the on_step that gives the turns. (Left alone,
    the worker finishes when it finishes, and which step hands a prompt over is the machine's.)"""
    turns, forward_packed, handed_over = threading.Semaphore(1), GPT.forward_packed, set()

    def gated(model, packed, cache):
        if on_worker() and int(packed.positions[0]) == 0:  # a prompt's first forward on the worker
            assert turns.acquire(timeout=TIMEOUT_S), "the worker waited for a turn that never came"
        return forward_packed(model, packed, cache)

    def on_step(report):  # who decodes next step: those handed over, but for those done now
        handed_over.update(report.handed_over)
        done = {i for i, _ in report.finished}
        if not any(i in handed_over and i not in done for i in report.occupants):
            turns.release()  # nobody: the loop will wait for the worker

    monkeypatch.setattr(GPT, "forward_packed", gated)
    return on_step


RUNS = {  # name -> (generate's options, the schedule by hand, positions in the cache)
    "continuous": (dict(policy="continuous"), CONTINUOUS, 2 * 64),
    "static": (dict(policy="static"), STATIC, 2 * 64),
    "paged": (dict(kv_blocks=6, kv_block_size=2), PAGED, 6 * 2),
    "prefix cache": (dict(kv_blocks=6, kv_block_size=2, prefix_cache=True), PREFIX_CACHE, 6 * 2),
    "disaggregated": (dict(disaggregate=True), DISAGGREGATED, 2 * 64),
}


@pytest.mark.parametrize("name", RUNS)
def test_every_report_is_the_schedule_worked_by_hand(name, monkeypatch):
    """Every StepReport of the run, field by field, is its step worked out by hand: who was admitted,
    sampled (in the logits' order), finished (why, and with how many tokens), sat in each slot and
    waited (after admission), how many positions each slot holds, the prompt tokens and the rows the
    forward ran on; paged, who was preempted and each slot's blocks; with a prefix cache, the positions
    each admission found cached, the free blocks kept and the positions written, a shared block's once;
    disaggregated, who was handed over and who the worker still holds. The counts are the lists'
    (n_running, n_waiting, n_prefilling, kv_used but where a block is shared), and so are the step's
    logits, one row per token made."""
    options, table, kv_total = RUNS[name]
    wanted, reports = by_hand(table), []
    requests = hand_worked_requests()
    if name == "disaggregated":
        give_turns = gated_worker(monkeypatch)
        on_step = lambda report: (reports.append(report), give_turns(report))  # noqa: E731
    else:
        on_step = reports.append
    completions = ends_within(TIMEOUT_S, generate, tiny_gpt(), requests, n_slots=2, eos_id=None, on_step=on_step,
                              **options)
    assert [report.step for report in reports] == list(wanted), "the steps the run took"
    for report in reports:
        want, where = wanted[report.step], f"{name}, step {report.step}"
        got = dict(step=report.step, belt=report.belt, occupants=report.occupants, n_cached=report.n_cached,
                   n_prompt_tokens=report.n_prompt_tokens,
                   rows=None if report.packed is None else report.packed.tokens.numel(),
                   finished=[i for i, _ in report.finished],
                   **{field: getattr(report, field) for field in
                      ("admitted", "sampled", "waiting", "preempted", "handed_over", "at_worker", "block_tables",
                       "found_cached", "cached_free", "kv_used") if field in want})
        assert got == want, f"{where}:\n  got  {got}\n  want {want}"
        assert (report.n_running, report.n_waiting, report.n_prefilling, report.kv_used, report.kv_total) == \
               (len(report.sampled), len(report.waiting), report.belt.count("~"),
                want.get("kv_used", sum(report.n_cached)), kv_total), where
        assert report.logits.shape[0] == len(report.sampled), where
        for i, completion in report.finished:  # eos_id=None: each makes its tokens, and ends at this step
            assert (completion.finish_reason, len(completion.tokens), completion.finish_step) == \
                   ("length", HAND_WORKED[i][1], report.step) and completion is completions[i], f"{where}: {i}"
        if "block_tables" not in want:  # per slot: a busy slot's table is itself; a preemption needs a pool
            assert report.block_tables == [[slot] if i is not None else [] for slot, i in enumerate(report.occupants)]
            assert report.preempted == [], where
        if "found_cached" not in want:  # no prefix cache: nothing found, nothing kept
            assert report.found_cached == [0] * len(report.admitted) and report.cached_free == [], where
        if "handed_over" not in want:
            assert report.handed_over == report.at_worker == [] and report.kv_bytes == 0, where
