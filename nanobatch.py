"""
nanobatch: continuous batching (iteration-level scheduling) for GPT-2, in one loop, read in five Parts.

Part 1, continuous batching: a belt of slots, each holding one sequence's keys and values in the KV cache, and the
loop, `generate`, in phases 0 to 7; static batching is the same loop with one decision changed (`slots_to_fill`; its
empty slots padded). The loop asks three helpers the same questions in every mode (listed above SlotBlocks), which
later Parts answer another way. Part 2, disaggregated prefill: a PrefillWorker thread prefills prompts on a GPU, CUDA
stream or CPU threads of its own. Part 3, paged attention: a BlockPool holds the cache as small blocks. Part 4, prefix
caching: a PrefixCache keeps full blocks for later requests. Part 5, serving live: LiveRequests takes requests from
other threads while the loop runs, streams each token to its caller, who may cancel it. Below, under banners: input
checks, figures, step reports, the command line. Shapes (model.py's legend): S slots, M tokens packed into a step, D
of them one-token rows, T tokens of one prompt chunk, L positions attended over, R rows sampled, V vocabulary.
"""
import argparse
import math
import numbers
import os
import queue
import random
import reprlib
import string
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from model import GPT, GPTConfig, PackedStep, check_cache_fits, default_cache_dir, split_at_cut

POLICIES = ("continuous", "static")
EOT = 50256  # <|endoftext|>: GPT-2 ends a text with it

# ---------------------------------------------------------------------------------------------
# Part 1, continuous batching. The data a caller sends and gets back; sampling and stopping, shared with the reference

@dataclass
class Request:
    prompt: list[int]  # GPT-2 token ids
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # sample among the k largest logits only (None: all)
    seed: int | None = None  # per-request sampling seed (None: a random one)
    arrival: int = 0  # loop step at which the scheduler first sees this request
    ignore_eos: bool = False  # go on through EOS to max_new_tokens (vLLM's ignore_eos, its benchmark's)


@dataclass
class Completion:
    tokens: list[int]  # generated ids only; an EOS that ended the request is kept
    finish_reason: str  # "eos" | "length" | "context" (its slot is full) | "abort" (Part 5: cancelled)
    admit_step: int  # loop step that took this request into a slot
    finish_step: int  # loop step that produced its last token (Part 5, cancelled: the step it left in)
    ttft_s: float  # seconds from its arrival (the start of its arrival step) to its first token
    latency_s: float  # seconds from its arrival to its last token
    first_token_step: int  # admit_step, unless its prompt took several steps (chunks) or the worker had it
    slot: int  # the slot it occupied (Part 3: preempted and taken in again, the last)
    token_times_s: list[float]  # seconds from the start of its arrival step to each of its tokens


def new_sampler(request, device):
    """The request's own random generator: its draws never depend on its batch-mates."""
    generator = torch.Generator(device=device)
    generator.seed() if request.seed is None else generator.manual_seed(request.seed)
    return generator


def sample(logits, request, generator):
    """The next token from one row of logits (V,), as a 0-d tensor left on the logits' device."""
    if request.temperature == 0:
        return logits.argmax()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # no softmax in 16 bits
    logits = logits - logits.max()  # the largest is 0, so a tiny temperature cannot overflow
    if request.top_k is not None:
        kth_largest = torch.topk(logits, min(request.top_k, logits.size(-1))).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits / request.temperature, dim=-1)
    # torch.multinomial's own draw for one sample, argmax(p / q) with q ~ Exp(1), without the checks
    # it runs first, which read values back from the device: one wait per sampled row.
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax()


def sample_step(logits, runs, device):
    """Each run's next token from its row of logits (R, V), as ints read back in one copy: one wait."""
    if not runs:  # a step of mid-prompt chunks only: nothing to read back, but timings must be true
        synchronize(device)
        return []
    return torch.stack([sample(row, run.request, run.sampler) for row, run in zip(logits, runs)]).tolist()


def stop_reason(request, tokens, max_len, eos_id):
    """Why the request is done after its newest token; it goes on while this returns None."""
    if tokens[-1] == eos_id and not request.ignore_eos:
        return "eos"
    if len(tokens) == request.max_new_tokens:
        return "length"
    if len(request.prompt) + len(tokens) == max_len:
        return "context"  # its slot is full: the next token would have no position


# ---------------------------------------------------------------------------------------------
# The per-slot state, and the loop's two decisions: who takes a slot, and what each slot feeds

@dataclass
class Running:
    """A request in the engine from its arrival: waiting for a slot, then in one. What the loop keeps."""
    request_index: int  # its place in the caller's list
    request: Request
    slot: int | None = None  # its slot on the belt (None: not in one yet)
    sampler: torch.Generator | None = None  # its own random generator (new_sampler)
    admit_step: int | None = None  # the loop step that first took it into a slot
    block_table: list[int] = field(default_factory=list)  # its cache blocks, in order: per slot [slot]; Part 3
    n_cached: int = 0  # tokens of prompt + answer in the cache; decoding, all but the newest
    tokens: list[int] = field(default_factory=list)  # generated so far
    token_times_s: list[float] = field(default_factory=list)  # seconds from arrival to each token
    first_token_step: int | None = None
    arrived_at: float = 0.0  # wall time (time.perf_counter) it arrived: its arrival step's start (Part 5: submitted)
    n_found: int = 0  # Part 4: positions it found in the cache at its latest admission
    block_keys: list[tuple] = field(default_factory=list)  # Part 4: its full blocks' keys, each made once (PrefixCache)
    completion: Completion | None = None  # what its caller gets back, once it has finished

    @property
    def n_to_feed(self):  # prompt + answer tokens not in the cache yet: all that it still has to feed
        return len(self.request.prompt) + len(self.tokens) - self.n_cached

    @property
    def is_prefilling(self):  # more to feed than its newest token: its prompt (Part 3: or, preempted, all again)
        return self.n_to_feed > (1 if self.tokens else 0)  # before its first token, no newest token to feed

    def finish(self, reason, step):  # its Completion, what its caller gets (Part 5: cancelled before a token, no times)
        first_s, last_s = (self.token_times_s[0], self.token_times_s[-1]) if self.tokens else (None, None)
        self.completion = Completion(self.tokens, reason, self.admit_step, finish_step=step, ttft_s=first_s,
                                     latency_s=last_s, first_token_step=self.first_token_step, slot=self.slot,
                                     token_times_s=self.token_times_s)


def slots_to_fill(belt, policy):
    """The free slots a waiting request may take now. The policies' one decision: continuous
    refills a slot the step after it frees up; static refills only an empty belt."""
    free = [slot for slot, run in enumerate(belt) if run is None]
    return [] if policy == "static" and len(free) < len(belt) else free


def plan_step(belt, prefill_chunk):
    """The tokens each request feeds this step: [(run, token ids)]. Decoding requests first, each
    its newest token: a prompt never delays them. Then the prompts, first come first served, share a
    budget of prefill_chunk tokens (None: no limit); the rest goes on next step (chunked prefill)."""
    runs = sorted((run for run in belt if run is not None), key=lambda run: run.request_index)
    work = [(run, [run.tokens[-1]]) for run in runs if not run.is_prefilling]
    budget = math.inf if prefill_chunk is None else prefill_chunk
    for run in sorted((run for run in runs if run.is_prefilling), key=lambda run: run.request.arrival):
        n = min(budget, run.n_to_feed)
        if n == 0:
            break
        sequence = run.request.prompt + run.tokens  # its prompt; Part 3: a preempted run's answer too
        work.append((run, sequence[run.n_cached:run.n_cached + n]))
        budget -= n
    return work


# ---------------------------------------------------------------------------------------------
# The mask, and packing a step's tokens into one forward

def attention_mask(positions, L):
    """(B, T, L) bool: a token may see position l of its own slot iff l <= its own position.

    Each row of queries reads one slot only, so requests never see each other; within a slot this one rule is
    causal attention over exactly the slot's own prefix, never what lies beyond (a previous occupant's keys, x
    below). The README's worked step (1 = visible): slots 0, 1 decode, slot 3 a one-token prompt, slot 2 a chunk:

      one-token rows: B = S = 4, T = 1, over every      a chunk in slot 2: B = 1, T = 3, the prompt's
      slot's first L = 6 positions (the longest row's)  positions 3..5 (0..2 went in a step before)
      cache position   0 1 2 3 4 5                      cache position   0 1 2 3 4 5
      slot 0, pos 5    1 1 1 1 1 1                             pos 3     1 1 1 1 0 0
      slot 1, pos 2    1 1 1 0 0 0   (3.. hold x)              pos 4     1 1 1 1 1 0
      slot 2, no row   1 0 0 0 0 0   a dummy                   pos 5     1 1 1 1 1 1
      slot 3, pos 0    1 0 0 0 0 0   (1.. hold x)
    """
    key_positions = torch.arange(L, device=positions.device)  # (L,)
    return key_positions[None, None, :] <= positions[:, :, None]  # (B, T, L)


def pack_step(work, padding_slots, n_slots, device, block_tables=None):
    """work, [(run, the token ids it feeds)], as one model.PackedStep -> (it, the runs due a token, in its logits'
    order). Its rows are the tokens, one a row: one-token feeds first (at most one a slot, by request index, as
    plan_step lists them), then each chunk's tokens. padding_slots feed token 0 at position 0 for no one (static
    batching's empty slots; finite keys, seen by no other row). One-token rows attend together in one call over
    every slot; a chunk (a prompt's tokens) in a call of its own. block_tables: Part 3 (None: slot s is block s)."""
    feeds = [(run, run.slot, run.n_cached, ids) for run, ids in work]  # (run, slot, first position, ids)
    feeds += [(None, slot, 0, [0]) for slot in padding_slots]
    # On a first read take the one-token rows' cut as the longest one's length, its position + 1 (model.split_at_cut).
    one_token, chunks, cut = split_at_cut(feeds, n_slots, device)
    tokens, positions, slots, logit_rows, padding_rows, to_sample = [], [], [], [], [], []
    for run, slot, first_position, ids in one_token + chunks:
        tokens += ids
        positions += range(first_position, first_position + len(ids))
        slots += [slot] * len(ids)
        # A run samples once its feed brings all it has into the cache: a decoding run every step, a
        # prompt in the step that completes it (n_to_feed is read before the loop moves n_cached on).
        if run is None:
            padding_rows.append(len(tokens) - 1)
        elif len(ids) == run.n_to_feed:
            logit_rows.append(len(tokens) - 1)
            to_sample.append(run)
    query_positions = [0] * n_slots  # each slot's one-token row's position; 0 for a slot with none, whose
    #                                  dummy query then sees one key (a row that sees none gives NaN)
    for _, slot, position, _ in one_token:
        query_positions[slot] = position
    # Part 3: the block tables as one (S, width) grid, each padded with block 0, which the mask hides.
    width = max([1] + [len(table) for table in block_tables or []])
    tables = [block for table in block_tables or [] for block in table + [0] * (width - len(table))]
    # Every index of the step in one host-to-device copy. From ordinary memory the copy waits for
    # the device, which has nearly nothing queued: the previous step ended by reading its tokens back.
    logit_rows += padding_rows  # the sampled runs' rows first: the loop drops padding's logits
    M, R = len(tokens), len(logit_rows)
    index = torch.tensor(tokens + positions + slots + query_positions + logit_rows + tables, dtype=torch.long,
                         device=device)
    tokens_t, positions_t, slots_t, query_positions_t, logit_rows_t, tables_t = index.split(
        [M, M, M, n_slots, R, len(tables)])
    one_token_mask = attention_mask(query_positions_t[:, None], cut)  # (S, 1, L), L the cut
    chunk_masks, first_row = [], len(one_token)
    for _, slot, first_position, ids in chunks:
        chunk_rows = slice(first_row, first_row + len(ids))
        mask = attention_mask(positions_t[chunk_rows][None], first_position + len(ids))[0]  # (T, L): to its last
        chunk_masks.append((chunk_rows, slot, mask))
        first_row += len(ids)
    packed = PackedStep(tokens_t, positions_t, slots_t, len(one_token), one_token_mask, chunk_masks, logit_rows_t,
                        None if block_tables is None else tables_t.view(n_slots, width))
    return packed, to_sample


# ---------------------------------------------------------------------------------------------
# What the loop asks three helpers, the same in every mode, and Part 1's answers (a later Part's are another way):
#   the cache, SlotBlocks (Part 3: BlockPool; Part 4: PrefixCache): may a waiting request take this free slot now
#     (admit), blocks for the step's feeds (make_room, which may preempt), a request leaves its slot (vacate),
#     where each slot's positions lie (block_tables), and the cache the forward writes (.cache);
#   the prompts' feeder, PrefillInLoop (Part 2: PrefillWorker): the step's prompt budget, send an admitted prompt,
#     receive those prefilled elsewhere, and which it holds;
#   the callers, RequestList (Part 5: LiveRequests): will more come, the next arrival's step, who has arrived,
#     who has cancelled, and each new token (or a cancel's end) to its caller (hear).

class SlotBlocks:
    """The KV cache per slot: block s is slot s's, max_len positions kept for whoever sits there."""
    kept, evicted = (), None  # Part 4: free blocks that keep their keys, and those evicted this step; none here

    def __init__(self, model, n_slots, max_len):
        self.cache = model.new_cache(n_slots, max_len)  # the one large allocation, reused by every request

    def admit(self, run, slot, belt):  # seat run in the free slot -> whether it did: per slot, always
        run.slot, run.block_table, belt[slot] = slot, [slot], run  # block s: the slot's own, there whenever it is free
        return True

    def make_room(self, work, belt, waiting, prefill_chunk):  # -> (work, preempted): per slot, room always
        return work, []  # (Part 3: a pool short of blocks sends runs back to waiting, plans again with prefill_chunk)

    def vacate(self, run, belt):  # run leaves its slot, retired (Part 3: or preempted)
        self.cache.clear(run.block_table, run.n_cached)  # what it wrote, wiped: KVCache.clear says why
        run.block_table, run.n_cached, belt[run.slot] = [], 0, None

    def block_tables(self, belt):  # where pack_step finds a slot's positions: per slot, slot s is block s
        return None


class PrefillInLoop(nullcontext):
    """The prompts' feeder: the loop itself, at most prefill_chunk tokens a step (plan_step's budget)."""
    holding = ()  # the requests whose prompts are being prefilled elsewhere: none

    def __init__(self, prefill_chunk):
        super().__init__()
        self.budget = prefill_chunk  # prompt tokens the loop feeds a step (None: no limit)

    def send(self, run):  # an admitted request's prompt: the loop feeds it itself
        pass

    def receive(self, belt):  # prompts prefilled elsewhere and handed over: none
        return []


class RequestList:
    """The callers as a list: each request arrives at its `arrival` step, its answer read when generate returns."""

    def __init__(self, requests, device):
        self.runs = [Running(i, request, sampler=new_sampler(request, device)) for i, request in enumerate(requests)]
        self.pending = deque(sorted(self.runs, key=lambda run: run.request.arrival))  # not arrived; ties by index
        self.completions = [None] * len(requests)

    def more_to_come(self):  # asked when nothing is in a slot or waiting
        return bool(self.pending)

    def next_arrival(self, step):  # idle: the clock jumps to the next arrival's step
        return max(step, self.pending[0].request.arrival)

    def arrived(self, step, step_start):  # -> the requests whose arrival step has come, first come first served
        while self.pending and self.pending[0].request.arrival <= step:
            self.pending[0].arrived_at = step_start
            yield self.pending.popleft()

    def cancelled(self, step, waiting, belt, held):  # the requests whose callers have gone: a list's stay
        return []

    def hear(self, run, token):  # a new token: a list's caller reads its answer at the end
        self.completions[run.request_index] = run.completion


def admit_waiting(belt, waiting, policy, blocks, prompts, step):
    """Waiting requests into the free slots, first come first served, while the cache has room for
    them -> the Running requests admitted. Each admitted prompt is sent to whoever feeds the prompts."""
    admitted = []
    for slot in slots_to_fill(belt, policy)[:len(waiting)]:
        if not blocks.admit(waiting[0], slot, belt):
            break  # it stays first in line, and nobody passes it
        run = waiting.popleft()
        run.admit_step = step if run.admit_step is None else run.admit_step  # Part 3: taken in again, its first
        prompts.send(run)
        admitted.append(run)
    return admitted


# ---------------------------------------------------------------------------------------------
# The loop

def generate(model, requests, *, n_slots=8, max_len=None, eos_id=EOT, policy="continuous",
             prefill_chunk=None, on_step=None, disaggregate=False, kv_blocks=None, kv_block_size=16,
             prefix_cache=False):
    """Serve requests through a belt of n_slots -> their Completions, in request order (Part 5: a LiveRequests, fed
    while this runs: each caller reads its Stream; this returns None). max_len: positions per slot (None: block_size).
    eos_id=None: never stop on EOS. prefill_chunk: prompt tokens a step may take (None: no limit; disaggregated: each
    forward of the worker). on_step: given each StepReport. The other options: Parts 2-4 (docs/api.md)."""
    max_len = model.config.block_size if max_len is None else max_len
    device = model.lm_head.weight.device
    is_live = isinstance(requests, LiveRequests)  # Part 5: each request is checked as it is submitted
    checked = check_arguments(model, [] if is_live else requests, n_slots, max_len, eos_id, policy, prefill_chunk,
                              disaggregate, kv_blocks, kv_block_size, prefix_cache)
    # Who sends the requests and hears of their tokens: the caller's list, or (Part 5) live callers.
    callers = requests if is_live else RequestList(checked, device)
    # Who holds the cache: a block of max_len a slot, or (Part 3) a pool of small blocks, (Part 4) some kept to share.
    pool = PrefixCache if prefix_cache else BlockPool
    blocks = pool(model, kv_blocks, kv_block_size) if kv_blocks else SlotBlocks(model, n_slots, max_len)
    # Who feeds the prompts: the loop itself, or (Part 2) a prefill worker beside it.
    prompts = PrefillWorker(model, blocks.cache, max_len, prefill_chunk) if disaggregate else \
        PrefillInLoop(prefill_chunk)
    waiting = deque()  # Running requests not in a slot: first come, first served
    belt = [None] * n_slots  # belt[slot]: the Running request in that slot, or None
    step = 0
    with torch.no_grad(), prompts:
        while waiting or any(belt) or callers.more_to_come():  # requests in hand, or (idle) one more to come
            # 0) Nothing in a slot and nothing waiting: the clock moves on to the next arrival (Part 5: it stays).
            if not waiting and not any(belt):
                step = callers.next_arrival(step)
            # 1) Arrivals join the queue. A request whose caller has gone (Part 5) leaves the queue, or its slot.
            step_start = time.perf_counter()
            waiting += callers.arrived(step, step_start)
            for run in (cancelled := callers.cancelled(step, waiting, belt, prompts.holding)):
                blocks.vacate(run, belt) if run in belt else waiting.remove(run)
            # 2) Admit waiting requests into free slots.
            admitted = admit_waiting(belt, waiting, policy, blocks, prompts, step)
            # 3) Choose the step's tokens, find them room in the cache (Part 3: or preempt), and pack them.
            #    Static batching, as a padded batch does, computes a row for each empty slot.
            work, preempted = blocks.make_room(plan_step(belt, prompts.budget), belt, waiting, prompts.budget)
            padding_slots = [s for s, run in enumerate(belt) if run is None] if policy == "static" else []
            packed, to_sample = pack_step(work, padding_slots, n_slots, device, blocks.block_tables(belt))
            # Counted, and packed, before n_cached moves on: both read what each run had still to feed.
            n_prompt_tokens = sum(len(ids) for run, ids in work if run.is_prefilling)
            for run, ids in work:
                run.n_cached += len(ids)  # the forward below writes them
            # 4) One forward over all of them; a token for every run due one.
            model_start = time.perf_counter()
            logits = model.forward_packed(packed, blocks.cache)[:len(to_sample)]  # (R, V): padding's, last, dropped
            new_tokens = sample_step(logits, to_sample, device)
            model_s = time.perf_counter() - model_start
            # 4b) Prompts prefilled elsewhere come back, each with its first token (Part 2).
            handovers = prompts.receive(belt)
            sampled = to_sample + [handover.run for handover in handovers]
            new_tokens += [handover.token for handover in handovers]
            # 5) Each new token joins its answer, which ends here or goes on; its caller hears of it.
            now, finished = time.perf_counter(), []
            for run, token in zip(sampled, new_tokens):
                run.tokens.append(token)
                run.token_times_s.append(now - run.arrived_at)
                run.first_token_step = step if run.first_token_step is None else run.first_token_step
                if reason := stop_reason(run.request, run.tokens, max_len, eos_id):
                    run.finish(reason, step)
                    finished.append(run)
                callers.hear(run, token)
            # 6) Report the step, if asked: built from what it did (step_report, with the figures).
            if on_step is not None:
                on_step(step_report(step, step_start, belt, waiting, blocks, prompts, admitted, preempted, packed,
                                    n_prompt_tokens, logits, model_s, handovers, sampled, cancelled + finished))
            # 7) Retire finished requests: each vacates its slot, free for the very next step.
            for run in finished:
                blocks.vacate(run, belt)
            step += 1
    return callers.completions


def generate_sequential(model, requests, *, max_len=None, eos_id=EOT):
    """The reference: one request at a time, the plain no-cache forward over the whole sequence for
    every token, slow and plainly right. Its steps count as a one-slot belt's: one token each."""
    max_len = model.config.block_size if max_len is None else max_len
    requests = check_arguments(model, requests, 1, max_len, eos_id, "continuous")
    device = model.lm_head.weight.device
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    not_arrived, arrived_at, completions = deque(order), [None] * len(requests), [None] * len(requests)
    step = 0
    with torch.no_grad():
        for i in order:
            request, tokens, token_times_s, reason = requests[i], [], [], None
            step = admit_step = max(step, request.arrival)  # idle until it arrives
            sampler = new_sampler(request, device)
            while reason is None:
                while not_arrived and requests[not_arrived[0]].arrival <= step:
                    arrived_at[not_arrived.popleft()] = time.perf_counter()
                logits = model(torch.tensor([request.prompt + tokens], device=device))  # (1, T, V)
                tokens.append(int(sample(logits[0, -1], request, sampler)))
                token_times_s.append(time.perf_counter() - arrived_at[i])
                reason = stop_reason(request, tokens, max_len, eos_id)
                step += 1
            completions[i] = Completion(tokens, reason, admit_step, finish_step=step - 1, ttft_s=token_times_s[0],
                                        latency_s=token_times_s[-1], first_token_step=admit_step, slot=0,
                                        token_times_s=token_times_s)
    return completions


# ---------------------------------------------------------------------------------------------
# Part 2, disaggregated prefill: the prompts on hardware of their own
#
# Two actors, one queue in and one out, behind the calls Part 1's PrefillInLoop answers. The loop (the
# calling thread, the model's device) admits a request, reserves its slot and sends it. The worker (a
# second GPU, else a CUDA stream of its own, else half the CPU's threads) prefills it, samples the first
# token, copies the keys and values into the slot and sends back a Handover (or its error, raised).

@dataclass
class Handover:  # what the worker sends back once a request's keys and values are in its slot
    run: Running  # the loop's own Running, its slot reserved at admission
    token: int  # its first token, sampled with the request's own generator
    logits: torch.Tensor  # (V,) the logits that token was sampled from
    kv_bytes: int  # bytes of keys and values copied into the slot: the transfer
    kv_s: float  # seconds the copy took (on a GPU, behind what the loop had queued before it)


class PrefillWorker:
    budget = 0  # prompt tokens the loop feeds a step: none, the worker takes them all

    def __init__(self, model, cache, max_len, prefill_chunk):
        self.model, self.cache, self.max_len, self.prefill_chunk = model, cache, max_len, prefill_chunk
        self.inbox, self.outbox = queue.Queue(), queue.Queue()  # Running (None: wake up); Handover or error
        self.holding, self.stopping = set(), threading.Event()  # holding: requests sent, not yet handed back
        self.n_threads = torch.get_num_threads()  # the caller's setting, given back at the end
        # Inference mode is per thread, and the caller's cache takes writes in it only: the worker runs in it too.
        self.inference_mode = torch.is_inference_mode_enabled()

    def prefill(self, model, stream, n_threads):  # the worker's thread: its whole story
        try:
            device = model.lm_head.weight.device
            torch.set_num_threads(n_threads)
            on_own_stream = torch.cuda.stream(stream) if stream else nullcontext()  # None would look up a GPU
            with torch.inference_mode(self.inference_mode), torch.no_grad(), on_own_stream:
                own_cache = model.new_cache(1, self.max_len)  # never wiped: a prompt writes a position, then reads it
                while (run := self.inbox.get()) is not None and not self.stopping.is_set():
                    here = Running(run.request_index, run.request, slot=0, sampler=None, admit_step=run.admit_step)
                    while here.is_prefilling:  # the loop's own plan and packing, on a belt of one
                        work = plan_step([here], self.prefill_chunk)
                        logits = model.forward_packed(pack_step(work, [], 1, device)[0], own_cache)  # (1, V) at the end
                        here.n_cached += len(work[0][1])
                    logits = logits[0].to(self.cache.kv.device)  # (V,)
                    token = sample(logits, run.request, run.sampler).item()
                    start = time.perf_counter()
                    if stream:  # after the loop's last use of the slot: the clear of its previous occupant
                        stream.wait_stream(self.loop_stream)
                    kv_bytes = own_cache.send(0, here.n_cached, to=self.cache, to_slot=run.slot)  # the transfer
                    synchronize(device)
                    self.outbox.put(Handover(run, token, logits, kv_bytes, time.perf_counter() - start))
        except BaseException as error:  # carried to the loop, which raises it with this traceback
            self.outbox.put(error)

    def __enter__(self):  # hardware for each side, then the thread
        device = self.cache.kv.device
        worker_device, model = prefill_device(device), self.model
        if worker_device != device:  # a second GPU: a copy of the weights, built there
            with torch.device(worker_device):
                model = GPT(self.model.config).to(self.model.lm_head.weight.dtype).eval()
            model.load_state_dict(self.model.state_dict())
            torch.cuda.synchronize(worker_device)  # those copies are queued on a stream the worker's never waits on
        self.loop_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        stream = torch.cuda.Stream(worker_device) if worker_device.type == "cuda" else None
        n_worker, n_loop = split_threads(self.n_threads) if device.type == "cpu" else (self.n_threads,) * 2
        torch.set_num_threads(n_loop)  # each thread sets its own; the worker's in its thread
        self.thread = threading.Thread(target=self.prefill, args=(model, stream, n_worker), daemon=True,
                                       name="nanobatch prefill worker")
        self.thread.start()
        return self

    def send(self, run):  # an admitted request, its slot reserved, to the worker's queue
        self.holding.add(run.request_index)
        self.inbox.put(run)

    def receive(self, belt):
        """The Handovers sent since the last call; at least one if nothing on the belt decodes (the loop is idle)."""
        is_idle = self.holding and all(run is None or run.is_prefilling for run in belt)
        handovers = [self.outbox.get()] if is_idle else []
        while not self.outbox.empty():  # the loop is the only reader
            handovers.append(self.outbox.get())
        for handover in handovers:
            if isinstance(handover, BaseException):
                raise handover
            handover.run.n_cached = len(handover.run.request.prompt)  # the worker wrote them into its slot
            self.holding.remove(handover.run.request_index)
            if handover.logits.is_cuda:  # made on the worker's stream, read on the loop's: tell the allocator
                handover.logits.record_stream(torch.cuda.current_stream(handover.logits.device))
        return handovers

    def __exit__(self, *exception):  # generate's `with` ends the thread; __enter__ started it
        self.stopping.set()  # prompts not started are dropped: the worker stops after the one in hand
        self.inbox.put(None)  # wakes it if it waits for a prompt
        try:
            self.thread.join()
        finally:
            torch.set_num_threads(self.n_threads)


# ---------------------------------------------------------------------------------------------
# Part 3, paged attention: the cache as a pool of blocks
#
# Per slot, each slot reserves max_len positions for the longest answer it might give, and most never hold a token.
# Paged (vLLM's PagedAttention), the cache is a pool of small blocks, and a request's block table lists the blocks that
# hold its positions: position p lives at offset p % block_size of block block_table[p // block_size]. A request takes a
# block when its tokens reach one and gives its blocks back when it leaves: n_slots only caps how many requests step
# together. The mask does not change: it speaks of positions, and the block table only says where a position's keys live
# (model.attend_packed writes through it, model.slot_positions reads through it). Which block is taken: the free blocks
# wait in a line, 0, 1, 2, ... at first; a step's feeds take the blocks their new positions reach, in the step's order
# (plan_step's), each from the front of the line, and a leaving request's blocks, wiped, join its back in table order
# (Part 4: its keyed ones only, kept). No block is nearer than another: the order only makes a run predictable by hand.
# When a step needs a block and none is free, the most recently admitted request still in a slot gives its blocks back
# (a bystander, perhaps, not the request short of a block) and returns to the head of the queue with its tokens:
# preemption by recompute, vLLM's default. It comes back in a later step, never the one that preempted it, into the
# lowest free slot (not its old one), once admission's rule lets it; until then the queue behind it waits. Taken in
# again, it feeds its prompt and answer again under the same prompt budget (Part 4: only what it does not find), and its
# generator carries on. Admission counts, as vLLM's v0 scheduler did (can_allocate, with its watermark of free blocks),
# each request's whole sequence so far and a little room to grow, however few tokens it has left to make: for n tokens,
# ceil((n + ROOM_TO_GROW) / block_size) blocks. Without it, a newcomer took the last free blocks and was preempted a
# step or two later to feed its prompt all over again (docs/benchmarks.md). A newcomer onto an empty belt gets no room:
# the input checks saw to it that its whole sequence fits.

ROOM_TO_GROW = 3  # tokens of growth kept free for each request at admission: the fewest that end the demo's thrash


class BlockPool(SlotBlocks):
    """SlotBlocks' answers, for a pool of blocks: which are free, in the line they are taken from,
    and which requests hold the others (nano-vllm's BlockManager)."""

    def __init__(self, model, n_blocks, block_size):
        self.cache = model.new_cache(n_blocks, block_size)  # the one large allocation: every block of the pool
        self.block_size = block_size
        self.free_blocks = deque(range(n_blocks))  # the line of free blocks: taken from the front
        self.holders = []  # the requests in a slot, in order of admission: the last gives way first

    def n_blocks_needed(self, run, n_positions):
        """Blocks run must take so that its block table holds its first n_positions."""
        return max(0, math.ceil(n_positions / self.block_size) - len(run.block_table))

    def n_blocks_due(self, work):
        """Blocks the step's feeds must take: each run's cached positions and what it feeds now."""
        return sum(self.n_blocks_needed(run, run.n_cached + len(ids)) for run, ids in work)

    def admit(self, run, slot, belt):
        """Seat run in the free slot if the free blocks hold, for it and for each request on the belt,
        its whole sequence so far (fed or not: a prompt, or a preempted request's prompt and answer)
        beyond the blocks it holds, and, unless the belt is empty, ROOM_TO_GROW tokens more (even past its
        max_new_tokens) -> whether it did. That is never less than a step feeds: a step that admits never preempts."""
        room = ROOM_TO_GROW if self.holders else 0  # alone, it grows into blocks no one else wants
        on_belt = [held for held in belt if held is not None] + [run]
        n_needed = sum(self.n_blocks_needed(held, len(held.request.prompt) + len(held.tokens) + room)
                       for held in on_belt)
        if n_needed > len(self.free_blocks) and not self.holders:  # alone, though the input checks saw to it: a bug
            raise RuntimeError(f"{len(self.free_blocks)} free blocks cannot take request {run.request_index} alone")
        if n_needed > len(self.free_blocks):
            return False
        run.slot, belt[slot] = slot, run
        self.holders.append(run)
        return True

    def make_room(self, work, belt, waiting, prefill_chunk):
        """Take the blocks that the step's work needs -> (the work, the request indices preempted). While too few are
        free, the most recently admitted request still in a slot is preempted, and the step planned again without it:
        even one that holds no block yet (its prompt waits for the budget) gives way, at no cost, so that an older
        request never waits behind a newer one. The first admitted never gives way: the input checks saw to it that
        the pool holds any one request's whole sequence."""
        preempted = []
        while self.n_blocks_due(work) > len(self.free_blocks):
            victim = self.holders[-1]
            self.vacate(victim, belt)
            waiting.appendleft(victim)  # its tokens and generator kept: it goes on where it was
            preempted.append(victim.request_index)
            work = plan_step(belt, prefill_chunk)
        for run, ids in work:  # in the step's order: decoding requests by index, then prompts by arrival
            for _ in range(self.n_blocks_needed(run, run.n_cached + len(ids))):
                run.block_table.append(self.take_block())
        return work, preempted

    def take_block(self):  # a free block for new work: the front of the line
        return self.free_blocks.popleft()

    def vacate(self, run, belt):
        """As per slot (what it wrote wiped, its slot emptied), and its blocks to the back of the line."""
        self.free_blocks.extend(run.block_table)
        self.holders.remove(run)
        super().vacate(run, belt)

    def block_tables(self, belt):  # each slot's blocks, for pack_step (an empty slot: none)
        return [run.block_table if run else [] for run in belt]


# ---------------------------------------------------------------------------------------------
# Part 4, prefix caching: a shared prompt's blocks computed once
#
# Chat requests share a system prompt, agents whole conversations. A full block's keys and values depend only on the
# tokens up to its end, so a request whose sequence starts with the same tokens may take that block into its block table
# instead of computing it again (vLLM's automatic prefix caching, SGLang's RadixAttention, nano-vllm's block manager). A
# full block's key is its tokens and its parent's key, so equal blocks after different prefixes never match; answer
# blocks get keys too, so a preempted request finds its own again. A request takes the blocks found, anyone's, wholly
# before its last token, which it always feeds: it samples, and never writes into a shared block. A block is keyed once,
# after the forward that wrote it: at the next admission tried (refused or not; none is tried while nobody waits or no
# slot is free), the belt's in slot order, or as its request leaves. A request's blocks are let go one by one, in table
# order; one that no table lists any more is free: if keyed, at the back of the free line, kept, matchable; if plain,
# wiped, at its front (plain ones freed together stand there reversed). New work takes the front: plain blocks, then
# kept ones, least recently used first.

class PrefixCache(BlockPool):
    """A BlockPool whose full blocks outlive their requests, found again by key at admission."""

    def __init__(self, model, n_blocks, block_size):
        super().__init__(model, n_blocks, block_size)
        self.n_tables = [0] * n_blocks  # how many block tables list each block: a shared one, several
        self.key_of, self.block_with = {}, {}  # each keyed block's key; the block that holds each key
        self.n_keyed = {}  # request index -> how many blocks of its table are keyed (found ones are)
        self.evicted = []  # the kept blocks that this step's new work took, for its report: make_room's

    def keys(self, run, n_blocks):
        """Keys of run's first n_blocks full blocks, each (parent's key, tokens): equal keys, equal prefixes."""
        keys = run.block_keys  # made once, kept with the request: at a refused try too, and across a preemption
        if len(keys) < n_blocks:  # only the keys not made yet
            sequence = run.request.prompt + run.tokens
            for start in range(len(keys) * self.block_size, n_blocks * self.block_size, self.block_size):
                keys.append((keys[-1] if keys else None, tuple(sequence[start:start + self.block_size])))
        return keys[:n_blocks]

    def key_written(self, runs):
        """Key the full blocks forwards wrote for these runs, each once (a key held already stays with its block)."""
        for run in runs:
            n_keyed, n_written = self.n_keyed[run.request_index], run.n_cached // self.block_size
            for block, key in zip(run.block_table[n_keyed:n_written], self.keys(run, n_written)[n_keyed:]):
                if key not in self.block_with:
                    self.key_of[block], self.block_with[key] = key, block
            self.n_keyed[run.request_index] = n_written

    def admit(self, run, slot, belt):
        """As BlockPool admits, after run takes the longest run of blocks found in the cache, anyone's."""
        self.key_written(held for held in belt if held)  # what the forwards so far wrote, run admitted or not
        n_matchable = (len(run.request.prompt) + len(run.tokens) - 1) // self.block_size  # before its last token
        for key in self.keys(run, n_matchable):
            if key not in self.block_with:
                break
            block = self.block_with[key]
            if self.n_tables[block] == 0:  # a kept free block, out of the line: admission counts it as run's
                self.free_blocks.remove(block)
            self.n_tables[block] += 1
            run.block_table.append(block)
        if not super().admit(run, slot, belt):
            self.release(run)  # it waits, holding nothing: what it found, kept, at the back of the line
            return False
        run.n_cached = run.n_found = len(run.block_table) * self.block_size
        self.n_keyed[run.request_index] = len(run.block_table)  # the blocks found are keyed already
        return True

    def make_room(self, work, belt, waiting, prefill_chunk):  # as BlockPool's, its evictions recorded afresh
        self.evicted = []
        return super().make_room(work, belt, waiting, prefill_chunk)

    def take_block(self):  # the front of the line: plain free blocks first, then kept ones, least recently used first
        block = super().take_block()
        if block in self.key_of:  # evicted: its key forgotten, its keys wiped
            del self.block_with[self.key_of.pop(block)]
            self.cache.clear([block], self.block_size)
            self.evicted.append(block)
        self.n_tables[block] = 1
        return block

    def release(self, run):
        """run's blocks let go: one that no table lists any more is free, kept if keyed (at the back
        of the line, the most recently used), else wiped (at the front, taken first)."""
        for block in run.block_table:
            self.n_tables[block] -= 1
            if self.n_tables[block] == 0 and block in self.key_of:
                self.free_blocks.append(block)
            elif self.n_tables[block] == 0:
                self.cache.clear([block], self.block_size)
                self.free_blocks.appendleft(block)
        run.block_table, run.n_cached = [], 0

    def vacate(self, run, belt):  # as BlockPool's, but what forwards wrote for it is kept, matchable
        self.key_written([run])
        del self.n_keyed[run.request_index]  # counted again if it comes back
        self.release(run)
        self.holders.remove(run)
        belt[run.slot] = None

    @property
    def kept(self):  # free blocks that keep their keys, least recently used first
        return [block for block in self.free_blocks if block in self.key_of]


# ---------------------------------------------------------------------------------------------
# Part 5, serving live: requests that arrive while the belt runs, tokens that stream, callers that go
#
# LiveRequests answers the calls RequestList answers for a list. Arrived: whatever other threads submitted
# since the last step, taken in at this step (its `arrival`); idle, the loop waits on a condition for the
# next submission, using no CPU. Each new token goes to its request's Stream in the step that samples it.
# A cancelled request leaves at the next step boundary, from the queue or from its slot as a retirement
# (its slot and blocks back, a prefix cache keeping what it wrote), told "abort".

class Stream:
    """A submitted request's handle: iterate it (once) for (token, finish_reason) as the steps make them; the last
    pair has a finish_reason ("eos", "length", "context", or "abort" with token None), then .completion holds its
    Completion. cancel() from any thread. on_item, if given, takes each item instead: the engine's thread calls it."""

    def __init__(self, request_index, request, on_item=None):
        self.request_index, self.request = request_index, request
        self.items = queue.Queue()  # (token, finish_reason), or the engine's error, put by the engine's thread
        self.put = on_item or self.items.put  # where the engine's thread hands each item
        self.completion, self.is_cancelled = None, False
        self.submitted_at = time.perf_counter()  # its arrival: its times count from here, not from a step

    def __iter__(self):
        finish_reason = None
        while finish_reason is None:
            item = self.items.get()
            if isinstance(item, BaseException):  # the engine failed: raised in the reader's thread too
                raise item
            token, finish_reason = item
            yield token, finish_reason

    def cancel(self):  # it leaves at the next step boundary; once it has finished, this does nothing
        self.is_cancelled = True


class LiveRequests:
    """generate on a thread of its own, the engine, which `with` starts and joins; other threads only submit,
    read and cancel: `with LiveRequests(model, **generate's options) as live: stream = live.submit(request)`."""
    completions = None  # what generate returns: live, each Stream holds its own

    def __init__(self, model, **options):
        self.model, self.options, self.device = model, options, model.lm_head.weight.device
        self.changed = threading.Condition()  # guards the next two lines; notified on a submission and the close
        self.submitted, self.n_submitted = deque(), 0  # Streams not taken in yet; request indices handed out
        self.is_closed, self.is_aborting, self.error = False, False, None
        self.started = threading.Event()  # set once generate has checked its arguments and made its cache
        self.streams = {}  # request index -> Stream, for requests in the loop: the engine's thread only

    def __enter__(self):  # the engine's thread, then wait until generate has checked its arguments
        self.thread = threading.Thread(target=self.serve, name="nanobatch engine", daemon=True)
        self.thread.start()
        self.started.wait()
        if self.error:
            self.close()  # joins the thread, raises the error
        return self

    def serve(self):  # the engine's thread: the loop, and its error carried to every reader
        try:
            generate(self.model, self, **self.options)
        except BaseException as error:
            with self.changed:
                self.error, self.is_closed = error, True
                for stream in [*self.streams.values(), *self.submitted]:
                    stream.put(error)
            self.started.set()

    def submit(self, request, on_item=None):  # into the queue -> its Stream; one generate would refuse: a ValueError
        request = check_request(self.model, request, "request", self.options.get("max_len") or
                                self.model.config.block_size, self.options.get("kv_blocks"),
                                self.options.get("kv_block_size", 16))  # generate's defaults
        with self.changed:
            if self.is_closed:
                raise RuntimeError("LiveRequests is closed: it takes no more requests") from self.error
            stream, self.n_submitted = Stream(self.n_submitted, request, on_item), self.n_submitted + 1
            self.submitted.append(stream)
            self.changed.notify_all()
        return stream

    def close(self, abort=False):  # no more submissions; the loop ends drained, or (abort) all aborted
        with self.changed:
            self.is_closed, self.is_aborting = True, self.is_aborting or abort
            self.changed.notify_all()
        self.thread.join()
        if self.error:
            raise self.error

    def __exit__(self, *exception):  # left on an error, the requests in flight are aborted
        self.close(abort=exception[0] is not None)

    def more_to_come(self):  # idle: wait for a submission -> False once closed with none left
        self.started.set()  # the first call: generate has checked its arguments and made its cache
        with self.changed:
            self.changed.wait_for(lambda: self.submitted or self.is_closed)
            return bool(self.submitted)

    def next_arrival(self, step):  # a live request arrives at the step that takes it in: the clock stays
        return step

    def arrived(self, step, step_start):  # -> what was submitted since the last step, as Running
        with self.changed:
            streams, self.submitted = self.submitted, deque()
        self.streams.update((stream.request_index, stream) for stream in streams)
        return [Running(stream.request_index, request := replace(stream.request, arrival=step),
                        sampler=new_sampler(request, self.device), arrived_at=stream.submitted_at)
                for stream in streams]

    def cancelled(self, step, waiting, belt, held):  # the cancelled (aborting: all) leave, told "abort"
        # One whose prompt the prefill worker holds (Part 2) leaves once handed back: the worker writes its slot.
        leaving = [run for run in [*waiting, *belt] if run and run.request_index not in held and
                   (self.is_aborting or self.streams[run.request_index].is_cancelled)]
        for run in leaving:
            run.finish("abort", step)
            self.hear(run, None)
        return leaving

    def hear(self, run, token):  # an item to run's Stream now; its last, with the Completion, ends the stream
        stream = self.streams.pop(run.request_index) if run.completion else self.streams[run.request_index]
        stream.completion = run.completion
        stream.put((token, run.completion and run.completion.finish_reason))


# ---------------------------------------------------------------------------------------------
# Checking the input before any work, so that nothing fails halfway: plain types, or a ValueError naming the field

def is_int(value):
    """True for an int or a numpy integer; False for a bool, though Python counts it as an int (True + True == 2):
    a bool where a count or a token id belongs is a mistake, not a 1."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def checked_int(value, name, lowest, highest=None, *, may_be_none=False):
    """value as a plain int in lowest..highest (highest None: no bound), or a ValueError naming it."""
    if value is None and may_be_none:
        return None
    if not (is_int(value) and lowest <= value and (highest is None or value <= highest)):
        bounds = f">= {lowest}" if highest is None else f"in {lowest}..{highest}"
        raise ValueError(f"{name} must be an int {bounds}{' or None' if may_be_none else ''}, "
                         f"got {reprlib.repr(value)}")
    return int(value)


def checked_temperature(value, name):
    """value as a plain float, finite and >= 0, or a ValueError naming the field."""
    try:
        is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        temperature = float(value) if is_real else math.nan
    except OverflowError:  # an int too large for any float
        temperature = math.inf
    if not 0 <= temperature < math.inf:  # NaN fails every comparison
        raise ValueError(f"{name} must be a real number, finite and >= 0, got {reprlib.repr(value)}")
    return temperature


def token_ids(prompt, name, vocab_size):
    """The prompt as a plain list[int]: a list, a tuple, a 1-D integer tensor or numpy array will do."""
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"{name} must be token ids, got a {type(prompt).__name__}: encode the text first")
    if hasattr(prompt, "tolist"):  # a tensor or a numpy array: tolist() gives its ids as Python numbers
        if getattr(prompt, "ndim", 1) != 1:
            raise ValueError(f"{name} must be a 1-D sequence of int token ids, "
                             f"got a {prompt.ndim}-D {type(prompt).__name__}")
        prompt = prompt.tolist()
    elif not isinstance(prompt, Sequence):  # a set or a generator has no order to trust, or no length
        raise ValueError(f"{name} must be a 1-D sequence of int token ids, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError(f"{name} is empty: it needs at least one token id")
    for index, token in enumerate(prompt):  # a float tensor's ids come out as floats, a bool one's as bools
        if not is_int(token):
            raise ValueError(f"{name} must be a 1-D sequence of int token ids, but index {index} holds "
                             f"{reprlib.repr(token)}, a {type(token).__name__}")
        if not 0 <= token < vocab_size:
            raise ValueError(f"{name} has token id {token} (at index {index}), outside the vocabulary "
                             f"0..{vocab_size - 1}")
    return [int(token) for token in prompt]  # numpy integers become ints; the caller's list is not shared


SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes (a negative seed wraps around)


def check_arguments(model, requests, n_slots, max_len, eos_id, policy, prefill_chunk=None, disaggregate=False,
                    kv_blocks=None, kv_block_size=16, prefix_cache=False):
    """Reject, before any work, everything that could not be served -> the requests as new, checked
    copies in plain Python types (the caller's are left as they were)."""
    V, block_size, device = model.config.vocab_size, model.config.block_size, model.lm_head.weight.device
    if torch.is_autocast_enabled(device.type):
        raise ValueError(f"generate does not run under torch.autocast: its KV cache holds keys and values in "
                         f"the model's dtype, {model.lm_head.weight.dtype}, and autocast would compute them in "
                         f"another. Convert the model instead, outside autocast: model.to(torch.bfloat16)")
    if not (isinstance(policy, str) and policy in POLICIES):
        raise ValueError(f"policy must be one of {POLICIES}, got {reprlib.repr(policy)}")
    checked_int(n_slots, "n_slots", 1)
    if not (is_int(max_len) and 2 <= max_len <= block_size):
        raise ValueError(f"max_len must be an int in 2..{block_size} (the model's block_size), "
                         f"got {reprlib.repr(max_len)}")
    checked_int(eos_id, "eos_id", 0, V - 1, may_be_none=True)
    checked_int(prefill_chunk, "prefill_chunk", 1, may_be_none=True)
    if not isinstance(disaggregate, bool):
        raise ValueError(f"disaggregate must be True or False, got {reprlib.repr(disaggregate)}")
    if disaggregate and policy == "static":
        raise ValueError("disaggregate=True needs policy='continuous': a static batch prefills its prompts "
                         "together as it starts, with no stream of prompts for a prefill worker to take")
    checked_int(kv_blocks, "kv_blocks", 1, may_be_none=True)
    checked_int(kv_block_size, "kv_block_size", 1)
    if not isinstance(prefix_cache, bool) or (prefix_cache and kv_blocks is None):
        raise ValueError(f"prefix_cache must be True or False, and True needs kv_blocks, "
                         f"got {reprlib.repr(prefix_cache)}")
    if kv_blocks is None and kv_block_size != 16:
        raise ValueError(f"kv_block_size={kv_block_size} applies to a paged cache only: pass kv_blocks too")
    if kv_blocks is not None and (policy == "static" or disaggregate):
        raise ValueError("kv_blocks needs policy='continuous' and disaggregate=False: a static batch's idle slots "
                         "feed padding into positions of their own, and the prefill worker fills a slot's max_len")
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise ValueError(f"requests must be an iterable of Request, got {type(requests).__name__}")
    checked = [check_request(model, r, f"requests[{i}]", max_len, kv_blocks, kv_block_size)
               for i, r in enumerate(requests)]  # read once: a generator is used up by it
    shape = (n_slots, max_len, "slots") if kv_blocks is None else (kv_blocks, kv_block_size, "blocks")  # the cache's
    check_cache_fits(model.config, *shape[:2], device, model.lm_head.weight.dtype, unit=shape[2])  # model.py
    return checked


def check_request(model, r, name, max_len, kv_blocks, kv_block_size):
    """One request checked -> a copy in plain types, each number checked as it is converted."""
    if not isinstance(r, Request):
        raise ValueError(f"{name} must be a Request, got {type(r).__name__}")
    if not isinstance(r.ignore_eos, bool):
        raise ValueError(f"{name}.ignore_eos must be True or False, got {reprlib.repr(r.ignore_eos)}")
    prompt = token_ids(r.prompt, f"{name}.prompt", model.config.vocab_size)
    if len(prompt) >= max_len:
        raise ValueError(f"{name}.prompt has {len(prompt)} tokens, which leaves no room in "
                         f"max_len={max_len}: at most {max_len - 1} fit")
    checked = replace(r, prompt=prompt, max_new_tokens=checked_int(r.max_new_tokens, f"{name}.max_new_tokens", 1),
                      temperature=checked_temperature(r.temperature, f"{name}.temperature"),
                      top_k=checked_int(r.top_k, f"{name}.top_k", 1, may_be_none=True),
                      seed=checked_int(r.seed, f"{name}.seed", *SEED_RANGE, may_be_none=True),
                      arrival=checked_int(r.arrival, f"{name}.arrival", 0))
    n_needed = math.ceil(min(len(prompt) + checked.max_new_tokens, max_len) / kv_block_size)
    if kv_blocks is not None and n_needed > kv_blocks:  # alone, and still out of blocks: it could never finish
        raise ValueError(f"kv_blocks={kv_blocks} cannot hold {name}'s whole sequence (its prompt and "
                         f"max_new_tokens, at most max_len): it needs {n_needed} blocks of {kv_block_size} "
                         f"positions")
    return checked


# ---------------------------------------------------------------------------------------------
# What a step reports, the figures of a run, and the belt on screen: for --demo, --prompt and tools/

def letter(request_index):
    """The request's name on screen: A-Z, then a-z, then A again."""
    letters = string.ascii_uppercase + string.ascii_lowercase
    return letters[request_index % len(letters)]


@dataclass
class StepReport:
    step: int
    belt: str  # a character per slot: letter() of who made a token there, '~' a request that made none, '.' idle
    n_running: int  # requests that made a token this step
    n_prefilling: int  # requests in a slot that made none: a prompt going in (Part 3: a comeback's prompt and answer)
    n_waiting: int  # arrived requests still queued
    n_prompt_tokens: int  # prompt tokens that went through the model this step
    admitted: list[int]  # request indices that took a slot this step
    finished: list[tuple[int, Completion]]  # (request index, its completion)
    model_s: float  # seconds in the forward pass and sampling, until the tokens were back
    step_s: float  # seconds for the whole step, the scheduling around the model included
    sampled: list[int]  # request indices that made a token, in the order of logits' rows
    logits: torch.Tensor  # (R, V): the logits those tokens were sampled from
    packed: PackedStep | None  # what the step's forward ran on, as model.forward_packed took it; None: no forward
    occupants: list[int | None] = field(default_factory=list)  # each slot's request index in the step (None: empty)
    waiting: list[int] = field(default_factory=list)  # the queue after phase 3 (its preempted at the head), in order
    kv_used: int = 0  # positions holding a token of a request in a slot after the forward, before phase 7: the
    #                   slots' n_cached, a shared block's once (a finishing request's count; the preempted's, kept not)
    n_cached: list[int] = field(default_factory=list)  # each slot's share of kv_used (0: an empty slot)
    kv_total: int = 0  # the cache's positions: n_slots x max_len, or (Part 3) the pool's
    handed_over: list[int] = field(default_factory=list)  # Part 2: prompts the worker handed over this step
    at_worker: list[int] = field(default_factory=list)  # Part 2: prompts the worker holds after the step
    kv_bytes: int = 0  # bytes of keys and values the worker copied into their slots
    kv_s: float = 0.0  # seconds those copies took, on the worker's side
    preempted: list[int] = field(default_factory=list)  # Part 3: requests sent back to the queue this step
    found_cached: list[int] = field(default_factory=list)  # Part 4: positions each admitted one found (its own too)
    cached_free: list[int] = field(default_factory=list)  # Part 4: free blocks kept, least recently used first,
    #                                                       after the forward, before phase 7 retires anyone
    kv_kept: int = 0  # Part 4: positions in those kept blocks, which hold keys for a match but no request's token
    evicted: list[int] | None = None  # Part 4: kept blocks this step's new work took, keys dropped (None: no cache)
    block_tables: list[list[int]] = field(default_factory=list)  # each slot's blocks, as cached_free's (per slot: [s])
    kv_used_after: int = 0  # kv_used once phase 7 has retired the step's finished requests: what the next step finds


def step_report(step, step_start, belt, waiting, blocks, prompts, admitted, preempted, packed, n_prompt_tokens,
                logits, model_s, handovers, sampled, finished):
    """The step's StepReport, from what the loop recorded and the belt before phase 7; made only if asked."""
    made_a_token = {run.request_index for run in sampled}  # a comeback fed all but its newest: no token, nor prefilling
    return StepReport(
        step=step, n_running=len(sampled), n_waiting=len(waiting),
        belt="".join("." if run is None else letter(run.request_index) if run.request_index in made_a_token else "~"
                     for run in belt),
        n_prefilling=sum(run is not None and run.request_index not in made_a_token for run in belt),
        n_prompt_tokens=n_prompt_tokens,
        admitted=[run.request_index for run in admitted], found_cached=[run.n_found for run in admitted],
        cached_free=list(blocks.kept), kv_kept=len(blocks.kept) * blocks.cache.block_size,
        evicted=blocks.evicted,  # Part 4's record, a new list each step; SlotBlocks, BlockPool: None
        finished=[(run.request_index, run.completion) for run in finished],
        model_s=model_s, step_s=time.perf_counter() - step_start, sampled=[run.request_index for run in sampled],
        logits=torch.cat([logits] + [handover.logits[None] for handover in handovers]) if handovers else logits,
        packed=packed if len(packed.tokens) else None,  # no token fed (Part 2: all at the worker), no forward to show
        occupants=[None if run is None else run.request_index for run in belt],
        waiting=[run.request_index for run in waiting],
        kv_used=positions_in_use(belt, blocks.cache.block_size), kv_total=blocks.cache.n_positions,
        n_cached=[run.n_cached if run else 0 for run in belt],
        handed_over=[handover.run.request_index for handover in handovers],
        at_worker=[run.request_index for run in belt if run and run.request_index in prompts.holding],
        kv_bytes=sum(handover.kv_bytes for handover in handovers), kv_s=sum(handover.kv_s for handover in handovers),
        preempted=preempted, block_tables=[list(run.block_table) if run else [] for run in belt],
        kv_used_after=positions_in_use([run for run in belt if run and not run.completion], blocks.cache.block_size))


def positions_in_use(belt, block_size):
    """Cache positions that hold a token: each block's written positions, counted once however many
    requests share the block (Part 4), and a per-slot block's as its slot's n_cached."""
    written = {}  # block -> its positions written
    for run in filter(None, belt):
        for first_position, block in zip(range(0, run.n_cached, block_size), run.block_table):
            written[block] = max(written.get(block, 0), min(block_size, run.n_cached - first_position))
    return sum(written.values())


def percentile(values, q):
    """Nearest rank: the smallest value with at least q% of all values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


LEGEND = {  # each figure of summarize(), in the table's order, and what it counts
    "steps": "loop steps run, each one forward over what the belt holds",
    "generated tokens": "tokens sampled, all requests together",
    "wall time (s)": "seconds for the whole run",
    "tokens/s": "generated tokens / wall time",
    "tokens/s while queued": "the same, over the steps that left a request waiting: the rate under load",
    "mean occupancy": "share of slot-steps holding a request (taking in its prompt, or decoding)",
    "occupancy while queued": "the same, over the steps that left a request waiting: below 100% is waste",
    "latency P50/P99 (steps)": "steps from a request's arrival to its last token: median / 99th percentile",
    "latency P50/P99 (s)": "the same in seconds",
    "TTFT P50/P99 (steps)": "time to first token: steps from a request's arrival to its first token",
    "TTFT P50/P99 (s)": "the same in seconds",
    "TBT P50/P99 (ms)": "time between tokens: the gaps between a request's consecutive tokens",
    "slowest step (ms)": "the longest pause any request saw between two of its tokens, however rare",
    "time outside the model": "share of the wall time spent scheduling and printing, not in the model "
                              "(disaggregated: also waiting for the prefill worker)",
    "KV moved (MB / ms)": "disaggregated: keys and values the prefill worker copied into decode slots, and "
                          "the seconds its copies took",
    "KV cache in use": "cache positions holding a token of a request in a slot (kv_used: free kept blocks not "
                       "counted), a share of all the cache has: mean / peak over the steps",
    "preemptions": "paged: requests sent back to the queue for their blocks, to feed prompt and answer again "
                   "(with a prefix cache, what they do not find)",
    "prefix cache hits": "positions admissions found cached (Part 4; a preempted request finding its own blocks "
                         "again counts), a share of all they brought into the cache: those found, and the prompt "
                         "tokens fed. '-': no prefix cache",
}


def summarize(requests, completions, reports, wall_s):
    """The figures of one run, named as in LEGEND. Throughput and occupancy come from its step
    reports, so a run cut short still counts the tokens of requests that had not finished;
    latencies come from the completions (None for a request not finished)."""
    n_slots = len(reports[0].belt)
    done = [(r, c) for r, c in zip(requests, completions) if c is not None]
    queued = [report for report in reports if report.n_waiting > 0]  # steps that left someone waiting

    def occupancy(steps):  # slots holding a request (making a token, or taking in its prompt)
        busy = sum(report.n_running + report.n_prefilling for report in steps)
        return busy / (len(steps) * n_slots) if steps else None

    def p50_p99(values):
        return (percentile(values, 50), percentile(values, 99)) if values else None

    n_tokens = sum(report.n_running for report in reports)
    n_found, n_fed = sum(sum(report.found_cached) for report in reports), sum(r.n_prompt_tokens for r in reports)
    in_use = [report.kv_used / report.kv_total for report in reports if report.kv_total]  # each step's share
    gaps_ms = [1e3 * (later - earlier) for _, c in done for earlier, later in zip(c.token_times_s, c.token_times_s[1:])]
    return {
        "steps": len(reports),
        "generated tokens": n_tokens,
        "wall time (s)": wall_s,
        "tokens/s": n_tokens / wall_s,
        "tokens/s while queued": (sum(report.n_running for report in queued) / sum(report.step_s for report in queued)
                                  if queued else None),
        "mean occupancy": occupancy(reports),
        "occupancy while queued": occupancy(queued),
        "latency P50/P99 (steps)": p50_p99([c.finish_step - r.arrival + 1 for r, c in done]),
        "latency P50/P99 (s)": p50_p99([c.latency_s for _, c in done]),
        "TTFT P50/P99 (steps)": p50_p99([c.first_token_step - r.arrival + 1 for r, c in done]),
        "TTFT P50/P99 (s)": p50_p99([c.ttft_s for _, c in done]),
        "TBT P50/P99 (ms)": p50_p99(gaps_ms),
        "slowest step (ms)": max(gaps_ms, default=None),  # a step no decoding request waited for is no pause
        "time outside the model": 1 - sum(report.model_s for report in reports) / wall_s,
        "KV moved (MB / ms)": ((sum(report.kv_bytes for report in reports) / 1e6,
                                1e3 * sum(report.kv_s for report in reports))
                               if any(report.handed_over for report in reports) else None),
        "KV cache in use": (sum(in_use) / len(in_use), max(in_use)) if in_use else None,
        "preemptions": sum(len(report.preempted) for report in reports),
        "prefix cache hits": (n_found / (n_found + n_fed) if n_found + n_fed and reports[0].evicted is not None
                              else None),  # evicted is None: no prefix cache ran
    }


def print_table(summaries, legend=False):
    """{run name: summarize(...)}, side by side; legend: then a line saying what each row counts."""
    def cell(row, value):
        if isinstance(value, tuple):
            return " / ".join(cell(row, v) for v in value)
        if value is None:
            return "-"
        if "occupancy" in row or "outside" in row or "in use" in row or "hits" in row:
            return f"{value:.0%}"
        if isinstance(value, int):
            return str(value)
        return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f}"  # 3 digits, or all before the point

    print(f"\n{'':24}" + "".join(f"{name:>18}" for name in summaries))
    for row in LEGEND:
        print(f"{row:24}" + "".join(f"{cell(row, summary[row]):>18}" for summary in summaries.values()))
    if legend:
        print("\n" + "\n".join(f"{row}: {meaning}" for row, meaning in LEGEND.items()))


def print_step(report):
    """One line per step; read down the screen, the columns are the belt moving."""
    found = dict(zip(report.admitted, report.found_cached))  # Part 4: positions found cached, shown if any
    events = [f"+{letter(i)}" + (f"({found[i]} found)" if found.get(i) else "") for i in report.admitted]
    events += [f">{letter(i)}" for i in report.handed_over]
    events += [f"-{letter(i)}({c.finish_reason},{len(c.tokens)})" for i, c in report.finished]
    events += [f"!{letter(i)}" for i in report.preempted]
    print(f"step {report.step:4d} |{report.belt}| {report.n_running:2d}/{len(report.belt)} "
          f"waiting {report.n_waiting:3d}  {' '.join(events)}".rstrip(), flush=True)


# ---------------------------------------------------------------------------------------------
# The command line: --demo and --prompt here; tools/ measures, verifies and draws with the same parts

def fail(message):
    """The one-line end for what nanobatch refuses: bad input, a missing or damaged file, no network.
    Any other error (in torch: a wrong shape, out of memory) keeps its traceback."""
    print(f"{os.path.basename(sys.argv[0]) or 'nanobatch.py'}: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_runs(model, requests, runs, args, eos_id):
    """What generate would refuse in any of the runs, refused in one line before anything is printed."""
    for _, n_slots, policy, prefill_chunk, disaggregate, kv_blocks, prefix_cache in runs:
        try:
            check_arguments(model, requests, n_slots, args.max_len or model.config.block_size, eos_id, policy,
                            prefill_chunk, disaggregate, kv_blocks, args.kv_block_size, prefix_cache)
        except ValueError as e:
            fail(e)


def run_all(model, requests, runs, args, eos_id, show_belt):
    """Serve the same requests once per run, (name, n_slots, policy, prefill_chunk, disaggregate,
    kv_blocks, prefix_cache) -> ({name: summarize(...)}, {name: completions}, {name: step reports}); args.max_len and
    args.kv_block_size hold for every run. Ctrl-C prints the figures so far, exits 130."""
    check_runs(model, requests, runs, args, eos_id)
    summaries, completions, all_reports = {}, {}, {}
    for name, n_slots, policy, prefill_chunk, disaggregate, kv_blocks, prefix_cache in runs:
        where = f"; {placement(model.lm_head.weight.device)}" if disaggregate else ""
        if show_belt:
            prompt_mark = "with the prefill worker; '>A': A's keys and values handed over" if disaggregate else \
                "not all in yet"
            paged = f", a pool of {kv_blocks} blocks of {args.kv_block_size} ('!K': K preempted)" if kv_blocks else ""
            paged += ", a prefix cache ('+K(N found)': K found N positions cached)" if prefix_cache else ""
            print(f"\n== {name}: {len(requests)} requests, {n_slots} slots{paged} (letter: the request that made a "
                  f"token in that slot; '~': its prompt {prompt_mark}; '.': a slot doing no useful work){where}")
        elif disaggregate:
            print(f"{name}: {where[2:]}")
        reports, start = [], time.perf_counter()

        def on_step(report):
            reports.append(replace(report, logits=None))  # no (R, V) per step; the packed step is small
            if show_belt:
                print_step(report)
            elif sys.stderr.isatty():  # a long quiet run still shows that it is alive
                print(f"\r{name}: step {report.step}", end="", file=sys.stderr, flush=True)

        try:
            completions[name] = generate(model, requests, n_slots=n_slots, max_len=args.max_len, eos_id=eos_id,
                                         policy=policy, prefill_chunk=prefill_chunk, on_step=on_step,
                                         disaggregate=disaggregate, kv_blocks=kv_blocks,
                                         kv_block_size=args.kv_block_size, prefix_cache=prefix_cache)
        except KeyboardInterrupt:  # the figures so far: who finished, the steps' reports say
            done = {i: completion for report in reports for i, completion in report.finished}
            finished = [done.get(i) for i in range(len(requests))]
            print(f"\ninterrupted after {len(reports)} steps of {name}: tokens and occupancy count every request "
                  f"that ran, latencies only the {sum(c is not None for c in finished)} of {len(requests)} that "
                  f"finished")
            if reports:
                summaries[f"{name} (cut)"] = summarize(requests, finished, reports, time.perf_counter() - start)
            if summaries:
                print_table(summaries)
            sys.exit(130)  # 128 + SIGINT: how a shell reports a program that Ctrl-C stopped
        wall_s = time.perf_counter() - start
        summaries[name], all_reports[name] = summarize(requests, completions[name], reports, wall_s), reports
        if not show_belt:
            print(f"\r{name}: {len(requests)} requests in {wall_s:.1f} s", file=sys.stderr)
    return summaries, completions, all_reports


# ---------------------------------------------------------------------------------------------
# Where the work runs: waiting for a GPU's stream; each side of a disaggregated run, in code and in words

def synchronize(device):
    """Wait for what this thread queued on a GPU (queued, not done, when Python moves on): its stream only."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def prefill_device(device):
    """The worker's device beside a loop on `device`: a second GPU if there is one, else `device`."""
    n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return torch.device("cuda", (device.index + 1) % n_gpus) if n_gpus > 1 else device


def split_threads(n_threads):
    """A CPU's threads shared out: (the worker's, the decode loop's), at least one each."""
    return max(1, n_threads // 2), max(1, n_threads - n_threads // 2)


def placement(device):
    """Where a disaggregated run's two sides are, in words, for a decode loop on `device`."""
    worker_device = prefill_device(device)
    if device.type == "cpu":
        n_worker, n_loop = split_threads(torch.get_num_threads())
        return f"the prefill worker on {n_worker} of torch's {torch.get_num_threads()} CPU threads, the decode " \
               f"loop on {n_loop}"
    if worker_device == device:
        return f"the prefill worker on {device} too, on a CUDA stream of its own: one GPU, shared by both sides"
    return f"the prefill worker on {worker_device} with a copy of the weights, the decode loop on {device}: keys " \
           f"and values cross between the GPUs"


def long_tailed(rng, n, mean, cap):
    """n answer lengths shaped like chat traffic, many short and a long tail: the n quantiles of a
    capped exponential, in random order, so that the mix is the same for every seed."""
    lengths = [min(cap, 1 + int(-mean * math.log(1 - (i + 0.5) / n))) for i in range(n)]
    rng.shuffle(lengths)
    return lengths


def load_gpt2(weights, batch_invariant=False):
    """Real GPT-2: --weights, else gpt2 from the cache or a download; None if that is offline."""
    try:
        return GPT.from_pretrained(weights or "gpt2", batch_invariant=batch_invariant)
    except (ValueError, OSError) as e:  # offline, or a missing, damaged or foreign checkpoint
        if isinstance(e, ConnectionError) and not weights:
            return None  # the demo runs on random weights instead, and says so
        fail(e)


def load_tokenizer(model):
    """tiktoken's GPT-2 encoding, or None when its files cannot be had or the vocabulary differs."""
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(default_cache_dir() / "tiktoken"))
    try:
        import tiktoken
        tokenizer = tiktoken.get_encoding("gpt2")
    except Exception:  # offline, tiktoken raises its HTTP library's own errors
        return None
    return tokenizer if tokenizer.n_vocab == model.config.vocab_size else None


TINY = GPTConfig(n_layer=2, n_head=4, n_embd=64)  # --quick: the same loop in seconds


def seeded_model(args):
    """--weights, else a random GPT-2 (TINY with --quick), the same for the same --seed."""
    torch.manual_seed(args.seed)
    model = load_gpt2(args.weights, args.batch_invariant) if args.weights else \
        GPT(replace(TINY if args.quick else GPTConfig(), batch_invariant=args.batch_invariant))
    return model.to(args.device, args.dtype).eval()


DEMO_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
                "The three primary colors are", "My favourite recipe for pancakes", "In 1969, the first humans",
                "The quick brown fox", "Dear hiring manager,", "The best way to learn a language is",
                "Q: What is continuous batching?\nA:", "The weather today is", "Breaking news:"]
DEMO_SYSTEM = "You are a helpful assistant. Answer in plain words, briefly, and say so when you do not know.\n\n"
DEMO_PREFILL_CHUNK = 32  # prompt tokens a step in --demo: its 39-token prompt (seed 0) takes two steps, seen as '~'


@dataclass
class Shown:
    """What --demo or --prompt ran, for tools/belt_svg.py and tools/explore.py to draw."""
    requests: list[Request]
    runs: list[tuple]  # (name, n_slots, policy, prefill_chunk, disaggregate, kv_blocks, prefix_cache): run_all's
    completions: dict  # {run name: its Completions}
    summaries: dict  # {run name: summarize(...)}
    reports: dict  # {run name: its StepReports, without logits; each keeps its PackedStep}
    tokenizer: object  # tiktoken's GPT-2 encoding, or None: the prompts were random tokens


def demo(args):
    """A mixed workload through continuous, then static batching, the belt on screen -> what it ran."""
    model = None if args.quick else load_gpt2(args.weights, args.batch_invariant)  # None: --quick, or offline
    has_weights = model is not None
    model = model.to(args.device, args.dtype).eval() if has_weights else seeded_model(args)
    tokenizer = None if args.quick else load_tokenizer(model)
    fed = "text prompts" if tokenizer else "random tokens"
    if args.quick:
        print(f"nanobatch --quick: a tiny randomly initialised GPT-2 on {fed}")
    elif not has_weights:
        print(f"nanobatch: no GPT-2 weights here (offline, none in {default_cache_dir()}), so this is a "
              f"randomly initialised GPT-2 124M on {fed}: the loop runs exactly as with real weights, but "
              f"the answers are noise. Real answers: run once online, or --weights PATH.")
    elif not tokenizer:
        print("nanobatch: no GPT-2 tokenizer for these weights (tiktoken's files offline, or another "
              "vocabulary), so they are fed random tokens")
    n_requests, first_wave = 32, args.slots + args.slots // 2
    lengths = long_tailed(random.Random(args.seed), n_requests, mean=16, cap=64)  # whatever the weights
    rng = random.Random(args.seed + 1)
    # Offline, random prompts, each of 4 to 40 tokens drawn: with the default --seed 0, 5 to 39.
    prompts = [tokenizer.encode(DEMO_PROMPTS[i % len(DEMO_PROMPTS)]) if tokenizer else
               [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(4, 40))] for i in range(n_requests)]
    if args.prefix_cache:  # Part 4: every prompt after one system prompt (offline, 48 random tokens)
        V = model.config.vocab_size
        system = tokenizer.encode(DEMO_SYSTEM) if tokenizer else [rng.randrange(V) for _ in range(48)]
        prompts = [system + prompt for prompt in prompts]
    # A first wave fills the belt and queues up; the rest arrive, one every other step, while it runs.
    requests = [Request(prompt, max_new, args.temperature, args.top_k, seed=args.seed + i,
                        arrival=0 if i < first_wave else 2 * (i - first_wave + 1))
                for i, (prompt, max_new) in enumerate(zip(prompts, lengths))]
    # Disaggregated, the continuous run's prompts go to the worker, whole unless told otherwise. Paged (Part 3),
    # the second run is per slot in the same memory; with the prefix cache (Part 4), the same pool without it.
    prefill_chunk = args.prefill_chunk or DEMO_PREFILL_CHUNK
    name = "prefix cache" if args.prefix_cache else "paged" if args.kv_blocks else \
        "disaggregated" if args.disaggregate else "continuous"
    runs = [(name, args.slots, "continuous", args.prefill_chunk if args.disaggregate else prefill_chunk,
             args.disaggregate, args.kv_blocks, args.prefix_cache)]
    n_positions, max_len = (args.kv_blocks or 0) * args.kv_block_size, args.max_len or model.config.block_size
    if not args.kv_blocks:
        runs.append(("static", args.slots, "static", prefill_chunk, False, None, False))
    elif args.prefix_cache:
        runs.append(("no prefix cache", args.slots, "continuous", prefill_chunk, False, args.kv_blocks, False))
    elif n_positions >= max_len:  # as many slots of max_len as the pool's positions make
        runs.append(("per slot", n_positions // max_len, "continuous", prefill_chunk, False, None, False))
    summaries, completions, reports = run_all(model, requests, runs, args, EOT, show_belt=not args.quiet)
    if tokenizer:
        print_texts(tokenizer, requests, completions[name])
    print_table(summaries, legend=True)
    if args.kv_blocks:
        print(f"\nThe same {n_positions} cache positions" + ("" if len(runs) > 1 else f" (no slot of {max_len})") + ":")
        for (run_name, n_slots, *_), summary in zip(runs, summaries.values()):
            print(f"  {run_name}, {n_slots} slot{'s' * (n_slots > 1)}: up to "
                  f"{max(report.n_running for report in reports[run_name])} requests made a token in one step; "
                  f"{summary['steps']} steps, median TTFT {summary['TTFT P50/P99 (steps)'][0]} steps, "
                  f"{summary['preemptions']} preemptions, "
                  f"{sum(report.n_prompt_tokens for report in reports[run_name])} prompt tokens computed")
    else:
        cont, stat = summaries[name], summaries["static"]
        print(f"\nThe rows to compare: steps and TTFT. The same {cont['generated tokens']} tokens took "
              f"{cont['steps']} steps {name}, {stat['steps']} static, and the median request\nwaited "
              f"{cont['TTFT P50/P99 (steps)'][0]} steps for its first token, against "
              f"{stat['TTFT P50/P99 (steps)'][0]}: static refills the belt only once the longest answer of its "
              f"batch is done.")
    return Shown(requests, runs, completions, summaries, reports, tokenizer)


def prompt_mode(args):
    """Your prompts, real GPT-2, the belt on screen -> what it ran."""
    model = load_gpt2(args.weights, args.batch_invariant)
    tokenizer = model and load_tokenizer(model)
    if not tokenizer:
        fail("--prompt needs GPT-2's weights and tiktoken's files, which are neither cached nor "
             "downloadable here: run once online, or pass --weights PATH")
    model = model.to(args.device, args.dtype).eval()
    requests = [Request(tokenizer.encode(text), args.max_new_tokens, args.temperature, args.top_k,
                        seed=args.seed + i) for i, text in enumerate(args.prompt)]
    name = "disaggregated" if args.disaggregate else args.policy
    run = (name, args.slots, args.policy, args.prefill_chunk, args.disaggregate, args.kv_blocks, args.prefix_cache)
    summaries, completions, reports = run_all(model, requests, [run], args, EOT, show_belt=not args.quiet)
    print_texts(tokenizer, requests, completions[name])
    print_table(summaries, legend=True)
    return Shown(requests, [run], completions, summaries, reports, tokenizer)


def print_texts(tokenizer, requests, completions):
    for i, (request, completion) in enumerate(zip(requests, completions)):
        print(f"{letter(i)} ({completion.finish_reason}): "
              f"{tokenizer.decode(request.prompt)!r} -> {tokenizer.decode(completion.tokens)!r}")


def positive(number_type):
    """An argparse type: a number_type above 0, for the numbers the command line builds work from."""
    def convert(text):
        value = number_type(text)
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    convert.__name__ = number_type.__name__  # argparse's message for 'x' reads "invalid int value"
    return convert


def usable_device(text):
    """An argparse type: a torch.device that this torch can run on."""
    try:
        device = torch.device(text)
    except RuntimeError as e:  # torch's message lists every device type there is: its end says enough
        raise argparse.ArgumentTypeError(str(e).split(": ")[-1] + " is no device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}, but this torch sees no CUDA GPU")
    return device


OPTIONS = {  # each option of nanobatch.py and tools/ once: name -> (argparse's keywords, its default)
    "slots": (dict(type=positive(int), metavar="N", help="slots on the belt: the batch size (8)"), 8),
    "max_len": (dict(type=positive(int), metavar="N", help="positions per slot (the model's, 1024)"), None),
    "prefill_chunk": (dict(type=positive(int), metavar="N", help="at most N prompt tokens a step (--demo: "
                                                       f"{DEMO_PREFILL_CHUNK}; else no limit)"), None),
    "disaggregate": (dict(action="store_true", help="continuous batching prefills every prompt on a worker of "
                          "its own: a second GPU, a CUDA stream of its own on one, or half the CPU's threads"), False),
    "policy": (dict(choices=POLICIES, help="how to fill the belt (continuous)"), "continuous"),
    "max_new_tokens": (dict(type=int, metavar="N", help="tokens per answer, at most (64)"), 64),
    "temperature": (dict(type=float, metavar="T", help="0 is greedy (0)"), 0.0),
    "top_k": (dict(type=int, metavar="K", help="sample among the K likeliest"), None),
    "seed": (dict(type=int, help="request i samples with seed + i; the workload's seed (0)"), 0),
    "weights": (dict(metavar="PATH", help="a checkpoint directory or file, or gpt2, gpt2-medium, ... to "
                                          "download"), None),
    "quick": (dict(action="store_true", help="a tiny random model, in seconds"), False),
    "device": (dict(type=usable_device, help="cpu, cuda, cuda:1, ... (cuda when present)"), None),
    "dtype": (dict(choices=["float32", "float64", "bfloat16", "float16"], help="(float32)"), "float32"),
    "batch_invariant": (dict(action="store_true", help="every row's logits the same bits whatever shares its step "
                             "(model.py: products over 16 rows at least, attention in blocks of 64 keys)"), False),
    "quiet": (dict(action="store_true", help="no belt, only the summary"), False),
    "kv_blocks": (dict(type=positive(int), metavar="N", help="a paged cache: N blocks that the slots share (--demo: "
                                                    "paged, then per slot in the same memory)"), None),
    "kv_block_size": (dict(type=positive(int), metavar="N", help="positions a block, with --kv-blocks (16)"), 16),
    "prefix_cache": (dict(action="store_true", help="with --kv-blocks: requests share the cached blocks of a common "
                          "prefix (--demo: a system prompt for all, with the cache, then without)"), False),
}
SERVING = {"slots", "max_len", "prefill_chunk", "disaggregate", "seed", "device", "dtype", "kv_blocks", "kv_block_size",
           "batch_invariant"}


def parse_args(parser, argv, names):
    """Parse argv with parser and the OPTIONS named -> (what was typed, every option's value)."""
    for name in [name for name in OPTIONS if name in names]:  # no default in the parser: what was typed, only
        parser.add_argument("--" + name.replace("_", "-"), default=argparse.SUPPRESS, **OPTIONS[name][0])
    typed = vars(parser.parse_args(argv))
    if "quick" in typed and "weights" in typed:
        parser.error("--weights does not apply to --quick, which runs a tiny random model")
    for option in ("kv_block_size", "prefix_cache"):
        if option in typed and "kv_blocks" not in typed:
            parser.error(f"--{option.replace('_', '-')} applies to a paged cache only: give --kv-blocks too")
    args = argparse.Namespace(**{**{name: OPTIONS[name][1] for name in names}, **typed})
    args.device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = getattr(torch, args.dtype)
    return typed, args


def run_cli(run, args):
    """run(args), and what it returns; a closed pipe (`| head`) and Ctrl-C outside a run end quietly."""
    try:
        return run(args)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's last flush must not fail
        sys.exit(141)  # 128 + SIGPIPE: how a shell reports a program that a closed pipe stopped
    except KeyboardInterrupt:  # while loading, say: nothing to summarize
        sys.exit(130)


MODES = {  # --MODE: the function that runs it (it returns what it ran: Shown), its options
    "demo": (demo, SERVING | {"quick", "weights", "temperature", "top_k", "quiet", "prefix_cache"}),
    "prompt": (prompt_mode, SERVING | {"weights", "max_new_tokens", "temperature", "top_k", "policy", "quiet",
                                       "prefix_cache"}),
}
MOVED = {"bench": "python tools/bench.py", "verify": "python tools/verify.py",
         "svg": "python tools/belt_svg.py FILE (with the options of --demo or --prompt)"}


def main(argv=None, prog="nanobatch.py"):
    """Parse, refuse what does not apply to the mode, run it -> what it ran (Shown)."""
    argv = sys.argv[1:] if argv is None else argv
    for option, where in MOVED.items():
        if any(arg.split("=")[0] == f"--{option}" for arg in argv):
            fail(f"--{option} has moved: {where}")
    takes = [f"--{mode} takes " + ", ".join("--" + name.replace("_", "-") for name in OPTIONS if name in options)
             for mode, (_, options) in MODES.items()]
    parser = argparse.ArgumentParser(prog=prog, usage="%(prog)s (--demo | --prompt TEXT) [options]",
                                     description="Continuous batching for GPT-2, in one loop you can read.",
                                     epilog="\n".join(takes), formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--demo", action="store_true", default=argparse.SUPPRESS, help="a mixed workload, "
                      "continuous vs static")
    what.add_argument("--prompt", action="append", metavar="TEXT", default=argparse.SUPPRESS,
                      help="a prompt; repeat for more requests")
    typed, args = parse_args(parser, argv, set().union(*(options for _, options in MODES.values())))
    mode = next(name for name in MODES if name in typed)  # exactly one: the parser saw to that
    run, options = MODES[mode]
    for name in sorted(typed.keys() - options - {mode}):
        parser.error(f"--{name.replace('_', '-')} does not apply to --{mode}")
    return run_cli(run, args)


if __name__ == "__main__":
    main()
