"""
nanobatch: continuous batching (iteration-level scheduling) for GPT-2, in one loop.

A belt of S slots, each able to hold one sequence's keys and values in the KV cache. Every step:
    1) requests whose arrival step has come join the waiting queue;
    2) waiting requests are admitted into free slots and their prompts prefilled, together;
    3) one decode step runs over the whole belt: every running request gets one new token;
    4) the step is reported (which request sits in which slot: the belt you see scroll by);
    5) requests that hit EOS, their max_new_tokens or the slot's max_len are retired, and their
       slots are free for step 2 of the very next step.
Static batching is the same loop with one decision changed (`slots_to_fill`): it refills only an
empty belt, so a short answer's slot idles until the longest answer of its batch is done.

Shape legend: S slots, B rows in a forward, T new tokens per row, L cache positions attended over,
V vocabulary size.
"""
import argparse
import math
import os
import random
import string
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

import torch

from model import GPT, GPTConfig, default_cache_dir

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
    admit_step: int  # loop step whose prefill took this request into a slot
    finish_step: int  # loop step that produced its last token
    ttft_s: float  # seconds from the start of its arrival step to its first token
    latency_s: float  # seconds from the start of its arrival step to its last token


# ---------------------------------------------------------------------------------------------
# Sampling and stopping, one rule each, shared by the engine and the sequential reference;
# and checking the input, so that nothing fails halfway.


def new_sampler(request, device):
    """The request's own random generator: its draws never depend on its batch-mates."""
    generator = torch.Generator(device=device)
    if request.seed is None:
        generator.seed()
    else:
        generator.manual_seed(request.seed)
    return generator


def sample(logits, request, generator):
    """The next token id from one row of logits (V,)."""
    if request.temperature == 0:
        return int(logits.argmax())
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # no softmax in 16 bits
    logits = logits - logits.max()  # the largest is 0, so a tiny temperature cannot overflow
    if request.top_k is not None:
        kth_largest = torch.topk(logits, min(request.top_k, logits.size(-1))).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits / request.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def stop_reason(request, tokens, max_len, eos_id):
    """Why the request is done after its newest token, or None if it goes on."""
    if tokens[-1] == eos_id:
        return "eos"
    if len(tokens) == request.max_new_tokens:
        return "length"
    if len(request.prompt) + len(tokens) == max_len:
        return "context"  # its slot is full: the next token would have no position
    return None


def check_arguments(model, requests, n_slots, max_len, eos_id, policy):
    """Reject, before any work, everything that could not be served: nothing fails halfway."""
    V, block_size = model.config.vocab_size, model.config.block_size
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not (isinstance(n_slots, int) and n_slots >= 1):
        raise ValueError(f"n_slots must be an int >= 1, got {n_slots!r}")
    if not (isinstance(max_len, int) and 2 <= max_len <= block_size):
        raise ValueError(f"max_len must be in 2..{block_size} (the model's block_size), got {max_len}")
    if eos_id is not None and not 0 <= eos_id < V:
        raise ValueError(f"eos_id must be a token id in 0..{V - 1} or None, got {eos_id}")
    for i, r in enumerate(requests):
        if not isinstance(r.prompt, list) or len(r.prompt) == 0:
            raise ValueError(f"requests[{i}].prompt must be a non-empty list of token ids, got {r.prompt!r}")
        if bad := [t for t in r.prompt if not (isinstance(t, int) and 0 <= t < V)]:
            raise ValueError(f"requests[{i}].prompt has token id {bad[0]!r}, outside the vocabulary "
                             f"0..{V - 1}")
        if len(r.prompt) >= max_len:
            raise ValueError(f"requests[{i}].prompt has {len(r.prompt)} tokens, which leaves no room in "
                             f"max_len={max_len}: at most {max_len - 1} fit")
        if not (isinstance(r.max_new_tokens, int) and r.max_new_tokens >= 1):
            raise ValueError(f"requests[{i}].max_new_tokens must be an int >= 1, got {r.max_new_tokens!r}")
        if not (math.isfinite(r.temperature) and r.temperature >= 0):
            raise ValueError(f"requests[{i}].temperature must be finite and >= 0, got {r.temperature}")
        if r.top_k is not None and not (isinstance(r.top_k, int) and r.top_k >= 1):
            raise ValueError(f"requests[{i}].top_k must be an int >= 1 or None, got {r.top_k!r}")
        if not (isinstance(r.arrival, int) and r.arrival >= 0):
            raise ValueError(f"requests[{i}].arrival must be an int >= 0, got {r.arrival!r}")


# ---------------------------------------------------------------------------------------------
# The attention mask, and the two forward passes that use it


def attention_mask(positions, L):
    """(B, T, L) bool: a new token may see position l of its own slot iff l <= its own position.

    Each row is one slot, so prompts never see each other; within a slot this one rule is causal
    attention over exactly the slot's own prefix. What lies beyond (a padded prompt's filler, or
    keys left by the slot's previous occupant, 'x' below) is never seen. Two examples, 1 = visible:

      decode, 3 slots at positions 2, 4, 0          prefill, prompts of 3 and 2 tokens, T = 3
      cache position   0 1 2 3 4                    cache position   0 1 2
      slot 0, pos 2    1 1 1 0 0   (3, 4 hold x)    slot 3, pos 0    1 0 0
      slot 1, pos 4    1 1 1 1 1                           pos 1    1 1 0
      slot 2, pos 0    1 0 0 0 0   (1.. hold x)            pos 2    1 1 1
                                                    slot 5, pos 0    1 0 0
                                                           pos 1    1 1 0
                                                           pos 2    padding: output unused
    """
    key_positions = torch.arange(L, device=positions.device)  # (L,)
    return key_positions[None, None, :] <= positions[:, :, None]  # (B, T, L)


def prefill(model, cache, slots, prompts):
    """Write the prompts' keys and values into their fresh slots, all in one forward.

    Each prompt's last token is left out: it rides in this step's decode batch, which gives the
    request its first token. Rows are right-padded with token 0; padding writes keys past the
    prompt's end, which the mask hides until decoding has overwritten them.
    """
    device = cache.kv.device
    rows = [(slot, prompt[:-1]) for slot, prompt in zip(slots, prompts) if len(prompt) > 1]
    if not rows:
        return
    T = max(len(prefix) for _, prefix in rows)
    idx = torch.tensor([prefix + [0] * (T - len(prefix)) for _, prefix in rows], device=device)  # (B, T)
    positions = torch.arange(T, device=device).expand(len(rows), T)  # (B, T): each starts at 0
    row_slots = torch.tensor([slot for slot, _ in rows], device=device)  # (B,)
    model.forward_cached(idx, positions, cache, row_slots, attention_mask(positions, T), need_logits=False)


def decode(model, cache, belt):
    """One forward over every slot: each running request feeds its newest token -> logits (S, V).

    The batch is always the whole belt, so attention reads the cache as a view. An empty slot
    feeds token 0 at position 0 and its row is ignored: that row is the waste occupancy counts.
    """
    device = cache.kv.device
    slot_positions = [run.position if run else 0 for run in belt]
    L = max(slot_positions) + 1  # attend over the longest active sequence, not over max_len
    idx = torch.tensor([[run.newest_token] if run else [0] for run in belt], device=device)  # (S, 1)
    positions = torch.tensor(slot_positions, device=device)[:, None]  # (S, 1)
    return model.forward_cached(idx, positions, cache, None, attention_mask(positions, L))


def synchronize(device):
    if device.type == "cuda":  # GPU work is queued, not done, when Python moves on
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# The loop


@dataclass
class Running:
    """A request in a slot: the per-slot state the loop keeps."""
    request_index: int  # position of the request in the caller's list
    request: Request
    sampler: torch.Generator
    admit_step: int
    tokens: list[int] = field(default_factory=list)  # generated so far
    first_token_time: float | None = None

    @property
    def newest_token(self):  # the token this slot feeds to the next decode step
        return self.tokens[-1] if self.tokens else self.request.prompt[-1]

    @property
    def position(self):  # where the newest token goes in the slot; all before it are cached
        return len(self.request.prompt) + len(self.tokens) - 1


@dataclass
class StepReport:
    step: int
    belt: str  # one character per slot: the request's letter, '.' when it does no useful work
    n_running: int  # slots that produced a token this step
    n_waiting: int  # arrived requests still queued
    admitted: list[int]  # request indices prefilled this step
    finished: list[tuple[int, Completion]]  # (request index, its completion)
    model_s: float  # seconds spent in the model's forward passes this step


def letter(request_index):
    """The request's name on screen: A-Z, then a-z, then A again."""
    letters = string.ascii_uppercase + string.ascii_lowercase
    return letters[request_index % len(letters)]


def belt_picture(belt):
    """One character per slot: the letter of the request in it, or '.' for an empty slot."""
    return "".join(letter(run.request_index) if run else "." for run in belt)


def slots_to_fill(belt, policy):
    """The free slots a waiting request may take now. The whole difference between the policies:
    continuous refills a slot the step after it frees up; static refills only an empty belt."""
    free = [slot for slot, run in enumerate(belt) if run is None]
    if policy == "static" and len(free) < len(belt):
        return []
    return free


def generate(model, requests, *, n_slots=8, max_len=None, eos_id=EOT, policy="continuous",
             on_step=None):
    """Serve every request through a belt of n_slots; returns their Completions in request order.

    max_len: positions per slot (default: the model's block_size). eos_id=None: never stop on EOS.
    on_step: called with a StepReport after every step (the library itself prints nothing).
    """
    max_len = model.config.block_size if max_len is None else max_len
    check_arguments(model, requests, n_slots, max_len, eos_id, policy)
    device = model.lm_head.weight.device
    cache = model.new_cache(n_slots, max_len)  # the only large allocation, reused by every request
    pending = deque(sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i)))
    waiting = deque()  # arrived, not yet admitted: first come, first served
    belt = [None] * n_slots  # belt[slot]: the Running request in that slot, or None
    completions, arrived_at = [None] * len(requests), [None] * len(requests)  # arrived_at: wall time
    step, n_done = 0, 0
    with torch.no_grad():
        while n_done < len(requests):
            # 0) Nothing running and nothing waiting: jump the clock to the next arrival.
            if all(run is None for run in belt) and not waiting:
                step = max(step, requests[pending[0]].arrival)
            # 1) Arrivals join the queue.
            step_started = time.perf_counter()
            while pending and requests[pending[0]].arrival <= step:
                arrived_at[pending[0]] = step_started
                waiting.append(pending.popleft())
            # 2) Admit waiting requests into free slots, and prefill their prompts together.
            model_start = time.perf_counter()
            admitted_slots = []
            for slot in slots_to_fill(belt, policy)[:len(waiting)]:
                i = waiting.popleft()
                belt[slot] = Running(i, requests[i], new_sampler(requests[i], device), admit_step=step)
                cache.clear(slot)
                admitted_slots.append(slot)
            prefill(model, cache, admitted_slots, [belt[slot].request.prompt for slot in admitted_slots])
            # 3) Decode: one new token for every running request.
            logits = decode(model, cache, belt)  # (S, V)
            synchronize(device)  # sampling would wait for the GPU anyway; this makes model_s true
            model_s = time.perf_counter() - model_start
            finished_slots = []
            for slot, run in enumerate(belt):
                if run is None:
                    continue
                run.tokens.append(sample(logits[slot], run.request, run.sampler))
                now = time.perf_counter()
                if run.first_token_time is None:
                    run.first_token_time = now
                if reason := stop_reason(run.request, run.tokens, max_len, eos_id):
                    arrived = arrived_at[run.request_index]
                    completions[run.request_index] = Completion(run.tokens, reason, run.admit_step, step,
                                                                run.first_token_time - arrived, now - arrived)
                    finished_slots.append(slot)
            # 4) Report the step: the belt as it ran, and who came and went.
            if on_step is not None:
                admitted = [belt[slot].request_index for slot in admitted_slots]
                finished = [(belt[slot].request_index, completions[belt[slot].request_index])
                            for slot in finished_slots]
                on_step(StepReport(step, belt_picture(belt), sum(run is not None for run in belt),
                                   len(waiting), admitted, finished, model_s))
            # 5) Retire finished requests: their slots are free from the next step on.
            for slot in finished_slots:
                belt[slot] = None
            n_done += len(finished_slots)
            step += 1
    return completions


def generate_sequential(model, requests, *, max_len=None, eos_id=EOT):
    """The reference: one request at a time, the plain no-cache forward over the whole sequence
    for every token. Slow (quadratic) and plainly right. Its clock counts steps as a one-slot belt
    would: one token per step, requests first come, first served."""
    max_len = model.config.block_size if max_len is None else max_len
    check_arguments(model, requests, 1, max_len, eos_id, "continuous")
    device = model.lm_head.weight.device
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    not_arrived, arrived_at, completions = deque(order), [None] * len(requests), [None] * len(requests)
    step = 0
    with torch.no_grad():
        for i in order:
            request, tokens, reason, first_token_time = requests[i], [], None, None
            step = admit_step = max(step, request.arrival)  # idle until it arrives
            sampler = new_sampler(request, device)
            while reason is None:
                while not_arrived and requests[not_arrived[0]].arrival <= step:
                    arrived_at[not_arrived.popleft()] = time.perf_counter()
                logits = model(torch.tensor([request.prompt + tokens], device=device))  # (1, T, V)
                tokens.append(sample(logits[0, -1], request, sampler))
                now = time.perf_counter()
                first_token_time = now if first_token_time is None else first_token_time
                reason = stop_reason(request, tokens, max_len, eos_id)
                step += 1
            completions[i] = Completion(tokens, reason, admit_step, step - 1,
                                        first_token_time - arrived_at[i], now - arrived_at[i])
    return completions


# ---------------------------------------------------------------------------------------------
# Measuring and showing: shared by --demo, --prompt and --bench


def percentile(values, q):
    """Nearest rank: the smallest value with at least q% of all values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(requests, completions, wall_s, model_s, n_slots):
    """The figures of one run, from its completions (None for a request not finished)."""
    done = [(r, c) for r, c in zip(requests, completions) if c is not None]
    busy_steps = set().union(*(range(c.admit_step, c.finish_step + 1) for _, c in done))
    queued_steps = set().union(*(range(r.arrival, c.admit_step) for r, c in done))  # someone waited
    n_tokens = sum(len(c.tokens) for _, c in done)

    def n_running_at(step):
        return sum(c.admit_step <= step <= c.finish_step for _, c in done)

    def p50_p99(values):
        return percentile(values, 50), percentile(values, 99)

    n_running_while_queued = sum(n_running_at(step) for step in queued_steps)
    return {
        "steps": len(busy_steps),
        "generated tokens": n_tokens,
        "wall time (s)": wall_s,
        "tokens/s": n_tokens / wall_s,
        # Each running slot makes one token per step, so tokens / (steps * slots) = useful rows.
        "mean occupancy": n_tokens / (len(busy_steps) * n_slots),
        "occupancy while queued": (n_running_while_queued / (len(queued_steps) * n_slots)
                                   if queued_steps else None),
        "latency P50/P99 (steps)": p50_p99([c.finish_step - r.arrival + 1 for r, c in done]),
        "latency P50/P99 (s)": p50_p99([c.latency_s for _, c in done]),
        "TTFT P50/P99 (steps)": p50_p99([c.admit_step - r.arrival + 1 for r, c in done]),
        "TTFT P50/P99 (s)": p50_p99([c.ttft_s for _, c in done]),
        "time outside the model": 1 - model_s / wall_s,
    }


def print_table(summaries):
    """{run name: summarize(...)}, side by side."""
    def cell(value):
        if isinstance(value, tuple):
            return " / ".join(cell(v) for v in value)
        return str(value) if isinstance(value, int) else f"{value:.2f}"
    print(f"\n{'':24}" + "".join(f"{name:>16}" for name in summaries))
    for row in next(iter(summaries.values())):
        values = [summary[row] for summary in summaries.values()]
        cells = ["-" if v is None else f"{v:.0%}" if "occupancy" in row or "outside" in row else cell(v)
                 for v in values]
        print(f"{row:24}" + "".join(f"{c:>16}" for c in cells))


def print_step(report):
    """One line per step; read down the screen, the columns are the belt moving."""
    events = [f"+{letter(i)}" for i in report.admitted]
    events += [f"-{letter(i)}({c.finish_reason},{len(c.tokens)})" for i, c in report.finished]
    print(f"step {report.step:4d} |{report.belt}| {report.n_running:2d}/{len(report.belt)} "
          f"waiting {report.n_waiting:3d}  {' '.join(events)}", flush=True)


def run_all(model, requests, runs, args, eos_id, show_belt):
    """Serve the same requests once per (name, n_slots, policy) in runs -> summaries, completions.
    Ctrl-C prints the summary so far and exits 130."""
    summaries, completions = {}, {}
    for _, n_slots, policy in runs:  # refuse bad input before printing anything
        check_arguments(model, requests, n_slots, args.max_len or model.config.block_size, eos_id, policy)
    for name, n_slots, policy in runs:
        finished, start, model_s = [None] * len(requests), time.perf_counter(), 0.0

        def on_step(report):
            nonlocal model_s
            model_s += report.model_s
            for i, completion in report.finished:
                finished[i] = completion
            if show_belt:
                print_step(report)
            elif sys.stderr.isatty():  # a long quiet run still shows that it is alive
                print(f"\r{name}: step {report.step}", end="", file=sys.stderr, flush=True)

        if show_belt:
            print(f"\n== {name}: {len(requests)} requests, {n_slots} slots "
                  f"(letter: the request in that slot; '.': a slot doing no useful work)")
        try:
            generate(model, requests, n_slots=n_slots, max_len=args.max_len, eos_id=eos_id, policy=policy,
                     on_step=on_step)
        except KeyboardInterrupt:
            n_finished = sum(c is not None for c in finished)
            print(f"\ninterrupted: figures for the {n_finished} requests finished so far")
            if any(finished):
                summaries[name + " (cut)"] = summarize(requests, finished, time.perf_counter() - start,
                                                       model_s, n_slots)
                print_table(summaries)
            sys.exit(130)
        if not show_belt:
            seconds = time.perf_counter() - start
            print(f"\r{name}: {len(requests)} requests in {seconds:.1f} s", file=sys.stderr)
        summaries[name] = summarize(requests, finished, time.perf_counter() - start, model_s, n_slots)
        completions[name] = finished
    return summaries, completions


# ---------------------------------------------------------------------------------------------
# The belt as a picture: an SVG panel per run, steps along x, slots along y


SVG_WIDTH, LEFT, RIGHT = 1200, 44, 16  # px: fits a laptop screen; LEFT holds the margin's labels
TITLE_H, GAP, STRIP_H, AXIS_H = 26, 6, 24, 30  # px: a panel's title, belt-to-strip gap, strip, axis
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


def panel_svg(title, n_slots, completions, summary, step_w, n_axis_steps, top):
    """One run, drawn from y = top down: its title, a belt of n_slots rows, the occupancy strip and
    the step axis -> (the panel's SVG, the y where the next panel begins)."""
    done = [(i, c) for i, c in enumerate(completions) if c is not None]  # None: did not finish
    n_steps = max((c.finish_step + 1 for _, c in done), default=0)
    row_h = min(22, max(6, 360 / n_slots))  # 8 slots: roomy rows; 64: thin ones, 384 px in all
    belt_h = n_slots * row_h
    heading = (f"{title}, {n_slots} slots: {summary['steps']} steps, {summary['tokens/s']:.1f} tokens/s, "
               f"TTFT P50 {summary['TTFT P50/P99 (steps)'][0]:g} steps")
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
    # The step axis, the same in every panel.
    axis_y = strip_top + STRIP_H + 4
    parts.append(margin_label("step", axis_y + 8))
    for step in range(0, n_axis_steps + 1, every(step_w, 50, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))):
        x = LEFT + step * step_w
        parts += [tag("line", x1=x, x2=x, y1=axis_y - 4, y2=axis_y, stroke="#555"),
                  tag("text", step, x=x, y=axis_y + 12, font_size=10, fill="#555", text_anchor="middle")]
    return tag("g", "".join(parts), class_="panel", data_title=title, data_step_width=repr(step_w),
               transform=f"translate(0, {top})"), top + axis_y + AXIS_H


def legend_svg():
    """One line, above the panels, saying what the marks mean."""
    keys = [([colour(2)], "a request in its slot, with its letter (hover over it: details)"),
            ([colour(2), "url(#hatch)"], "its prompt being prefilled: no token yet"),
            (["#eee"], "an idle slot"), (["#666"], "busy: the share of slots holding a request")]
    parts, x = [], 8
    for fills, text in keys:
        swatch = "".join(tag("rect", width=20, height=14, fill=fill) for fill in fills)
        parts.append(tag("g", swatch + tag("text", escape(text), x=26, y=11, font_size=12),
                         transform=f"translate({x}, 8)"))
        x += 26 + 6.5 * len(text) + 20  # text at 12 px runs about 6.5 px a character
    return "".join(parts)


def belt_svg(panels):
    """panels: [(title, n_slots, completions, summary)], runs of the same requests -> an SVG
    document, a panel per run, one under the other on one step scale, so that runs compare by eye.
    completions: one per request in request order, each with .slot, .admit_step, .first_token_step,
    .finish_step and .tokens, or None (not finished: not drawn); summary: summarize()'s figures."""
    n_steps = max((c.finish_step + 1 for _, _, completions, _ in panels for c in completions if c), default=1)
    step_w = (SVG_WIDTH - LEFT - RIGHT) / n_steps  # px per step: the longest run spans the width
    parts, top = [tag("defs", HATCH), legend_svg()], 40
    for panel in panels:
        group, top = panel_svg(*panel, step_w, n_steps, top)
        parts.append(group)
    return tag("svg", "".join(parts), xmlns="http://www.w3.org/2000/svg", width=SVG_WIDTH, height=top,
               font_family="sans-serif", style="background: white")


# ---------------------------------------------------------------------------------------------
# The command line: --demo, --prompt, --bench


def long_tailed(rng, n, mean, cap):
    """n answer lengths shaped like chat traffic, many short and a long tail: the n quantiles of a
    capped exponential, in random order. Quantiles rather than random draws, so that the mix is the
    same for every seed and only the order is left to chance."""
    lengths = [min(cap, 1 + int(-mean * math.log(1 - (i + 0.5) / n))) for i in range(n)]
    rng.shuffle(lengths)
    return lengths


def load_model(args):
    """Real GPT-2 (--weights, else gpt2 from the cache or a download), or None when offline."""
    try:
        return GPT.from_pretrained(args.weights or "gpt2")
    except ConnectionError:
        if args.weights:
            raise
        return None


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
                "The three primary colors are", "My favourite recipe for pancakes",
                "In 1969, the first humans",
                "The quick brown fox", "Dear hiring manager,", "The best way to learn a language is",
                "Q: What is continuous batching?\nA:", "The weather today is", "Breaking news:"]


def demo(args):
    """A mixed workload through continuous, then static batching, the belt on screen."""
    model, tokenizer = (None, None) if args.quick else (load_model(args), load_tokenizer())
    if args.quick:
        print("nanobatch --quick: a tiny randomly initialised GPT-2 on random tokens")
    elif model is None:
        print(f"nanobatch: no GPT-2 weights here (offline, none in {default_cache_dir()}), so this is a "
              f"randomly initialised GPT-2 124M on random tokens: the loop runs exactly as with real "
              f"weights, but text would be noise. Real text: run once online, or --weights PATH.")
    if model is None:
        torch.manual_seed(args.seed)
        model = GPT(TINY if args.quick else GPTConfig())
    model = model.to(args.device, args.dtype).eval()
    n_requests, first_wave = 32, args.slots + args.slots // 2
    lengths = long_tailed(random.Random(args.seed), n_requests, mean=16, cap=64)  # whatever the weights
    rng = random.Random(args.seed + 1)
    if tokenizer and model.config.vocab_size == tokenizer.n_vocab:
        prompts = [tokenizer.encode(DEMO_PROMPTS[i % len(DEMO_PROMPTS)]) for i in range(n_requests)]
    else:
        tokenizer = None
        prompts = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(4, 40))]
                   for _ in range(n_requests)]
    # A first wave fills the belt and queues up; the rest arrive, one every other step, while it runs.
    requests = [Request(prompt, max_new, args.temperature, args.top_k, seed=args.seed + i,
                        arrival=0 if i < first_wave else 2 * (i - first_wave + 1))
                for i, (prompt, max_new) in enumerate(zip(prompts, lengths))]
    runs = [(policy, args.slots, policy) for policy in POLICIES]
    summaries, completions = run_all(model, requests, runs, args, EOT, show_belt=not args.quiet)
    print_table(summaries)
    if tokenizer:
        print_texts(tokenizer, requests, completions["continuous"])


def prompt_mode(args):
    """Your prompts, real GPT-2, the belt on screen."""
    tokenizer, model = load_tokenizer(), load_model(args)
    if tokenizer is None or model is None:
        raise ValueError("--prompt needs GPT-2's weights and tiktoken's files, which are neither cached "
                         "nor downloadable here: run once online, or pass --weights PATH")
    model = model.to(args.device, args.dtype).eval()
    requests = [Request(tokenizer.encode(text), args.max_new_tokens, args.temperature, args.top_k,
                        seed=args.seed + i) for i, text in enumerate(args.prompt)]
    summaries, completions = run_all(model, requests, [(args.policy, args.slots, args.policy)], args, EOT,
                                     show_belt=not args.quiet)
    print_texts(tokenizer, requests, completions[args.policy])
    print_table(summaries)


def bench(args):
    """One fixed, seeded workload through continuous, static and sequential (the engine with one slot)."""
    torch.manual_seed(args.seed)
    model = GPT.from_pretrained(args.weights) if args.weights else GPT(TINY if args.quick else GPTConfig())
    model = model.to(args.device, args.dtype).eval()
    rng = random.Random(args.seed)
    n_requests = args.requests or 16 * args.slots  # a steady stream: many more requests than slots
    lengths = long_tailed(rng, n_requests, mean=16, cap=128)
    requests = [Request([rng.randrange(model.config.vocab_size) for _ in range(rng.randint(4, 16))], n,
                        arrival=int(i / args.arrival_rate) if args.arrival_rate else 0)
                for i, n in enumerate(lengths)]
    print(f"bench: {n_requests} requests, prompts of 4-16 tokens, answers of {min(lengths)}-{max(lengths)} "
          f"(mean {sum(lengths) / n_requests:.1f}) tokens, GPT-2 {model.config.n_layer} layers "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M, {args.device}, {args.dtype}")
    runs = [("continuous", args.slots, "continuous"), ("static", args.slots, "static"),
            ("sequential", 1, "continuous")]
    # eos_id=None: every answer runs to its drawn length, so real weights see the same workload.
    summaries, _ = run_all(model, requests, runs, args, eos_id=None, show_belt=False)
    print_table(summaries)
    cont, stat, seq = summaries["continuous"], summaries["static"], summaries["sequential"]
    print(f"\nsteps static / continuous:        {stat['steps'] / cont['steps']:.2f}x")
    print(f"tokens/s continuous / static:     {cont['tokens/s'] / stat['tokens/s']:.2f}x")
    print(f"tokens/s continuous / sequential: {cont['tokens/s'] / seq['tokens/s']:.2f}x")
    # The ceiling: bare decode forwards of a full belt, at the mean position the sequences reach.
    position = round(sum(len(r.prompt) + n / 2 for r, n in zip(requests, lengths)) / n_requests)
    full_step_s = time_decode_step(model, args.slots, model.config.block_size, position)
    print(f"a perfectly full belt (bare decode of {args.slots} slots at position {position}): "
          f"{args.slots / full_step_s:.1f} tokens/s; continuous reached {cont['tokens/s']:.1f}")
    if model.config.block_size >= 1024:
        short, long = (time_decode_step(model, args.slots, max_len, position=100, repeats=10)
                       for max_len in (128, 1024))
        print(f"decode step at position 100: {1e3 * short:.1f} ms with max_len=128, "
              f"{1e3 * long:.1f} ms with max_len=1024 ({long / short:.2f}x)")
    config, max_len = model.config, args.max_len or model.config.block_size
    cache_bytes = config.n_layer * 2 * args.slots * max_len * config.n_embd * args.dtype.itemsize
    if args.device.type == "cuda":
        peak = f"{torch.cuda.max_memory_allocated() / 1e6:.0f} MB on the GPU"
    else:
        try:
            import resource  # Unix only
            peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB resident"
        except ImportError:
            peak = "not measured here"
    print(f"KV cache: {cache_bytes / 1e6:.1f} MB ({args.slots} slots x {max_len} positions), made once per "
          f"run; peak memory of the whole process: {peak}")


def time_decode_step(model, n_slots, max_len, position, repeats=5):
    """Seconds for one decode forward of n_slots rows, all at `position`, in a max_len cache."""
    device = model.lm_head.weight.device
    cache = model.new_cache(n_slots, max_len)
    idx = torch.zeros(n_slots, 1, dtype=torch.long, device=device)  # (S, 1)
    positions = torch.full((n_slots, 1), position, device=device)  # (S, 1)
    mask = attention_mask(positions, position + 1)  # (S, 1, position + 1)
    with torch.no_grad():
        model.forward_cached(idx, positions, cache, None, mask)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            model.forward_cached(idx, positions, cache, None, mask)
        synchronize(device)
    return (time.perf_counter() - start) / repeats


def main(argv=None):
    parser = argparse.ArgumentParser(description="Continuous batching for GPT-2, in one loop you can read.")
    what = parser.add_argument_group("what to run (one of)")
    what.add_argument("--demo", action="store_true", help="a mixed workload, continuous vs static")
    what.add_argument("--prompt", action="append", help="a text prompt; repeat for more requests")
    what.add_argument("--bench", action="store_true", help="continuous vs static vs sequential, timed")
    work = parser.add_argument_group("the requests and the belt")
    work.add_argument("--slots", type=int, default=8, help="slots on the belt: the batch size (8)")
    work.add_argument("--max-new-tokens", type=int, default=64, help="per --prompt request (64)")
    work.add_argument("--max-len", type=int, help="positions per slot (default: the model's 1024)")
    work.add_argument("--temperature", type=float, default=0.0, help="0: greedy (0)")
    work.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    work.add_argument("--seed", type=int, default=0, help="request i samples with seed + i (0)")
    work.add_argument("--policy", choices=POLICIES, default="continuous", help="for --prompt")
    work.add_argument("--requests", type=int, help="--bench: how many (default: 16 per slot)")
    work.add_argument("--arrival-rate", type=float, help="--bench: requests per step (default: all at once)")
    setup = parser.add_argument_group("model and output")
    setup.add_argument("--weights", help="checkpoint directory or file, or gpt2, gpt2-medium, ... to download")
    setup.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when present)")
    setup.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default="float32")
    setup.add_argument("--quick", action="store_true", help="--demo/--bench on a tiny model, in seconds")
    setup.add_argument("--quiet", action="store_true", help="no belt, only the summary")

    def fail(message):  # one line and exit status 2, for argparse's errors and ours alike
        print(f"nanobatch: error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = fail
    args = parser.parse_args(argv)
    if [args.demo, args.bench, bool(args.prompt)].count(True) != 1:
        fail("say what to run: one of --demo, --bench, --prompt TEXT")
    for flag, value in [("--slots", args.slots), ("--max-new-tokens", args.max_new_tokens),
                        ("--top-k", args.top_k), ("--requests", args.requests)]:
        if value is not None and value < 1:
            fail(f"{flag} must be >= 1, got {value}")
    if args.arrival_rate is not None and not args.arrival_rate > 0:
        fail(f"--arrival-rate must be > 0, got {args.arrival_rate}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        fail(f"--temperature must be finite and >= 0, got {args.temperature}")
    if args.max_len is not None and args.max_len < 2:
        fail(f"--max-len must be >= 2, got {args.max_len}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        args.device, args.dtype = torch.device(args.device), getattr(torch, args.dtype)
        if args.device.type == "cuda" and not torch.cuda.is_available():
            fail("--device cuda, but this torch sees no CUDA GPU")
        if args.demo:
            demo(args)
        elif args.bench:
            bench(args)
        else:
            prompt_mode(args)
    except (ValueError, OSError, RuntimeError) as e:  # bad input, missing or corrupt files, offline
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


if __name__ == "__main__":
    main()
