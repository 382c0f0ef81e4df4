"""
nanobatch: continuous batching (iteration-level scheduling) for GPT-2, in one loop.

A belt of S slots, each able to hold one sequence's keys and values in the KV cache. Every step:
    1) requests whose arrival step has come join the waiting queue;
    2) waiting requests are admitted into free slots;
    3) the step's tokens are chosen: each running request's newest token first, then the prompts
       of admitted requests, at most prefill_chunk prompt tokens in all (chunked prefill);
    4) ONE forward runs over all of those tokens, packed side by side; every request whose tokens
       are now all in the cache samples its next token (a prompt's first comes in the step that
       completes it);
    5) the step is reported (which request sits in which slot: the belt you see scroll by);
    6) requests that hit EOS, their max_new_tokens or the slot's max_len are retired, their slots
       free for the very next step.
Static batching is the same loop with one decision changed (`slots_to_fill`): it refills only an
empty belt, so a short answer's slot idles until the longest answer of its batch is done; and, as
a padded batch does, it still computes that idle slot's row (phase 3 of `generate`).
Disaggregated (`disaggregate=True`), a PrefillWorker prefills every prompt on hardware of its own
(a second GPU; else a share of the one device), the loop feeds no prompt token, and a request
joins the belt's decoding once the worker has copied its keys and values into the slot reserved
for it at admission (phase 4b).

Shapes in comments use model.py's legend: S slots, M tokens packed into a step, D of them
one-token rows, T tokens in one prompt chunk, L cache positions attended over, R rows sampled, V
vocabulary size, B rows of queries.
"""
import argparse
import copy
import math
import numbers
import os
import queue
import random
import reprlib
import statistics
import string
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import torch

from model import GPT, GPTConfig, PackedStep, attention_cut, default_cache_dir

POLICIES = ("continuous", "static")
EOT = 50256  # <|endoftext|>: GPT-2 ends a text with it


@dataclass
class Request:
    prompt: list[int]  # GPT-2 token ids
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # sample among the k largest logits only (None: all)
    seed: int | None = None  # per-request sampling seed (None: a random one)
    arrival: int = 0  # loop step at which the scheduler first sees this request


@dataclass
class Completion:
    tokens: list[int]  # generated ids only; an EOS that ended the request is kept
    finish_reason: str  # "eos" | "length" | "context"
    admit_step: int  # loop step that took this request into a slot
    finish_step: int  # loop step that produced its last token
    ttft_s: float  # seconds from the start of its arrival step to its first token
    latency_s: float  # seconds from the start of its arrival step to its last token
    first_token_step: int  # loop step that produced its first token: admit_step unless its prompt
    #                        waited for the prompt budget or needed several steps of it (chunked
    #                        prefill), or the prefill worker had it (disaggregated: the step that
    #                        took its handover); finish_step is always first_token_step + len(tokens) - 1
    slot: int  # the slot it occupied
    token_times_s: list[float]  # seconds from the start of its arrival step to each of its tokens


# ---------------------------------------------------------------------------------------------
# Sampling and stopping, one rule each, shared by the engine and the sequential reference


def new_sampler(request, device):
    """The request's own random generator: its draws never depend on its batch-mates."""
    generator = torch.Generator(device=device)
    if request.seed is None:
        generator.seed()
    else:
        generator.manual_seed(request.seed)
    return generator


def sample(logits, request, generator):
    """The next token id from one row of logits (V,), as a 0-d tensor on the logits' device: the
    engine reads a whole step's tokens back at once, not one row at a time."""
    if request.temperature == 0:
        return logits.argmax()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # no softmax in 16 bits
    logits = logits - logits.max()  # the largest is 0, so a tiny temperature cannot overflow
    if request.top_k is not None:
        kth_largest = torch.topk(logits, min(request.top_k, logits.size(-1))).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits / request.temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]


def sample_step(logits, runs, device):
    """The next token of each run, from its row of logits (R, V), as Python ints. They come back
    from the device in one copy, the step's only wait for it, not in one wait per run."""
    if not runs:  # a step of mid-prompt chunks only: nothing to read back, but timings must be true
        synchronize(device)
        return []
    return torch.stack([sample(row, run.request, run.sampler) for row, run in zip(logits, runs)]).tolist()


def synchronize(device):
    """Wait for the work this thread queued on the device: GPU work is queued, not done, when
    Python moves on. Only this thread's stream: the prefill worker's stream goes its own pace."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def stop_reason(request, tokens, max_len, eos_id):
    """Why the request is done after its newest token, or None if it goes on."""
    if tokens[-1] == eos_id:
        return "eos"
    if len(tokens) == request.max_new_tokens:
        return "length"
    if len(request.prompt) + len(tokens) == max_len:
        return "context"  # its slot is full: the next token would have no position
    return None


# ---------------------------------------------------------------------------------------------
# The attention mask, and packing a step's tokens into one forward


def attention_mask(positions, L):
    """(B, T, L) bool: a token may see position l of its own slot iff l <= its own position.

    Each row reads one slot only, so requests never see each other; within a slot this one rule
    is causal attention over exactly the slot's own prefix. What lies beyond (keys left by the
    slot's previous occupant, 'x' below) is never seen. A step with three decoding slots and a
    prompt chunk, 1 = visible. The one-token rows attend together over every slot's first L
    positions, L the step's cut (3 here, for the picture's sake: attention_cut would not cut a belt
    this short), and slot 1, longer, attends alone over its own slot, as a chunk does:

      one-token rows, B = S = 4, T = 1, L = 3        slot 1 alone, B = 1, T = 1: its position 5
      cache position   0 1 2                         cache position   0 1 2 3 4 5
      slot 0, pos 2    1 1 1                                pos 5    1 1 1 1 1 1
      slot 1, alone    1 0 0   dropped
      slot 2, no row   1 0 0   dropped               a chunk in slot 2, B = 1, T = 3: the prompt's
      slot 3, pos 0    1 0 0   (1.. hold x)          positions 3..5 (0..2 came in an earlier step)
                                                     cache position   0 1 2 3 4 5
                                                            pos 3    1 1 1 1 0 0
                                                            pos 4    1 1 1 1 1 0
                                                            pos 5    1 1 1 1 1 1
    """
    key_positions = torch.arange(L, device=positions.device)  # (L,)
    return key_positions[None, None, :] <= positions[:, :, None]  # (B, T, L)


def pack_step(work, padding_slots, n_slots, device):
    """This step's work as one model.PackedStep, and the runs to sample, in the order of its logits.

    work: [(run, the token ids it feeds)]. padding_slots: slots that feed a token nobody reads, and
    get logits nobody samples from (static batching's finished rows). One-token rows come first, one
    per slot, those no longer than the step's cut; then the rows that attend over their own slot
    alone: the one-token rows past the cut, and the prompt chunks. The logits rows of the runs to
    sample come first, then padding's.
    """
    one_token = [(run, run.slot, run.n_cached, ids) for run, ids in work if len(ids) == 1]
    one_token += [(None, slot, 0, [0]) for slot in padding_slots]  # token 0 at position 0
    cut = attention_cut([position + 1 for _, _, position, _ in one_token], n_slots, device)  # model.py
    alone = [(run, slot, position, ids) for run, slot, position, ids in one_token if position + 1 > cut]
    one_token = [(run, slot, position, ids) for run, slot, position, ids in one_token if position + 1 <= cut]
    chunks = alone + [(run, run.slot, run.n_cached, ids) for run, ids in work if len(ids) > 1]  # each over its slot
    tokens, positions, slots, logit_rows, padding_rows, to_sample = [], [], [], [], [], []
    for run, slot, first_position, ids in one_token + chunks:
        tokens += ids
        positions += range(first_position, first_position + len(ids))
        slots += [slot] * len(ids)
        # A run samples once its feed has brought all it has (prompt and answer) into the cache:
        # a decoding request every step, a prompt in the step that completes it.
        if run is None:
            padding_rows.append(len(tokens) - 1)
        elif run.n_cached + len(ids) == len(run.request.prompt) + len(run.tokens):
            logit_rows.append(len(tokens) - 1)
            to_sample.append(run)
    logit_rows += padding_rows
    query_positions = [0] * n_slots  # each slot's one-token row's position (0 for a slot with none)
    for _, slot, first_position, _ in one_token:
        query_positions[slot] = first_position
    # Every index of the step in one host-to-device copy. From ordinary memory the copy waits for
    # the device, but the device has nearly nothing queued: the previous step ended by reading
    # its tokens back.
    M, R = len(tokens), len(logit_rows)
    index = torch.tensor(tokens + positions + slots + query_positions + logit_rows, dtype=torch.long, device=device)
    tokens_t, positions_t, slots_t, query_positions_t, logit_rows_t = index.split([M, M, M, n_slots, R])
    one_token_mask = attention_mask(query_positions_t[:, None], max(query_positions) + 1)  # (S, 1, L)
    chunk_masks, first_row = [], len(one_token)
    for _, slot, first_position, ids in chunks:
        rows = slice(first_row, first_row + len(ids))
        mask = attention_mask(positions_t[rows][None], first_position + len(ids))[0]  # (T, L)
        chunk_masks.append((rows, slot, mask))
        first_row += len(ids)
    packed = PackedStep(tokens_t, positions_t, slots_t, len(one_token), one_token_mask, chunk_masks, logit_rows_t)
    return packed, to_sample


# ---------------------------------------------------------------------------------------------
# The loop's state, and its decisions


@dataclass
class Running:
    """A request in a slot: the per-slot state the loop keeps."""
    request_index: int  # position of the request in the caller's list
    request: Request
    slot: int
    sampler: torch.Generator
    admit_step: int
    n_cached: int = 0  # tokens of prompt + answer whose keys and values are in the slot already
    tokens: list[int] = field(default_factory=list)  # generated so far
    token_times_s: list[float] = field(default_factory=list)  # seconds from arrival to each token
    first_token_step: int | None = None

    @property
    def is_prefilling(self):  # its prompt is not all in the cache yet, so it has no token yet
        return self.n_cached < len(self.request.prompt)


@dataclass
class StepReport:
    step: int
    belt: str  # a character per slot: the letter of the request that made a token there, '~' for
    #            one whose prompt is still going in, '.' for a slot doing no useful work
    n_running: int  # requests that made a token this step
    n_prefilling: int  # requests in a slot whose prompt is not all in the cache yet
    n_waiting: int  # arrived requests still queued
    n_prompt_tokens: int  # prompt tokens that went through the model this step
    admitted: list[int]  # request indices that took a slot this step
    finished: list[tuple[int, Completion]]  # (request index, its completion)
    model_s: float  # seconds in the forward pass and sampling, until the tokens were back
    step_s: float  # seconds for the whole step, the scheduling around the model included
    sampled: list[int]  # request indices that made a token, in the order of logits' rows
    logits: torch.Tensor  # (R, V): the logits those tokens were sampled from
    handed_over: list[int] = field(default_factory=list)  # disaggregated: requests whose prompt the
    #                        prefill worker handed over this step, their first token with it
    kv_bytes: int = 0  # bytes of keys and values the worker copied into their slots
    kv_s: float = 0.0  # seconds those copies took, on the worker's side


def letter(request_index):
    """The request's name on screen: A-Z, then a-z, then A again."""
    letters = string.ascii_uppercase + string.ascii_lowercase
    return letters[request_index % len(letters)]


def belt_picture(belt):
    """A character per slot: the request's letter, '~' while its prompt goes in, '.' when empty."""
    return "".join("." if run is None else "~" if run.is_prefilling else letter(run.request_index)
                   for run in belt)


def slots_to_fill(belt, policy):
    """The free slots a waiting request may take now. The policies' one decision: continuous
    refills a slot the step after it frees up; static refills only an empty belt."""
    free = [slot for slot, run in enumerate(belt) if run is None]
    if policy == "static" and len(free) < len(belt):
        return []
    return free


def plan_step(belt, prefill_chunk):
    """The tokens each request feeds this step: [(run, token ids)].

    Decoding requests come first, each with its newest token: a prompt never delays them. Then the
    prompts, first come first served, share a budget of prefill_chunk tokens (None: no limit); a
    prompt that does not fit continues in the next steps (chunked prefill), so one long prompt
    cannot stall the belt's decoding for long.
    """
    runs = sorted((run for run in belt if run is not None), key=lambda run: run.request_index)
    work = [(run, [run.tokens[-1]]) for run in runs if not run.is_prefilling]
    budget = math.inf if prefill_chunk is None else prefill_chunk
    for run in sorted((run for run in runs if run.is_prefilling), key=lambda run: run.request.arrival):
        n = min(budget, len(run.request.prompt) - run.n_cached)
        if n == 0:
            break
        work.append((run, run.request.prompt[run.n_cached:run.n_cached + n]))
        budget -= n
    return work


# ---------------------------------------------------------------------------------------------
# Disaggregated prefill: the prompts on hardware of their own


@dataclass
class Handover:
    """What the prefill worker sends back once a request's keys and values are in its slot."""
    run: Running  # the loop's own Running, whose slot was reserved at admission
    token: int  # its first token, sampled by the worker with the request's own generator
    logits: torch.Tensor  # (V,) the logits that token was sampled from
    kv_bytes: int  # bytes of keys and values copied into the slot: the transfer
    kv_s: float  # seconds the copy took (on a GPU, behind what the loop had queued before it)


def prefill_device(device):
    """The worker's device beside a loop on `device`: a second GPU if there is one, else `device`."""
    n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return torch.device("cuda", (device.index + 1) % n_gpus) if n_gpus > 1 else device


def split_threads(n_threads):
    """A CPU's threads shared out: (the worker's, the decode loop's), at least one each."""
    return max(1, n_threads // 2), max(1, n_threads - n_threads // 2)


class PrefillWorker:
    """The prefill machine: a thread of its own, started as a `with` block begins and joined as it
    ends, however it ends. The loop keeps the calling thread and the model's device; the worker gets
    a second GPU and a copy of the weights if there is one, else a CUDA stream of its own on the one
    GPU (shared, then), or on a CPU half of torch's threads (each thread sets its own count; the
    caller's is given back at the end). The loop sends a Running request whose slot it reserved;
    the worker prefills the prompt into a cache of its own, samples the first token, copies the
    keys and values into that slot, and sends back a Handover, or the exception that stopped it,
    which the loop raises."""

    def __init__(self, model, cache, max_len, prefill_chunk):
        self.model, self.cache, self.max_len, self.prefill_chunk = model, cache, max_len, prefill_chunk
        self.inbox, self.outbox = queue.Queue(), queue.Queue()  # Running (None: wake up); Handover or error
        self.stopping, self.thread = threading.Event(), None
        self.n_threads = torch.get_num_threads()  # the caller's setting, given back at the end

    def __enter__(self):
        device = self.model.lm_head.weight.device
        worker_device, (worker_threads, loop_threads) = prefill_device(device), split_threads(self.n_threads)
        model = self.model
        if worker_device != device:  # the weights copied to the worker's GPU, built there
            with torch.device(worker_device):
                model = GPT(self.model.config).to(self.model.lm_head.weight.dtype).eval()
            model.load_state_dict(self.model.state_dict())
        # The worker's copy into a slot must come after the loop's last use of it (the clear of its
        # previous occupant), which the loop queued on its own stream.
        loop_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if device.type == "cpu":
            torch.set_num_threads(loop_threads)
        self.thread = threading.Thread(target=self.prefill, args=(model, worker_threads, loop_stream), daemon=True,
                                       name="nanobatch prefill worker")
        self.thread.start()
        return self

    def prefill(self, model, n_threads, loop_stream):  # the worker's thread
        try:
            device = model.lm_head.weight.device
            if device.type == "cpu":
                torch.set_num_threads(n_threads)
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            on_own_stream = torch.cuda.stream(stream) if stream is not None else nullcontext()
            with torch.no_grad(), on_own_stream:  # no_grad and the current stream are set per thread
                # One slot, the prompt in hand. It needs no wiping between prompts: a prompt on a belt of
                # one attends over its own positions only, and writes each before it reads it.
                own_cache = model.new_cache(1, self.max_len)
                while (run := self.inbox.get()) is not None and not self.stopping.is_set():
                    here = Running(run.request_index, run.request, slot=0, sampler=run.sampler,
                                   admit_step=run.admit_step)
                    while here.is_prefilling:  # the loop's own plan, on a belt of one: prefill_chunk a forward
                        packed, _ = pack_step(plan_step([here], self.prefill_chunk), [], 1, device)
                        logits = model.forward_packed(packed, own_cache)  # (1, V) once the prompt is in
                        here.n_cached += len(packed.tokens)
                    logits = logits[0].to(self.cache.kv.device)  # (V,)
                    token = sample(logits, run.request, run.sampler).item()
                    start = time.perf_counter()
                    if stream is not None:
                        stream.wait_stream(loop_stream)
                    kv_bytes = own_cache.send(0, here.n_cached, to=self.cache, to_slot=run.slot)  # the transfer
                    synchronize(device)
                    self.outbox.put(Handover(run, token, logits, kv_bytes, time.perf_counter() - start))
        except BaseException as error:  # carried to the loop, which raises it with this traceback
            self.outbox.put(error)

    def send(self, run):
        self.inbox.put(run)

    def receive(self, wait):
        """The Handovers sent since the last call; with wait, at least one (the loop is idle)."""
        handovers = [self.outbox.get()] if wait else []
        while not self.outbox.empty():  # the loop is the only reader
            handovers.append(self.outbox.get())
        for handover in handovers:
            if isinstance(handover, BaseException):
                raise handover
            if handover.logits.is_cuda:  # made on the worker's stream, read on the loop's: tell the allocator
                handover.logits.record_stream(torch.cuda.current_stream(handover.logits.device))
        return handovers

    def __exit__(self, *exception):
        self.stopping.set()  # the prompts not started are dropped: the worker stops after the one in hand
        self.inbox.put(None)  # wakes it if it waits for a prompt
        try:
            self.thread.join()
        finally:
            torch.set_num_threads(self.n_threads)


# ---------------------------------------------------------------------------------------------
# The loop


def generate(model, requests, *, n_slots=8, max_len=None, eos_id=EOT, policy="continuous",
             prefill_chunk=None, on_step=None, disaggregate=False):
    """Serve every request through a belt of n_slots; returns their Completions in request order.

    max_len: positions per slot (default: the model's block_size). eos_id=None: never stop on EOS.
    prefill_chunk: at most this many prompt tokens enter a step (None: whole prompts at once).
    on_step: called with a StepReport after every step (the library itself prints nothing).
    disaggregate: a PrefillWorker prefills every prompt and the loop only decodes; prefill_chunk is
    then the most prompt tokens in one forward of the worker.
    """
    max_len = model.config.block_size if max_len is None else max_len
    requests = check_arguments(model, requests, n_slots, max_len, eos_id, policy, prefill_chunk=prefill_chunk,
                               disaggregate=disaggregate)  # below the loop: all refused before any work
    device = model.lm_head.weight.device
    cache = model.new_cache(n_slots, max_len)  # the only large allocation, reused by every request
    pending = deque(sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i)))
    waiting = deque()  # arrived, not yet admitted: first come, first served
    belt = [None] * n_slots  # belt[slot]: the Running request in that slot, or None
    completions, arrived_at = [None] * len(requests), [None] * len(requests)  # arrived_at: wall time
    step, n_done = 0, 0
    prefill = PrefillWorker(model, cache, max_len, prefill_chunk) if disaggregate else nullcontext()
    with torch.no_grad(), prefill as worker:  # worker: None unless disaggregated
        while n_done < len(requests):
            # 0) Nothing running and nothing waiting: jump the clock to the next arrival.
            if all(run is None for run in belt) and not waiting:
                step = max(step, requests[pending[0]].arrival)
            # 1) Arrivals join the queue.
            step_start = time.perf_counter()
            while pending and requests[pending[0]].arrival <= step:
                arrived_at[pending[0]] = step_start
                waiting.append(pending.popleft())
            # 2) Admit waiting requests into free slots; their prompts go in from this step on, or to
            #    the worker, the slot reserved for them until it hands their keys and values over.
            admitted = []
            for slot in slots_to_fill(belt, policy)[:len(waiting)]:
                i = waiting.popleft()
                belt[slot] = Running(i, requests[i], slot, new_sampler(requests[i], device), admit_step=step)
                admitted.append(i)
                if worker is not None:
                    worker.send(belt[slot])
            # 3) Choose the step's tokens; with a worker, no prompt token (a budget of 0). Static
            #    batching runs its batch at a fixed size, as a padded batch does: a finished
            #    request's row still costs a row (a padding token, its logits included) until its
            #    whole batch is done. Continuous computes no empty rows.
            work = plan_step(belt, 0 if worker is not None else prefill_chunk)
            n_prompt_tokens = sum(len(ids) for run, ids in work if run.is_prefilling)
            padding_slots = [s for s, run in enumerate(belt) if run is None] if policy == "static" else []
            # 4) One forward over all of them; a new token for every run that is due one.
            packed, to_sample = pack_step(work, padding_slots, n_slots, device)
            model_start = time.perf_counter()
            if work:
                logits = model.forward_packed(packed, cache)[:len(to_sample)]  # (R, V): padding's rows dropped
                new_tokens = sample_step(logits, to_sample, device)
            else:  # disaggregated, with nothing to decode yet: the loop waits for the worker below
                logits, new_tokens = cache.kv.new_empty(0, model.config.vocab_size), []
            model_s = time.perf_counter() - model_start
            for run, ids in work:
                run.n_cached += len(ids)
            # 4b) The prompts the worker has handed over, their keys and values in their slots: each
            #     makes its first token in this step, and decodes from the next. Nothing to decode
            #     this step: the loop waits for one.
            handovers = worker.receive(wait=not work) if worker is not None else []
            for handover in handovers:
                handover.run.n_cached = len(handover.run.request.prompt)
                to_sample.append(handover.run)
                new_tokens.append(handover.token)
            if handovers:
                logits = torch.cat([logits, torch.stack([handover.logits for handover in handovers])])  # (R, V)
            now = time.perf_counter()
            finished = []
            for run, token in zip(to_sample, new_tokens):
                run.tokens.append(token)
                run.token_times_s.append(now - arrived_at[run.request_index])
                if run.first_token_step is None:
                    run.first_token_step = step
                if reason := stop_reason(run.request, run.tokens, max_len, eos_id):
                    completions[run.request_index] = Completion(
                        tokens=run.tokens, finish_reason=reason, admit_step=run.admit_step, finish_step=step,
                        ttft_s=run.token_times_s[0], latency_s=run.token_times_s[-1],
                        first_token_step=run.first_token_step, slot=run.slot, token_times_s=run.token_times_s)
                    finished.append(run)
            # 5) Report the step: the belt as it ran, and who came and went.
            if on_step is not None:
                on_step(StepReport(
                    step=step, belt=belt_picture(belt), n_running=len(to_sample),
                    n_prefilling=sum(run is not None and run.is_prefilling for run in belt),
                    n_waiting=len(waiting), n_prompt_tokens=n_prompt_tokens, admitted=admitted,
                    finished=[(run.request_index, completions[run.request_index]) for run in finished],
                    model_s=model_s, step_s=time.perf_counter() - step_start,
                    sampled=[run.request_index for run in to_sample], logits=logits,
                    handed_over=[handover.run.request_index for handover in handovers],
                    kv_bytes=sum(handover.kv_bytes for handover in handovers),
                    kv_s=sum(handover.kv_s for handover in handovers)))
            # 6) Retire finished requests: wipe what each wrote, and its slot is free next step.
            for run in finished:
                cache.clear(run.slot, run.n_cached)
                belt[run.slot] = None
            n_done += len(finished)
            step += 1
    return completions


def generate_sequential(model, requests, *, max_len=None, eos_id=EOT):
    """The reference: one request at a time, the plain no-cache forward over the whole sequence
    for every token. Slow (quadratic) and plainly right. Its clock counts steps as a one-slot belt
    with whole prompts would: one token per step, requests first come, first served."""
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
            completions[i] = Completion(tokens, reason, admit_step, step - 1, token_times_s[0], token_times_s[-1],
                                        admit_step, 0, token_times_s)
    return completions


# ---------------------------------------------------------------------------------------------
# Checking the input before any work, so that nothing fails halfway: the forms people really
# pass are accepted and turned into plain Python types; everything else is a ValueError that
# names the field.


def shown(value):
    """value's repr, cut to a few dozen characters: an error message never echoes a whole prompt."""
    return reprlib.repr(value)


def is_int(value):
    """True for an int or a numpy integer. False for a bool, though Python counts it as an int
    (True + True == 2): a bool where a count or a token id belongs is a mistake, not a 1."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value):
    """True for an int, a float or a numpy float; False for a bool, as in is_int."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def checked_int(value, name, lowest, highest=None, *, may_be_none=False):
    """value as a plain int in lowest..highest (highest None: no upper bound), or a ValueError
    naming the field."""
    if value is None and may_be_none:
        return None
    if not (is_int(value) and lowest <= value and (highest is None or value <= highest)):
        bounds = f">= {lowest}" if highest is None else f"in {lowest}..{highest}"
        raise ValueError(f"{name} must be an int {bounds}{' or None' if may_be_none else ''}, "
                         f"got {shown(value)}")
    return int(value)


def checked_temperature(value, name):
    """value as a plain float, finite and >= 0, or a ValueError naming the field."""
    try:
        temperature = float(value) if is_real(value) else math.nan
    except OverflowError:  # an int too large for any float
        temperature = math.inf
    if not 0 <= temperature < math.inf:  # NaN fails every comparison
        raise ValueError(f"{name} must be a real number, finite and >= 0, got {shown(value)}")
    return temperature


def token_ids(prompt, name, vocab_size):
    """The prompt as a plain list[int], or a ValueError naming the field. Any 1-D sequence of
    integer ids will do: a list, a tuple, a 1-D tensor or numpy array of an integer dtype."""
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
    for index, token in enumerate(prompt):
        # A float tensor's ids come out of tolist() as floats, a bool tensor's as bools: refused here.
        if not is_int(token):
            raise ValueError(f"{name} must be a 1-D sequence of int token ids, but index {index} holds "
                             f"{shown(token)}, a {type(token).__name__}")
        if not 0 <= token < vocab_size:
            raise ValueError(f"{name} has token id {token} (at index {index}), outside the vocabulary "
                             f"0..{vocab_size - 1}")
    return [int(token) for token in prompt]  # numpy integers become ints; the caller's list is not shared


SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes (a negative seed wraps around)


def check_arguments(model, requests, n_slots, max_len, eos_id, policy, *, prefill_chunk=None, disaggregate=False):
    """Reject, before any work, everything that could not be served: nothing fails halfway.

    Returns the requests as a new list of checked copies in plain Python types: each prompt a
    list[int], each number an int or a float, whatever sequence or numeric type the caller used.
    The caller's Request objects are left as they were. prefill_chunk: None, or the most prompt
    tokens that may enter one step (or one forward of the prefill worker)."""
    V, block_size = model.config.vocab_size, model.config.block_size
    if not (isinstance(policy, str) and policy in POLICIES):
        raise ValueError(f"policy must be one of {POLICIES}, got {shown(policy)}")
    checked_int(n_slots, "n_slots", 1)
    if not (is_int(max_len) and 2 <= max_len <= block_size):
        raise ValueError(f"max_len must be an int in 2..{block_size} (the model's block_size), "
                         f"got {shown(max_len)}")
    checked_int(eos_id, "eos_id", 0, V - 1, may_be_none=True)
    checked_int(prefill_chunk, "prefill_chunk", 1, may_be_none=True)
    if not isinstance(disaggregate, bool):
        raise ValueError(f"disaggregate must be True or False, got {shown(disaggregate)}")
    if disaggregate and policy == "static":
        raise ValueError("disaggregate=True needs policy='continuous': a static batch prefills its prompts "
                         "together as it starts, with no stream of prompts for a prefill worker to take")
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise ValueError(f"requests must be an iterable of Request, got {type(requests).__name__}")
    requests = list(requests)  # read once: a generator would be used up by the checks below
    checked = []
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise ValueError(f"requests[{i}] must be a Request, got {type(r).__name__}")
        prompt = token_ids(r.prompt, f"requests[{i}].prompt", V)
        if len(prompt) >= max_len:
            raise ValueError(f"requests[{i}].prompt has {len(prompt)} tokens, which leaves no room in "
                             f"max_len={max_len}: at most {max_len - 1} fit")
        checked.append(replace(  # a copy in plain types, each number checked as it is converted
            r, prompt=prompt,
            max_new_tokens=checked_int(r.max_new_tokens, f"requests[{i}].max_new_tokens", 1),
            temperature=checked_temperature(r.temperature, f"requests[{i}].temperature"),
            top_k=checked_int(r.top_k, f"requests[{i}].top_k", 1, may_be_none=True),
            seed=checked_int(r.seed, f"requests[{i}].seed", *SEED_RANGE, may_be_none=True),
            arrival=checked_int(r.arrival, f"requests[{i}].arrival", 0)))
    return checked


# ---------------------------------------------------------------------------------------------
# Measuring and showing: shared by --demo, --prompt and --bench


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
    gaps_ms = [1e3 * (later - earlier) for _, c in done
               for earlier, later in zip(c.token_times_s, c.token_times_s[1:])]
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
        "slowest step (ms)": max(gaps_ms, default=None),  # a step that no decoding request waited for is no pause
        "time outside the model": 1 - sum(report.model_s for report in reports) / wall_s,
        "KV moved (MB / ms)": ((sum(report.kv_bytes for report in reports) / 1e6,
                                1e3 * sum(report.kv_s for report in reports))
                               if any(report.handed_over for report in reports) else None),
    }


def print_table(summaries, legend=False):
    """{run name: summarize(...)}, side by side; legend: then a line saying what each row counts."""
    def cell(row, value):
        if isinstance(value, tuple):
            return " / ".join(cell(row, v) for v in value)
        if value is None:
            return "-"
        if "occupancy" in row or "outside" in row:
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
    events = [f"+{letter(i)}" for i in report.admitted] + [f">{letter(i)}" for i in report.handed_over]
    events += [f"-{letter(i)}({c.finish_reason},{len(c.tokens)})" for i, c in report.finished]
    print(f"step {report.step:4d} |{report.belt}| {report.n_running:2d}/{len(report.belt)} "
          f"waiting {report.n_waiting:3d}  {' '.join(events)}".rstrip(), flush=True)


# ---------------------------------------------------------------------------------------------
# The belt as a picture: an SVG panel per run, steps along x, slots along y


SVG_WIDTH, LEFT, RIGHT = 1200, 44, 16  # px: fits a laptop screen; LEFT holds the margin's labels
TITLE_H, GAP, STRIP_H, AXIS_H = 26, 6, 24, 30  # px: a panel's title, belt-to-strip gap, strip, axis
STEP_TIMES_H, SCALE_W = 40, 40  # px: the strip of step durations, and room right of it for its scale
STEP_COLOUR = "#c0392b"  # a step's duration, red: a stall must stand out
HATCH = ('<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform='
         '"rotate(45)"><rect width="3" height="6" fill="white" fill-opacity="0.6"/></pattern>')


def tag(name, content="", **attributes):
    """One SVG element as text: class_ -> class (a Python keyword), data_slot -> data-slot, floats
    to 0.01 px. content is markup already, so callers escape their text."""
    def value(v):
        return str(round(v, 2) if isinstance(v, float) else v)

    attrs = "".join(f" {key.rstrip('_').replace('_', '-')}={quoteattr(value(v))}"
                    for key, v in attributes.items())
    content = str(content)  # a number (slot, step) is text too
    return f"<{name}{attrs}>{content}</{name}>" if content else f"<{name}{attrs}/>"


def margin_label(text, y):
    """Grey text in the left margin, right-aligned against the belt: slot numbers, 'busy', 'step'."""
    return tag("text", text, x=LEFT - 8, y=y, font_size=10, fill="#555", text_anchor="end",
               dominant_baseline="central")


def colour(request_index):
    """A request's colour, the same in every panel: hues a golden angle (137.5 degrees) apart, so
    that requests close in the queue, which often sit side by side, never look alike."""
    return f"hsl({request_index * 137.508 % 360:.0f}, 70%, 65%)"


def every(px_per_unit, min_gap_px, choices):
    """The first of choices (in steps or slots) whose labels stand min_gap_px apart, or the last."""
    return next((c for c in choices if c * px_per_unit >= min_gap_px), choices[-1])


def stay_svg(i, c, step_w, row_h):
    """Request i's stay in its slot: a bar from its admit step to its last token, its prefill-only
    steps hatched over, its letter if the bar has room for one, and a tooltip on hover."""
    x, y, height = LEFT + c.admit_step * step_w, TITLE_H + c.slot * row_h, row_h - 1  # 1 px between rows
    width, n_prefill_steps = (c.finish_step - c.admit_step + 1) * step_w, c.first_token_step - c.admit_step
    tip = f"request {letter(i)}, slot {c.slot}: steps {c.admit_step}-{c.finish_step}, {len(c.tokens)} tokens"
    if n_prefill_steps:
        tip += f"; prompt prefilled in steps {c.admit_step}-{c.first_token_step - 1}"
    parts = [tag("title", escape(tip)),
             tag("rect", class_="stay", data_request=i, data_slot=c.slot, data_admit=c.admit_step,
                 data_finish=c.finish_step, x=x, y=y, width=width, height=height, fill=colour(i),
                 stroke="white", stroke_width=0.5)]  # the white edge parts two stays that touch
    if n_prefill_steps:
        parts.append(tag("rect", class_="prefill", data_request=i, x=x, y=y, width=n_prefill_steps * step_w,
                         height=height, fill="url(#hatch)"))
    font_px = min(12, row_h - 4)
    if font_px >= 7 and width >= font_px:  # 64 slots, or a 1-step stay: colour and tooltip must do
        parts.append(tag("text", letter(i), x=x + width / 2, y=y + height / 2, font_size=font_px,
                         text_anchor="middle", dominant_baseline="central"))
    return tag("g", "".join(parts))


def panel_svg(title, n_slots, completions, summary, step_times, step_w, n_axis_steps, longest_s, top):
    """One run, drawn from y = top down: its title, a belt of n_slots rows, the occupancy strip, the
    step durations if step_times are given ([(step, seconds, whether a request decoded in it)], a
    bar each, longest_s the full height), and the step axis -> (its SVG, where the next begins)."""
    done = [(i, c) for i, c in enumerate(completions) if c is not None]  # None: did not finish
    n_steps = max((c.finish_step + 1 for _, c in done), default=0)
    row_h = min(22, max(6, 360 / n_slots))  # 8 slots: roomy rows; 64: thin ones, 384 px in all
    belt_h = n_slots * row_h
    heading = (f"{title}, {n_slots} slots: {summary['steps']} steps, {summary['tokens/s']:.1f} tokens/s, "
               f"TTFT P50 {summary['TTFT P50/P99 (steps)'][0]:g} steps")
    if step_times:
        heading += f", TBT P99 {summary['TBT P50/P99 (ms)'][1]:.0f} ms"
    parts = [tag("text", escape(heading), x=8, y=18, font_size=15, font_weight="bold"),
             tag("rect", x=LEFT, y=TITLE_H, width=n_steps * step_w, height=belt_h, fill="#eee")]  # idle
    parts += [margin_label(slot, TITLE_H + (slot + 0.5) * row_h)
              for slot in range(0, n_slots, every(row_h, 14, (1, 2, 4, 8, 16)))]
    parts += [stay_svg(i, c, step_w, row_h) for i, c in done]
    # The strip: at each step, the share of slots holding a request, prefilling or decoding.
    strip_top = TITLE_H + belt_h + GAP
    parts += [margin_label("busy", strip_top + STRIP_H / 2),
              tag("rect", x=LEFT, y=strip_top, width=n_steps * step_w, height=STRIP_H, fill="#eee")]
    for step in range(n_steps):
        bar_h = STRIP_H * sum(c.admit_step <= step <= c.finish_step for _, c in done) / n_slots
        parts.append(tag("rect", class_="occupancy", x=LEFT + step * step_w, y=strip_top + STRIP_H - bar_h,
                         width=step_w, height=bar_h, fill="#666", shape_rendering="crispEdges"))
    # The step durations: a bar per step, so that a stall stands out.
    axis_y = strip_top + STRIP_H + 4
    if step_times:
        times_top = strip_top + STRIP_H + GAP
        parts += [margin_label("ms", times_top + STEP_TIMES_H / 2),
                  tag("rect", x=LEFT, y=times_top, width=n_steps * step_w, height=STEP_TIMES_H, fill="#eee")]
        for step, seconds, decoded in step_times:  # grey: prompts only, or waiting for the worker
            bar_h = STEP_TIMES_H * seconds / longest_s
            parts.append(tag("rect", class_="step-time", data_step=step, data_ms=f"{1e3 * seconds:.1f}",
                             x=LEFT + step * step_w, y=times_top + STEP_TIMES_H - bar_h, width=step_w, height=bar_h,
                             fill=STEP_COLOUR if decoded else "#bbb", shape_rendering="crispEdges"))
        parts.append(tag("text", f"{1e3 * longest_s:.0f} ms", x=LEFT + n_axis_steps * step_w + 4, y=times_top + 8,
                         font_size=10, fill="#555"))  # the scale: a bar of the full height
        axis_y = times_top + STEP_TIMES_H + 4
    # The step axis, the same in every panel of a group.
    parts.append(margin_label("step", axis_y + 8))
    for step in range(0, n_axis_steps + 1, every(step_w, 50, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))):
        x = LEFT + step * step_w
        parts += [tag("line", x1=x, x2=x, y1=axis_y - 4, y2=axis_y, stroke="#555"),
                  tag("text", step, x=x, y=axis_y + 12, font_size=10, fill="#555", text_anchor="middle")]
    return tag("g", "".join(parts), class_="panel", data_title=title, data_step_width=repr(step_w),
               transform=f"translate(0, {top})"), top + axis_y + AXIS_H


def legend_svg(has_step_times):
    """Above the panels, what the marks mean, on as many lines as it takes -> (its SVG, its height)."""
    keys = [([colour(2)], "a request in its slot, with its letter (hover over it: details)"),
            ([colour(2), "url(#hatch)"], "its prompt being prefilled: no token yet"),
            (["#eee"], "an idle slot"), (["#666"], "busy: the share of slots holding a request")]
    keys += [([STEP_COLOUR], "ms: how long each step took"),
             (["#bbb"], "a step in which no request decoded")] if has_step_times else []
    parts, x, y = [], 8, 8
    for fills, text in keys:
        width = 26 + 6.5 * len(text)  # text at 12 px runs about 6.5 px a character
        if x + width > SVG_WIDTH:
            x, y = 8, y + 22
        swatch = "".join(tag("rect", width=20, height=14, fill=fill) for fill in fills)
        parts.append(tag("g", swatch + tag("text", escape(text), x=26, y=11, font_size=12),
                         transform=f"translate({x}, {y})"))
        x += width + 20
    return "".join(parts), y + 32


def belt_svg(*groups):
    """groups: each a list of panels [(title, n_slots, completions, summary, step_times)], runs of
    the same requests -> an SVG document, a panel per run, one under the other, each group on one
    step scale (and one scale of step durations), so that its runs compare by eye. completions: one
    per request in request order, each with .slot, .admit_step, .first_token_step, .finish_step and
    .tokens, or None (not finished: not drawn); summary: summarize()'s figures; step_times: None, or
    [(step, seconds)] for a strip of step durations."""
    has_step_times = any(panel[4] for panels in groups for panel in panels)
    legend, top = legend_svg(has_step_times)
    parts = [tag("defs", HATCH), legend]
    for g, panels in enumerate(groups):
        top += 4 * GAP if g else 0  # a gap between groups: each has scales of its own
        n_steps = max((c.finish_step + 1 for _, _, completions, _, _ in panels for c in completions if c), default=1)
        durations = [seconds for *_, step_times in panels for _, seconds, _ in step_times or ()]
        width = SVG_WIDTH - LEFT - RIGHT - (SCALE_W if durations else 0)
        step_w = width / n_steps  # px per step: the longest run spans the width
        for panel in panels:
            group, top = panel_svg(*panel, step_w, n_steps, max(durations, default=1), top)
            parts.append(group)
    return tag("svg", "".join(parts), xmlns="http://www.w3.org/2000/svg", width=SVG_WIDTH, height=top,
               font_family="sans-serif", style="background: white")


# ---------------------------------------------------------------------------------------------
# The command line: --demo, --prompt, --bench


def fail(message):
    """The one-line end for what nanobatch itself refuses: bad input, a missing or damaged file, no
    network. Any other error (in torch: a wrong shape, out of memory) keeps its traceback, which
    says where it broke."""
    print(f"nanobatch.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def run_all(model, requests, runs, args, eos_id, show_belt):
    """Serve the same requests once per run, (name, n_slots, policy, prefill_chunk, disaggregate) ->
    ({name: summarize(...)}, {name: completions}, {name: step reports}). Ctrl-C prints the figures
    so far, exits 130."""
    for _, n_slots, policy, prefill_chunk, disaggregate in runs:  # refuse bad input before printing anything
        try:
            check_arguments(model, requests, n_slots, args.max_len or model.config.block_size, eos_id, policy,
                            prefill_chunk=prefill_chunk, disaggregate=disaggregate)
        except ValueError as e:
            fail(e)
    summaries, completions, all_reports = {}, {}, {}
    for name, n_slots, policy, prefill_chunk, disaggregate in runs:
        where = f"; {placement(model.lm_head.weight.device)}" if disaggregate else ""
        if show_belt:
            prompt_mark = ("with the prefill worker; '>A': A's keys and values handed over" if disaggregate
                           else "not all in yet")
            print(f"\n== {name}: {len(requests)} requests, {n_slots} slots (letter: the request that made a "
                  f"token in that slot; '~': its prompt {prompt_mark}; '.': a slot doing no useful work){where}")
        elif disaggregate:
            print(f"{name}: {placement(model.lm_head.weight.device)}")
        reports, start = [], time.perf_counter()

        def on_step(report):
            reports.append(replace(report, logits=None))  # the figures need no logits: keep no (R, V) per step
            if show_belt:
                print_step(report)
            elif sys.stderr.isatty():  # a long quiet run still shows that it is alive
                print(f"\r{name}: step {report.step}", end="", file=sys.stderr, flush=True)

        try:
            completions[name] = generate(model, requests, n_slots=n_slots, max_len=args.max_len, eos_id=eos_id,
                                         policy=policy, prefill_chunk=prefill_chunk, on_step=on_step,
                                         disaggregate=disaggregate)
        except KeyboardInterrupt:
            print_interrupted(name, requests, reports, summaries, time.perf_counter() - start)
            sys.exit(130)  # 128 + SIGINT: how a shell reports a program that Ctrl-C stopped
        wall_s = time.perf_counter() - start
        summaries[name], all_reports[name] = summarize(requests, completions[name], reports, wall_s), reports
        if not show_belt:
            print(f"\r{name}: {len(requests)} requests in {wall_s:.1f} s", file=sys.stderr)
    return summaries, completions, all_reports


def placement(device):
    """Where a disaggregated run's two sides are, in words, for a decode loop on `device`."""
    worker_device = prefill_device(device)
    if device.type == "cpu":
        n_worker, n_loop = split_threads(torch.get_num_threads())
        return (f"the prefill worker on {n_worker} of torch's {torch.get_num_threads()} CPU threads, the decode loop "
                f"on {n_loop}")
    if worker_device == device:
        return f"the prefill worker on {device} too, on a CUDA stream of its own: one GPU, shared by both sides"
    return (f"the prefill worker on {worker_device} with a copy of the weights, the decode loop on {device}: keys "
            f"and values cross between the GPUs")


def print_interrupted(name, requests, reports, summaries, wall_s):
    """The runs done so far, and the one Ctrl-C cut short, up to its last step."""
    finished = [None] * len(requests)  # generate never returned: its reports say who finished
    for report in reports:
        for i, completion in report.finished:
            finished[i] = completion
    print(f"\ninterrupted after {len(reports)} steps of {name}: tokens and occupancy count every request that "
          f"ran, latencies only the {sum(c is not None for c in finished)} of {len(requests)} that finished")
    if reports:
        summaries = {**summaries, f"{name} (cut)": summarize(requests, finished, reports, wall_s)}
    if summaries:
        print_table(summaries)


def long_tailed(rng, n, mean, cap):
    """n answer lengths shaped like chat traffic, many short and a long tail: the n quantiles of a
    capped exponential, in random order. Quantiles rather than random draws, so that the mix is the
    same for every seed and only the order is left to chance."""
    lengths = [min(cap, 1 + int(-mean * math.log(1 - (i + 0.5) / n))) for i in range(n)]
    rng.shuffle(lengths)
    return lengths


def load_gpt2(weights):
    """Real GPT-2: --weights, else gpt2 from the cache or a download; None if that is offline."""
    try:
        return GPT.from_pretrained(weights or "gpt2")
    except (ValueError, OSError) as e:  # offline, or a missing, damaged or foreign checkpoint
        if isinstance(e, ConnectionError) and not weights:
            return None  # the demo runs on random weights instead, and says so
        fail(e)


def load_tokenizer():
    """tiktoken's GPT-2 encoding, or None when its files are neither cached nor downloadable."""
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(default_cache_dir() / "tiktoken"))
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception:  # offline, tiktoken raises its HTTP library's own errors
        return None


def print_texts(tokenizer, requests, completions):
    for i, (request, completion) in enumerate(zip(requests, completions)):
        print(f"{letter(i)} ({completion.finish_reason}): "
              f"{tokenizer.decode(request.prompt)!r} -> {tokenizer.decode(completion.tokens)!r}")


TINY = GPTConfig(n_layer=2, n_head=4, n_embd=64)  # --quick: the same loop in seconds
DEMO_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
                "The three primary colors are", "My favourite recipe for pancakes", "In 1969, the first humans",
                "The quick brown fox", "Dear hiring manager,", "The best way to learn a language is",
                "Q: What is continuous batching?\nA:", "The weather today is", "Breaking news:"]


DEMO_PREFILL_CHUNK = 32  # prompt tokens a step in --demo: a 40-token prompt takes two steps


def demo(args):
    """A mixed workload through continuous, then static batching, the belt on screen -> its panels."""
    model, tokenizer = (None, None) if args.quick else (load_gpt2(args.weights), load_tokenizer())
    has_weights = model is not None
    if not has_weights:  # --quick, or offline: the same loop on random weights
        torch.manual_seed(args.seed)
        model = GPT(TINY if args.quick else GPTConfig())
    model = model.to(args.device, args.dtype).eval()
    if tokenizer and tokenizer.n_vocab != model.config.vocab_size:
        tokenizer = None  # weights with a vocabulary of their own: GPT-2's token ids would be wrong
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
    if tokenizer:
        prompts = [tokenizer.encode(DEMO_PROMPTS[i % len(DEMO_PROMPTS)]) for i in range(n_requests)]
    else:
        prompts = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(4, 40))]
                   for _ in range(n_requests)]
    # A first wave fills the belt and queues up; the rest arrive, one every other step, while it runs.
    requests = [Request(prompt, max_new, args.temperature, args.top_k, seed=args.seed + i,
                        arrival=0 if i < first_wave else 2 * (i - first_wave + 1))
                for i, (prompt, max_new) in enumerate(zip(prompts, lengths))]
    # Prompts go in DEMO_PREFILL_CHUNK tokens a step unless told otherwise, so that a slot taking
    # in a long prompt ('~') is seen beside slots that keep decoding. Disaggregated, the continuous
    # run's prompts go to the prefill worker instead, whole unless told otherwise; static cannot.
    prefill_chunk = args.prefill_chunk or DEMO_PREFILL_CHUNK
    name = "disaggregated" if args.disaggregate else "continuous"
    runs = [(name, args.slots, "continuous", args.prefill_chunk if args.disaggregate else prefill_chunk,
             args.disaggregate), ("static", args.slots, "static", prefill_chunk, False)]
    summaries, completions, _ = run_all(model, requests, runs, args, EOT, show_belt=not args.quiet)
    if tokenizer:
        print_texts(tokenizer, requests, completions[name])
    print_table(summaries, legend=True)
    cont, stat = summaries[name], summaries["static"]
    print(f"\nThe rows to compare: steps and TTFT. The same {cont['generated tokens']} tokens took "
          f"{cont['steps']} steps {name}, {stat['steps']} static, and the median request\nwaited "
          f"{cont['TTFT P50/P99 (steps)'][0]} steps for its first token, against {stat['TTFT P50/P99 (steps)'][0]}: "
          f"static refills the belt only once the longest answer of its batch is done.")
    return [[(run, args.slots, completions[run], summaries[run], None) for run, *_ in runs]]


def prompt_mode(args):
    """Your prompts, real GPT-2, the belt on screen -> its panel."""
    tokenizer, model = load_tokenizer(), load_gpt2(args.weights)
    if tokenizer is None or model is None:
        fail("--prompt needs GPT-2's weights and tiktoken's files, which are neither cached nor "
             "downloadable here: run once online, or pass --weights PATH")
    model = model.to(args.device, args.dtype).eval()
    requests = [Request(tokenizer.encode(text), args.max_new_tokens, args.temperature, args.top_k,
                        seed=args.seed + i) for i, text in enumerate(args.prompt)]
    name = "disaggregated" if args.disaggregate else args.policy
    run = (name, args.slots, args.policy, args.prefill_chunk, args.disaggregate)
    summaries, completions, _ = run_all(model, requests, [run], args, EOT, show_belt=not args.quiet)
    print_texts(tokenizer, requests, completions[name])
    print_table(summaries, legend=True)
    return [[(name, args.slots, completions[name], summaries[name], None)]]


def seeded_model(args):
    """The model --bench and --verify measure: --weights, else a random GPT-2 (tiny with --quick),
    the same for every run with the same --seed."""
    torch.manual_seed(args.seed)
    model = load_gpt2(args.weights) if args.weights else GPT(TINY if args.quick else GPTConfig())
    return model.to(args.device, args.dtype).eval()


def bench(args):
    """Seeded workloads, timed: continuous against static and sequential (the engine with one
    slot), the scheduler's efficiency, and long prompts served whole, in chunks or disaggregated ->
    two groups of panels: continuous and static; the three long-prompt runs."""
    model = seeded_model(args)
    V, rng = model.config.vocab_size, random.Random(args.seed)
    n_requests = args.requests or 16 * args.slots  # a steady stream: many more requests than slots
    lengths = long_tailed(rng, n_requests, mean=16, cap=128)
    requests = [Request([rng.randrange(V) for _ in range(rng.randint(4, 16))], n,
                        arrival=int(i / args.arrival_rate) if args.arrival_rate else 0)
                for i, n in enumerate(lengths)]
    print(f"bench: {n_requests} requests, prompts of 4-16 tokens, answers of {min(lengths)}-{max(lengths)} "
          f"(mean {sum(lengths) / n_requests:.1f}) tokens, GPT-2 {model.config.n_layer} layers "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M, {args.device}, {args.dtype}")
    runs = [("continuous", args.slots, "continuous", args.prefill_chunk, False),
            ("static", args.slots, "static", args.prefill_chunk, False),
            ("sequential", 1, "continuous", args.prefill_chunk, False)]
    runs += [("disaggregated", args.slots, "continuous", args.prefill_chunk, True)] if args.disaggregate else []
    # eos_id=None: every answer runs to its drawn length, so real weights see the same workload.
    summaries, completions, _ = run_all(model, requests, runs, args, eos_id=None, show_belt=False)
    # The scheduler's efficiency: the same prompts with every answer of the mean length, so that a
    # belt of them never idles. While requests wait, continuous should come close to its rate.
    mean_length = round(sum(lengths) / n_requests)
    packable = [Request(r.prompt, mean_length, arrival=r.arrival) for r in requests]
    packable_run = ("packable", args.slots, "continuous", args.prefill_chunk, False)
    summaries.update(run_all(model, packable, [packable_run], args, eos_id=None, show_belt=False)[0])
    print_table(summaries, legend=True)
    cont, stat, seq, ideal = (summaries[name] for name in ("continuous", "static", "sequential", "packable"))
    print(f"\nsteps static / continuous:        {stat['steps'] / cont['steps']:.2f}x")
    print(f"tokens/s continuous / static:     {cont['tokens/s'] / stat['tokens/s']:.2f}x")
    print(f"tokens/s continuous / sequential: {cont['tokens/s'] / seq['tokens/s']:.2f}x")
    if args.disaggregate:
        print(f"tokens/s disaggregated / continuous: {summaries['disaggregated']['tokens/s'] / cont['tokens/s']:.2f}x")
    if cont["tokens/s while queued"] and ideal["tokens/s while queued"]:
        print(f"scheduler efficiency: while requests wait, continuous makes {cont['tokens/s while queued']:.1f} "
              f"tokens/s, {cont['tokens/s while queued'] / ideal['tokens/s while queued']:.0%} of the "
              f"{ideal['tokens/s while queued']:.1f} of a perfectly packable workload (every answer {mean_length} "
              f"tokens)")
    if args.quick:
        print("--quick: on a model this small a step's fixed cost (Python, and launching each of its "
              "operations) dominates what its rows cost, so these ratios are not GPT-2's: steps compare "
              "fairly, seconds do not. Without --quick: GPT-2 124M.")
    long_prompt_panels = long_prompts(model, args)
    if model.config.block_size >= 1024:
        short, long = (time_decode_steps(model, [[100] * args.slots], max_len, repeats=10)[0]
                       for max_len in (128, 1024))
        print(f"\ndecode step at position 100: {1e3 * short:.1f} ms with max_len=128, "
              f"{1e3 * long:.1f} ms with max_len=1024 ({long / short:.2f}x)")
    max_len = args.max_len or model.config.block_size
    cache_bytes = model.new_cache(args.slots, max_len).nbytes
    if args.device.type == "cuda":
        peak = f"{torch.cuda.max_memory_allocated() / 1e6:.0f} MB on the GPU"
    else:
        try:
            import resource  # Unix only
            peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB resident"
        except ImportError:
            peak = "not measured here"
    print(f"KV cache: {cache_bytes / 1e6:.1f} MB ({args.slots} slots x {max_len} positions), made once per "
          f"run; peak memory of the whole process so far: {peak}")
    if model.config.block_size >= 1024:
        attention_table(model)  # last: its belts of 64 slots hold a cache 8 times the size of 8 slots'
    shown = ["continuous", "static"] + ["disaggregated"] * args.disaggregate
    return [[(name, args.slots, completions[name], summaries[name], None) for name in shown], long_prompt_panels]


def long_prompts(model, args):
    """A steady stream of short requests with a few long prompts among them, served with whole
    prompts, in chunks, and disaggregated: a whole long prompt stalls every decoding request for one
    long step; chunks spread it over several; a prefill worker takes it off the belt -> their
    panels, each with its step durations."""
    V, rng, n_requests = model.config.vocab_size, random.Random(args.seed + 1), 8 * args.slots
    long_len = min(600, (args.max_len or model.config.block_size) - 70)  # room for the short answers beside it
    if long_len < 100:
        print(f"\nlong prompts: skipped, --max-len {args.max_len} leaves no room for a long prompt (170 at least)")
        return []
    lengths = long_tailed(rng, n_requests, mean=16, cap=64)
    is_long = [i % (n_requests // 4) == n_requests // 8 for i in range(n_requests)]  # 4 of them, spread out
    requests = [Request([rng.randrange(V) for _ in range(long_len if long else rng.randint(4, 16))], n,
                        arrival=i * 2)  # one every other step: about what the belt serves
                for i, (n, long) in enumerate(zip(lengths, is_long))]
    chunk = args.prefill_chunk or 64
    print(f"\nlong prompts: {n_requests} requests arriving one every other step, {sum(is_long)} of them with "
          f"{long_len}-token prompts, the rest 4-16; whole prompts, chunks of {chunk}, and disaggregated (whole "
          f"prompts on a prefill worker)")
    runs = [("whole prompts", args.slots, "continuous", None, False),
            (f"chunks of {chunk}", args.slots, "continuous", chunk, False),
            ("disaggregated", args.slots, "continuous", None, True)]
    summaries, completions, reports = run_all(model, requests, runs, args, eos_id=None, show_belt=False)
    print_table(summaries)
    whole, chunked, disaggregated = summaries.values()
    print(f"\n{'against whole prompts':24}{'chunked':>18}{'disaggregated':>18}")
    for row, figure in [("TBT P99", lambda summary: summary["TBT P50/P99 (ms)"][1]),
                        ("TTFT P99", lambda summary: summary["TTFT P50/P99 (s)"][1]),
                        ("tokens/s", lambda summary: summary["tokens/s"])]:
        print(f"{row:24}" + "".join(f"{figure(summary) / figure(whole):>17.2f}x"
                                    for summary in (chunked, disaggregated)))
    return [(name, args.slots, completions[name], summaries[name], step_times(reports[name], completions[name]))
            for name, *_ in runs]


def step_times(reports, completions):
    """[(step, seconds, whether a request decoded in it)]: a step decodes when it makes more tokens
    than first tokens."""
    first_tokens = Counter(c.first_token_step for c in completions if c is not None)
    return [(report.step, report.step_s, report.n_running > first_tokens[report.step]) for report in reports]


def time_decode_steps(model, belts, max_len, repeats=5):
    """Seconds for one forward of each belt, every slot decoding, slot s of belt b at position
    belts[b][s], in one cache of max_len positions: the median of `repeats` rounds, each round
    running every belt once, so that the machine's drift falls on all belts alike."""
    device, n_slots = model.lm_head.weight.device, len(belts[0])
    cache = model.new_cache(n_slots, max_len)
    steps = []
    for positions in belts:
        runs = [Running(slot, Request([0] * position, 2), slot, None, admit_step=0, n_cached=position, tokens=[0])
                for slot, position in enumerate(positions)]  # each about to feed its first answer token
        steps.append(pack_step([(run, [0]) for run in runs], [], n_slots, device)[0])
    seconds = [[] for _ in belts]
    with torch.no_grad():
        for _ in range(1 + repeats):  # the first round warms up
            for packed, times in zip(steps, seconds):
                start = time.perf_counter()
                model.forward_packed(packed, cache)
                synchronize(device)
                times.append(time.perf_counter() - start)
    return [statistics.median(times[1:]) for times in seconds]


def attention_table(model):
    """How a step's cost grows with the belt and its lengths: decode steps of 8 to 64 slots, every
    slot short; one long among short ones; lengths spread from 50 to 1000, against every slot at
    their mean (the same keys in all). Attention reads what the slots hold: one long slot costs
    about its own length, not every slot's padding to it."""
    def spread(n):
        return [50 + 950 * slot // (n - 1) for slot in range(n)]

    belts = {"all short (48)": lambda n: [48] * n, "one long (940)": lambda n: [940] + [48] * (n - 1),
             "spread 50-1000": spread, "at their mean": lambda n: [round(sum(spread(n)) / n)] * n}
    config, itemsize = model.config, model.lm_head.weight.element_size()
    cache_64_gb = 64 * 1024 * config.n_layer * 2 * config.n_embd * itemsize / 1e9  # keys and values, every layer
    print(f"\ndecode steps (ms, the median of 5 rounds of the four belts), every slot decoding, its length in keys "
          f"(64 slots hold a cache of {cache_64_gb:.1f} GB)")
    print(f"{'':10}" + "".join(f"{name:>16}" for name in belts) + f"{'long / short':>14}{'spread / mean':>15}")
    for n_slots in (8, 16, 32, 64):
        lengths = [[length - 1 for length in belt(n_slots)] for belt in belts.values()]  # positions
        ms = [1e3 * seconds for seconds in time_decode_steps(model, lengths, max_len=1024)]
        print(f"{f'{n_slots} slots':10}" + "".join(f"{t:>16.1f}" for t in ms) +
              f"{ms[1] / ms[0]:>13.2f}x{ms[2] / ms[3]:>14.2f}x", flush=True)


# ---------------------------------------------------------------------------------------------
# --verify: the engine's greedy answers against the reference's, and why they may differ


ROUNDING_FACTOR = 4  # how far past the reference's own error the batched logits may land. Summing in
#                      another order lands about as far: at most 1.53x at each of 720 tokens measured
#                      (tiny and 124M models, float32 and bfloat16). A decode mask that sees too much
#                      landed 19x-43x as far in bfloat16, over 390,000x in float32 (--quick).


def verdict(batched, sequential, exact):
    """Why the engine's greedy token differs from the reference's -> ('rounding' or 'BUG', the
    figures behind it).

    batched, sequential: (V,) the logits each side took its token from, in the run's dtype;
    exact: (V,) the logits of the same prefix recomputed in float64, from the same weights. The
    two tokens are always a near-tie (each side ranks its own first, so their gap is within twice
    the rows' difference), so the margin alone tells nothing. The distance to the exact logits
    does: the dtype's rounding moves the reference's logits some way, and the engine's, which only
    sum in another order, about as far; a wrong mask or cache computes something else, and lands
    much further. The reference's error counts as at least one rounding of the largest logit: in
    float64 the reference is the exact recomputation, and its error 0.
    """
    one_rounding = torch.finfo(sequential.dtype).eps * exact.abs().max().item()
    batched, sequential, exact = batched.double(), sequential.double(), exact.double()

    def distance(a, b):  # the largest logit difference; a NaN is the largest of all
        return (a - b).abs().nan_to_num(nan=math.inf).max().item()

    top_two = sequential.topk(2).values
    figures = {
        "reference margin": (top_two[0] - top_two[1]).item(),  # between the reference's top two logits
        "|batched - reference|": distance(batched, sequential),
        "batched error": distance(batched, exact),
        "reference error": distance(sequential, exact),
    }
    figures["tolerance"] = ROUNDING_FACTOR * max(figures["reference error"], one_rounding)
    return "rounding" if figures["batched error"] <= figures["tolerance"] else "BUG", figures


def verify(args):
    """Seeded greedy requests through generate and through generate_sequential; each answer
    identical, or apart by rounding, or by a BUG. Exits with status 1 if any is a BUG, else 0."""
    model = seeded_model(args)
    tokenizer = None if args.quick else load_tokenizer()
    if tokenizer and tokenizer.n_vocab != model.config.vocab_size:
        tokenizer = None

    def shown_token(token):
        return f"{tokenizer.decode([token])!r} ({token})" if tokenizer else str(token)

    # 1) The workload: prompts of mixed lengths, answers long enough to meet near-ties, more
    #    requests than slots and a third of them late, so that slots are reused mid-run.
    V, rng = model.config.vocab_size, random.Random(args.seed)
    n_requests, prompt_lens, answer_lens = (12, (4, 16), (8, 24)) if args.quick else (16, (4, 48), (24, 64))
    requests = [Request([rng.randrange(V) for _ in range(rng.randint(*prompt_lens))], rng.randint(*answer_lens),
                        arrival=rng.randint(1, 40) if i % 3 == 2 else 0) for i in range(n_requests)]
    try:  # bad input is refused before anything is printed
        check_arguments(model, requests, args.slots, args.max_len or model.config.block_size, None, args.policy,
                        prefill_chunk=args.prefill_chunk, disaggregate=args.disaggregate)
    except ValueError as e:
        fail(e)
    prompts_go = f"prompt chunks of {args.prefill_chunk}" if args.prefill_chunk else "whole prompts"
    if args.disaggregate:
        prompts_go += f" on a prefill worker: {placement(model.lm_head.weight.device)}"
    print(f"verify: {n_requests} greedy requests (prompts of {'-'.join(map(str, prompt_lens))} random tokens, "
          f"answers of {'-'.join(map(str, answer_lens))}, {sum(r.arrival > 0 for r in requests)} arriving late) "
          f"through generate ({args.slots} slots, {args.policy}, {prompts_go}) and "
          f"generate_sequential; GPT-2 {model.config.n_layer} layers "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M, {args.device}, {args.dtype}")
    print(f"rule: at an answer's first differing token, both forwards' logits are compared with a float64 "
          f"recomputation of the same prefix: 'rounding' if the batched ones are within {ROUNDING_FACTOR}x the "
          f"reference's own error of it (at least one rounding of the largest logit), 'BUG' if further")
    # 2) The reference's answers.
    start = time.perf_counter()
    reference = generate_sequential(model, requests, max_len=args.max_len, eos_id=None)
    reference_s = time.perf_counter() - start
    # 3) The engine's answers, and from its step reports the logits row of each answer's first
    #    token that differs from the reference's. Request i's k-th row in the reports made its token k.
    n_rows_seen, first_flip = [0] * n_requests, {}  # first_flip[i]: (position in the answer, logits row)

    def on_step(report):
        for i, row in zip(report.sampled, report.logits):
            k, reference_tokens = n_rows_seen[i], reference[i].tokens
            n_rows_seen[i] += 1
            token = int(sample(row, requests[i], None))  # the engine's own rule: the token it took
            if i not in first_flip and k < len(reference_tokens) and token != reference_tokens[k]:
                first_flip[i] = (k, row.clone())  # a copy: the step's whole (R, V) logits need not stay

    start = time.perf_counter()
    batched = generate(model, requests, n_slots=args.slots, max_len=args.max_len, eos_id=None, policy=args.policy,
                       prefill_chunk=args.prefill_chunk, on_step=on_step, disaggregate=args.disaggregate)
    batched_s = time.perf_counter() - start
    # 4) Each answer, identical or judged at its first differing token. The reference's logits
    #    there come again from the forward it ran (plain, in the run's dtype, on the same prefix),
    #    the exact ones from a float64 copy of the model.
    exact_model, counts = None, {"identical": 0, "rounding": 0, "BUG": 0}
    for i, (request, got, want) in enumerate(zip(requests, batched, reference)):
        if n_rows_seen[i] != len(got.tokens):  # a token whose logits were not reported goes unjudged
            name, line = "BUG", f"{len(got.tokens)} tokens, but {n_rows_seen[i]} logits rows for it in the step reports"
        elif got.tokens == want.tokens:
            name, line = "identical", ""
        elif i not in first_flip:  # only a broken engine or report gets here
            name, line = "BUG", (f"answers of {len(got.tokens)} and {len(want.tokens)} tokens, and no logits "
                                 f"row in the step reports made a token that differs")
        else:
            position, batched_row = first_flip[i]
            if exact_model is None:
                exact_model = copy.deepcopy(model).double()
            prefix = torch.tensor([request.prompt + want.tokens[:position]], device=args.device)  # (1, T)
            with torch.no_grad():
                sequential_row, exact_row = model(prefix)[0, -1], exact_model(prefix)[0, -1]  # each (V,)
            name, f = verdict(batched_row, sequential_row, exact_row)
            line = (f"first differs at token {position}: {shown_token(got.tokens[position])} vs "
                    f"{shown_token(want.tokens[position])} (batched vs reference); reference margin "
                    f"{f['reference margin']:.3g}; |batched - reference| {f['|batched - reference|']:.3g}; "
                    f"off float64: batched {f['batched error']:.3g}, reference {f['reference error']:.3g}, "
                    f"tolerance {f['tolerance']:.3g}")
        counts[name] += 1
        print(f"{letter(i)}  {name:9} {line}".rstrip())
    print(f"{n_requests} answers: " + ", ".join(f"{n} {name}" for name, n in counts.items()) +
          f" (generate_sequential {reference_s:.1f} s, generate {batched_s:.1f} s)")
    sys.exit(1 if counts["BUG"] else 0)


def positive(number_type):
    """An argparse type: a number_type (int or float) above 0. For the numbers the command line
    builds work from itself (16 requests per slot, one arrival every 1 / rate steps): generate
    checks everything it is given, but these it never sees."""
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


def write_svg(path, groups):
    try:
        Path(path).write_text(belt_svg(*groups))
    except OSError as e:  # no such folder, no permission
        fail(f"--svg: {e}")
    print(f"\nthe belt, a panel per run: {path} (open it in a browser)")


SERVING = {"slots", "max_len", "prefill_chunk", "disaggregate", "seed", "device", "dtype", "svg"}
MODES = {  # --MODE: the function that runs it (it returns the panels for --svg), the options it takes
    "demo": (demo, SERVING | {"quick", "weights", "temperature", "top_k", "quiet"}),
    "prompt": (prompt_mode, SERVING | {"weights", "max_new_tokens", "temperature", "top_k", "policy", "quiet"}),
    "bench": (bench, SERVING | {"quick", "weights", "requests", "arrival_rate"}),
    "verify": (verify, SERVING - {"svg"} | {"quick", "weights", "policy"}),  # exits 0, or 1 for a BUG
}
DEFAULTS = dict(slots=8, max_len=None, prefill_chunk=None, seed=0, temperature=0.0, top_k=None, max_new_tokens=64,
                policy="continuous", requests=None, arrival_rate=None, weights=None, quick=False, device=None,
                dtype="float32", quiet=False, svg=None, disaggregate=False)


def main(argv=None):
    """Parse, refuse what does not apply, run one mode. The parser knows no defaults (DEFAULTS comes
    after the checks), so it returns exactly what was typed: an option that does not apply to the
    mode is refused even when typed with its default value."""
    parser = argparse.ArgumentParser(prog="nanobatch.py", argument_default=argparse.SUPPRESS,
                                     usage="%(prog)s (--demo | --prompt TEXT | --bench | --verify) [options]",
                                     description="Continuous batching for GPT-2, in one loop you can read.")
    what = parser.add_argument_group("what to run").add_mutually_exclusive_group(required=True)
    what.add_argument("--demo", action="store_true", help="a mixed workload, continuous vs static")
    what.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt; repeat for more requests")
    what.add_argument("--bench", action="store_true", help="continuous vs static vs sequential, timed")
    what.add_argument("--verify", action="store_true", help="batched against sequential answers, each judged: "
                                                           "identical, rounding or BUG (exit status 1)")
    work = parser.add_argument_group("the requests and the belt")
    work.add_argument("--slots", type=positive(int), metavar="N", help="slots on the belt: the batch size (8)")
    work.add_argument("--max-len", type=int, metavar="N", help="positions per slot (the model's, 1024)")
    work.add_argument("--prefill-chunk", type=int, metavar="N", help="at most N prompt tokens a step "
                      f"(--demo: {DEMO_PREFILL_CHUNK}; else no limit)")
    work.add_argument("--disaggregate", action="store_true", help="continuous batching prefills every prompt on a "
                      "worker of its own: a second GPU, a CUDA stream of its own on one, or half the CPU's threads "
                      "(static batching cannot; --bench: a column of its own)")
    work.add_argument("--seed", type=int, help="request i samples with seed + i; --bench: its workload (0)")
    work.add_argument("--temperature", type=float, metavar="T", help="--demo, --prompt: 0 is greedy (0)")
    work.add_argument("--top-k", type=int, metavar="K", help="--demo, --prompt: sample among the K likeliest")
    work.add_argument("--max-new-tokens", type=int, metavar="N", help="--prompt: per request (64)")
    work.add_argument("--policy", choices=POLICIES, help="--prompt, --verify: how to fill the belt (continuous)")
    work.add_argument("--requests", type=positive(int), metavar="N", help="--bench: how many (16 per slot)")
    work.add_argument("--arrival-rate", type=positive(float), metavar="R",
                      help="--bench: requests per step (all at once)")
    setup = parser.add_argument_group("model and output")
    setup.add_argument("--weights", metavar="PATH", help="a checkpoint directory or file, or gpt2, gpt2-medium, "
                       "... to download")
    setup.add_argument("--quick", action="store_true",
                       help="--demo, --bench, --verify: a tiny random model, in seconds")
    setup.add_argument("--device", type=usable_device, help="cpu, cuda, cuda:1, ... (cuda when present)")
    setup.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], help="(float32)")
    setup.add_argument("--quiet", action="store_true", help="--demo, --prompt: no belt, only the summary")
    setup.add_argument("--svg", metavar="FILE", help="the belt drawn into FILE, a panel per run (--bench: "
                       "continuous, static and disaggregated, not sequential, whose 8 times as many steps would "
                       "squeeze them; then the long-prompt runs with their step durations)")
    given = vars(parser.parse_args(argv))
    mode = next(name for name in MODES if name in given)  # exactly one: the parser saw to that
    run, options = MODES[mode]
    for name in sorted(given.keys() - options - {mode}):
        parser.error(f"--{name.replace('_', '-')} does not apply to --{mode}")
    if "quick" in given and "weights" in given:
        parser.error("--weights does not apply to --quick, which runs a tiny random model")
    if "svg" in given and not Path(given["svg"]).parent.is_dir():  # found out now, not after a long run
        parser.error(f"--svg {given['svg']}: no such folder")
    args = argparse.Namespace(**{**DEFAULTS, **given})
    args.device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = getattr(torch, args.dtype)
    try:
        groups = run(args)  # the panels for --svg, in groups that each share a step scale
        if args.svg:
            write_svg(args.svg, groups)
    except BrokenPipeError:  # the reader has gone (`| head`): stop quietly, as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's last flush must not fail
        sys.exit(141)  # 128 + SIGPIPE: how a shell reports a program that a closed pipe stopped
    except KeyboardInterrupt:  # Ctrl-C outside a run (while loading, say): nothing to summarize
        sys.exit(130)


if __name__ == "__main__":
    main()
