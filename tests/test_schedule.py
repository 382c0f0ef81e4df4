"""
The schedule, stated a second time. Which request takes a slot, which waits, which is preempted and
where it comes back, how many prompt tokens a step feeds, which blocks a prefix cache finds, keeps and
evicts: no token depends on any of it (preemption recomputes), so the proof's token equality cannot
see a wrong decision. Here a simulator, written from the rules as the engine's docstrings and the
README state them, in its own terms (counts of blocks and whole prefixes, not block ids and chained
keys), replays every run's decisions from its requests alone, and every StepReport and Completion
must be what it says, step by step, on runs built to hit each rule's corners: several preemptions in
one step, a preempted request that holds no block yet, a comeback preempted again, a comeback newer
than requests with later indices, chunks beside decoding, a prefix cache that shares, keeps and
evicts blocks, static batching's padding.
"""
import dataclasses
import math
import random
from collections import deque

import pytest

import nanobatch
from nanobatch import Request, generate
from tests.common import random_prompt

ROOM = 3  # tokens of growth admission keeps free for each request (nanobatch.ROOM_TO_GROW, restated)


# ---------------------------------------------------------------------------------------------
# The rules, in the simulator's own words
#
#  1. A request joins the queue at its arrival step, in order of (arrival, index). With nobody in a
#     slot and nobody queued, the clock jumps to the next arrival.
#  2. Continuous: each free slot, lowest first, takes the head of the queue, if the cache has room;
#     the first refused stops admission, and nobody passes it. Static: only an empty belt admits.
#     Paged, the room is: for every request on the belt and the newcomer, the blocks its whole
#     sequence so far (prompt and answer) and ROOM tokens more would need beyond what it holds, no
#     more than the free blocks (no ROOM for a newcomer alone on the belt). With a prefix cache the
#     newcomer first takes the longest run of its full blocks found cached, all before its last token.
#  3. The step feeds each decoding request its newest token; then prompts (a comeback's prompt and
#     answer) in order of (arrival, index), sharing prefill_chunk tokens. Paged, while the feeds need
#     more blocks than are free, the request admitted last gives way, whatever it holds, back to the
#     head of the queue, and the step is planned again.
#  4. A request whose feed brings all it has into the cache makes a token; it is done at
#     max_new_tokens or when prompt and answer fill max_len; done, it leaves after the report.
#  5. Prefix cache: a full block is known by the whole prefix it ends; a block is known from the
#     first admission tried (refused or not) after the forward that wrote it, or as its request
#     leaves; a prefix known already stays with the block that has it. A block that no table lists is free: kept while
#     known, in order of release; new blocks come from the unknown ones first, then the kept one
#     released longest ago, which is forgotten (evicted).


@dataclasses.dataclass(eq=False)
class Block:  # a block of the simulated pool: who lists it, and the prefix it is known by
    n_tables: int = 0
    prefix: tuple | None = None
    taken_at: int | None = None  # the step that took it fresh


@dataclasses.dataclass(eq=False)
class Seat:  # a request in the simulator
    i: int
    prompt: list
    max_new: int
    arrival: int
    answer: list  # the tokens it makes, in order (for the prefix cache's prefixes)
    n_made: int = 0
    n_cached: int = 0
    blocks: list = dataclasses.field(default_factory=list)
    slot: int | None = None
    first_admitted: int | None = None
    first_token_step: int | None = None
    n_found: int = 0

    @property
    def sequence(self):
        return self.prompt + self.answer[:self.n_made]

    @property
    def to_feed(self):
        return len(self.prompt) + self.n_made - self.n_cached

    @property
    def prefilling(self):
        return self.to_feed > (1 if self.n_made else 0)


class Simulator:
    """A run's decisions from its requests -> per step, what its StepReport must hold."""

    def __init__(self, requests, answers, n_slots, max_len, policy="continuous", prefill_chunk=None,
                 kv_blocks=None, block_size=16, prefix_cache=False):
        self.seats = [Seat(i, r.prompt, r.max_new_tokens, r.arrival, answer) for i, (r, answer)
                      in enumerate(zip(requests, answers))]
        self.n_slots, self.max_len, self.policy = n_slots, max_len, policy
        self.budget = math.inf if prefill_chunk is None else prefill_chunk
        self.paged, self.size, self.prefix_cache = kv_blocks is not None, block_size, prefix_cache
        self.n_plain = kv_blocks or 0  # free blocks known by no prefix
        self.kept = []  # free blocks known by a prefix, released longest ago first
        self.known = {}  # prefix -> the block known by it
        self.on_belt = []  # in order of their latest admission

    def blocks_short(self, seat, n_positions):
        return max(0, math.ceil(n_positions / self.size) - len(seat.blocks))

    def n_free(self):
        return self.n_plain + len(self.kept)

    def learn(self, seats):  # rule 5: the full blocks written for these seats become known
        for seat in seats:
            for k, block in enumerate(seat.blocks[:seat.n_cached // self.size]):
                prefix = tuple(seat.sequence[:(k + 1) * self.size])
                if prefix not in self.known:
                    self.known[prefix], block.prefix = block, prefix

    def let_go(self, seat):  # its blocks back: a block no table lists is free, kept if known
        for block in seat.blocks:
            block.n_tables -= 1
            if block.n_tables == 0 and block.prefix is not None:
                self.kept.append(block)
            elif block.n_tables == 0:
                self.n_plain += 1
        seat.blocks, seat.n_cached = [], 0

    def take(self, step):  # a fresh block: an unknown one first, else the kept one released longest ago
        if self.n_plain:
            self.n_plain -= 1
        else:
            evicted = self.kept.pop(0)
            del self.known[evicted.prefix]
        return Block(1, None, step)

    def leave(self, seat, belt):
        if self.prefix_cache:
            self.learn([seat])
        if self.paged:
            self.let_go(seat)
        self.on_belt.remove(seat)
        belt[seat.slot] = None
        seat.n_cached = 0

    def fits(self, seat, belt):  # rule 2's room, paged; with a prefix cache, after taking what it finds
        if self.prefix_cache:
            self.learn([s for s in belt if s is not None])
            n_findable = (len(seat.sequence) - 1) // self.size
            for k in range(n_findable):
                block = self.known.get(tuple(seat.sequence[:(k + 1) * self.size]))
                if block is None:
                    break
                if block.n_tables == 0:
                    self.kept.remove(block)
                block.n_tables += 1
                seat.blocks.append(block)
            seat.n_cached = seat.n_found = len(seat.blocks) * self.size
        room = ROOM if self.on_belt else 0
        wanted = sum(self.blocks_short(s, len(s.sequence) + room) for s in [*self.on_belt, seat])
        if wanted <= self.n_free():
            return True
        self.let_go(seat)
        return False

    def plan(self, belt):  # rule 3: [(seat, tokens it feeds)]
        seats = sorted((s for s in belt if s is not None), key=lambda s: s.i)
        feeds = [(s, 1) for s in seats if not s.prefilling]
        budget = self.budget
        for s in sorted((s for s in seats if s.prefilling), key=lambda s: (s.arrival, s.i)):
            n = min(budget, s.to_feed)
            if n == 0:
                break
            feeds.append((s, n))
            budget -= n
        return feeds

    def run(self):
        """-> ([a dict per step: what its report must hold], {request: its completion's schedule})."""
        arriving = deque(sorted(self.seats, key=lambda s: (s.arrival, s.i)))
        waiting, belt, step, steps, done = deque(), [None] * self.n_slots, 0, [], {}
        while arriving or waiting or any(belt):
            # 1) Arrivals join the queue; with nobody anywhere, the clock jumps to the next.
            if not waiting and not any(belt):
                step = max(step, arriving[0].arrival)
            while arriving and arriving[0].arrival <= step:
                waiting.append(arriving.popleft())
            # 2) The free slots, lowest first, take the head of the queue while there is room.
            admitted = []
            free = [slot for slot in range(self.n_slots) if belt[slot] is None]
            if self.policy == "static" and len(free) < self.n_slots:
                free = []
            for slot in free:
                if not waiting or (self.paged and not self.fits(waiting[0], belt)):
                    break
                seat = waiting.popleft()
                seat.slot, belt[slot] = slot, seat
                seat.first_admitted = step if seat.first_admitted is None else seat.first_admitted
                self.on_belt.append(seat)
                admitted.append(seat)
            # 3) The step's feeds; paged, the last admitted gives way while blocks run short.
            feeds, preempted = self.plan(belt), []
            while self.paged and sum(self.blocks_short(s, s.n_cached + n) for s, n in feeds) > self.n_free():
                assert len(self.on_belt) > 1, f"step {step}: the first admitted would give way"
                victim = self.on_belt[-1]
                self.leave(victim, belt)
                waiting.appendleft(victim)
                preempted.append(victim.i)
                feeds = self.plan(belt)
            for s, n in feeds:
                if self.paged:
                    s.blocks += [self.take(step) for _ in range(self.blocks_short(s, s.n_cached + n))]
            # 4) The forward: who makes a token, and who is done.
            n_prompt_tokens = sum(n for s, n in feeds if s.prefilling)
            making = [s for s, n in feeds if n == s.to_feed]
            for s, n in feeds:
                s.n_cached += n
            finished = []
            for s in making:
                s.n_made += 1
                s.first_token_step = step if s.first_token_step is None else s.first_token_step
                if s.n_made == s.max_new or len(s.prompt) + s.n_made == self.max_len:
                    finished.append(s)
                    done[s.i] = dict(admit_step=s.first_admitted, first_token_step=s.first_token_step,
                                     finish_step=step, slot=s.slot, n_tokens=s.n_made,
                                     reason="length" if s.n_made == s.max_new else "context")
            # The step's report, as the engine's must read; then the finished leave.
            n_padding = self.n_slots - sum(s is not None for s in belt) if self.policy == "static" else 0
            steps.append(dict(
                step=step, admitted=[s.i for s in admitted], preempted=preempted,
                occupants=[None if s is None else s.i for s in belt], waiting=[s.i for s in waiting],
                belt="".join("." if s is None else nanobatch.letter(s.i) if s in making else "~" for s in belt),
                sampled=sorted(s.i for s in making), finished=sorted(s.i for s in finished),
                n_prompt_tokens=n_prompt_tokens, rows=sum(n for _, n in feeds) + n_padding,
                n_cached=[0 if s is None else s.n_cached for s in belt],
                n_blocks=[0 if s is None else len(s.blocks) if self.paged else 1 for s in belt],
                blocks=[[] if s is None else list(s.blocks) for s in belt],
                kv_used=self.positions_in_use(belt), found_cached=[s.n_found if self.prefix_cache else 0
                                                                   for s in admitted],
                cached_free=list(self.kept)))
            for s in finished:
                self.leave(s, belt)
            step += 1
        return steps, done

    def positions_in_use(self, belt):  # each block's positions written, once however many list it
        if not self.paged:
            return sum(s.n_cached for s in belt if s is not None)
        written = {}
        for s in filter(None, belt):
            for k, block in enumerate(s.blocks):
                written[id(block)] = max(written.get(id(block), 0), min(self.size, max(0, s.n_cached - k * self.size)))
        return sum(written.values())


# ---------------------------------------------------------------------------------------------
# The engine's run against the simulator's, step by step


def served(model, requests, **options):
    """generate's run, eos_id=None (every answer runs to its length) -> (completions, reports)."""
    reports = []
    completions = generate(model, requests, eos_id=None, on_step=reports.append, **options)
    return completions, reports


def check_schedule(requests, completions, reports, n_slots, max_len, **options):
    """Every report, field by field, and every completion's steps and slot, are the simulator's."""
    answers = [c.tokens for c in completions]  # the tokens are the proof's business: here, only the prefixes they make
    steps, done = Simulator(requests, answers, n_slots, max_len, **options).run()
    assert [report.step for report in reports] == [want["step"] for want in steps], "the steps the run took"
    paired = {}  # an engine block -> the simulator's Block it stands for
    for report, want in zip(reports, steps):
        got = dict(step=report.step, admitted=report.admitted, preempted=report.preempted, occupants=report.occupants,
                   waiting=report.waiting, belt=report.belt, sampled=sorted(report.sampled),
                   finished=sorted(i for i, _ in report.finished), n_prompt_tokens=report.n_prompt_tokens,
                   rows=0 if report.packed is None else report.packed.tokens.numel(), n_cached=report.n_cached,
                   n_blocks=[len(table) for table in report.block_tables], kv_used=report.kv_used,
                   found_cached=report.found_cached)
        assert got == {key: want[key] for key in got}, \
            f"step {report.step}:\n  engine    {got}\n  simulator {({key: want[key] for key in got})}"
        assert (report.n_running, report.n_waiting, report.n_prefilling) == \
               (len(want["sampled"]), len(want["waiting"]), want["belt"].count("~")), report.step
        assert report.logits.shape[0] == len(report.sampled), report.step
        # Which blocks: a block the simulator took fresh this step may be any free one of the engine's; any
        # other must be the one the engine holds for the same block of the simulator (found, shared).
        for table, blocks in zip(report.block_tables, want["blocks"]):
            for block, simulated in zip(table, blocks):
                if simulated.taken_at == report.step:
                    paired[block] = simulated
                assert paired.get(block) is simulated, \
                    f"step {report.step}: block {block} is not the block the simulator found or shares there"
        assert [paired.get(block) for block in report.cached_free] == want["cached_free"], \
            f"step {report.step}: the kept blocks {report.cached_free} (least recently released first) are not " \
            f"the simulator's {len(want['cached_free'])}"
    for i, c in enumerate(completions):
        got = dict(admit_step=c.admit_step, first_token_step=c.first_token_step, finish_step=c.finish_step,
                   slot=c.slot, n_tokens=len(c.tokens), reason=c.finish_reason)
        assert got == done[i], f"request {i}: engine {got}, simulator {done[i]}"


# ---------------------------------------------------------------------------------------------
# The runs: workloads crowded enough to hit each rule's corners, which each test asserts it hit


def crowded(seed, n_requests, max_prompt, max_new, late, system=()):
    """Seeded requests: prompts of 1 to max_prompt tokens after `system`, answers of 1 to max_new, half
    at step 0 and the rest by step `late`, out of index order."""
    rng = random.Random(seed)
    return [Request(list(system) + random_prompt(rng, rng.randint(1, max_prompt)), rng.randint(1, max_new),
                    arrival=0 if rng.random() < 0.5 else rng.randint(1, late)) for _ in range(n_requests)]


def corners(reports, block_size=None):
    """The corners a run's reports show, read from the reports alone -> a set of their names."""
    seen, preempted_before = set(), set()
    for before, report in zip([None] + reports[:-1], reports):
        staying = set() if before is None else \
            {i for i in before.occupants if i is not None} - {i for i, _ in before.finished} - set(report.preempted)
        if len(report.preempted) >= 2:
            seen.add("several preempted in one step")
        for i in report.preempted:
            if before.block_tables[before.occupants.index(i)] == []:
                seen.add("a request with no block yet preempted")
        if report.preempted and report.preempted[0] != max(staying | set(report.preempted)):
            seen.add("the last admitted not the last index")
        if set(report.preempted) & preempted_before:
            seen.add("preempted again")
        if set(report.admitted) & preempted_before:
            seen.add("a comeback")
        found = dict(zip(report.admitted, report.found_cached))
        if any(n and i in preempted_before for i, n in found.items()):
            seen.add("a comeback finds its own blocks")
        preempted_before.update(report.preempted)
        listed = [block for table in report.block_tables for block in table]
        if len(listed) > len(set(listed)):
            seen.add("a block shared")
        for i, table in zip(report.occupants, report.block_tables):  # a block kept a step ago, taken fresh now
            if before is not None and i is not None and block_size is not None:
                had = before.block_tables[before.occupants.index(i)] if i in before.occupants else []
                fresh = table[found[i] // block_size:] if i in found else table[len(had):]
                if set(fresh) & set(before.cached_free):
                    seen.add("a kept block evicted")
        if report.n_prompt_tokens and "~" in report.belt and any(c not in ".~" for c in report.belt):
            seen.add("chunks beside decoding")
    return seen


MAX_LEN = 32
RUNS = {  # name -> (the requests, generate's options, the corners the run must show)
    "paged, several preempted in a step, one with no block yet": (
        crowded(30, 8, 10, 16, 6), dict(n_slots=4, kv_blocks=16, kv_block_size=2, prefill_chunk=1),
        {"several preempted in one step", "a request with no block yet preempted", "the last admitted not the last index",
         "a comeback", "chunks beside decoding"}),
    "paged, a comeback preempted again": (
        crowded(17, 8, 10, 16, 6), dict(n_slots=4, kv_blocks=7, kv_block_size=4, prefill_chunk=1),
        {"several preempted in one step", "a request with no block yet preempted", "preempted again",
         "a comeback"}),
    "prefix cache, shared, kept and evicted": (
        crowded(35, 9, 8, 14, 8, system=range(1, 9)),
        dict(n_slots=3, kv_blocks=9, kv_block_size=4, prefill_chunk=3, prefix_cache=True),
        {"several preempted in one step", "a comeback finds its own blocks", "a block shared", "a kept block evicted"}),
    "continuous, chunks": (crowded(1, 10, 10, 16, 6), dict(n_slots=3, prefill_chunk=3), {"chunks beside decoding"}),
    "static, chunks": (crowded(2, 10, 10, 16, 6), dict(n_slots=3, policy="static", prefill_chunk=4), set()),
}


@pytest.mark.parametrize("name", RUNS)
def test_the_schedule_is_the_rules(gpt, name):
    """Every StepReport of the run (who was admitted, preempted, sampled, finished, sat in each slot and
    waited; the belt; each slot's positions and blocks; the prompt tokens and rows fed; kv_used; with a
    prefix cache, the positions found, and which blocks are kept, in order) and every Completion's steps
    and slot are the simulator's, on a run that shows the corners named in RUNS."""
    requests, options, wanted = RUNS[name]
    completions, reports = served(gpt, requests, max_len=MAX_LEN, **options)
    assert wanted <= corners(reports, options.get("kv_block_size")), \
        f"the run misses {wanted - corners(reports, options.get('kv_block_size'))}"
    simulated = dict(options, block_size=options.get("kv_block_size", 16))
    for option in ("n_slots", "kv_block_size"):
        simulated.pop(option, None)
    check_schedule(requests, completions, reports, options["n_slots"], MAX_LEN, **simulated)
