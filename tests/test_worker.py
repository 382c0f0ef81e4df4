"""
The prefill worker's thread, beyond its answers (test_nanobatch.py proves those the reference's):
the prompts go to the worker only, where the worker runs, its failure raised in the caller and never
hung, no thread outliving generate, and a worker with weights of its own waiting for them. A hang
fails its test, not the suite: each run goes through `ends_within` (tests/common.py).
"""
import threading
import time
import traceback
from collections import Counter
from contextlib import nullcontext

import pytest
import torch

import nanobatch
from model import GPT
from nanobatch import Request, generate, generate_sequential
from tests.common import (MAX_LEN, TIMEOUT_S, TINY, ends_within, first_difference, on_worker, random_workload,
                          worker_threads, worst)


def test_disaggregated_prompts_go_to_the_worker_only(gpt, monkeypatch):
    """Counted from the forwards the two threads really run: the loop's carry exactly the answers'
    tokens fed back (each answer's but its last, at its positions) and no prompt token; the worker's
    carry exactly the prompts, first come first served, at most prefill_chunk tokens a forward. The
    keys and values cross once per prompt, its tokens times the per-token size: n_layer x (keys and
    values) x n_embd x 8 bytes in float64. Each first token is reported with the worker's logits,
    the plain forward's over the prompt; each side ran on its share of the CPU's threads. (Six
    requests: on two cores the three threads' waits spin, and twelve took 2 s of CPU, six 0.5 s.)"""
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
    requests, reports = random_workload(seed=3, n_requests=6), []
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
    still queued for the worker), the worker is joined and the caller's thread setting is back. When
    the loop is to stop, the worker holds every prompt but its first until then, so that prompts do
    queue for it, and it is mid-prompt as the loop stops: a missing join would be seen. (Slowed by a
    sleep instead, it raced the loop: on a busy machine the loop took three steps as long as the
    worker took seven prompts, and the queue was gone; seen once in three full runs beside a busy core.)"""
    raised, with_worker_when_stopped = {"error": ValueError, "Ctrl-C": KeyboardInterrupt}.get(end), []
    forward_packed, n_prompts_started, stopped = GPT.forward_packed, [0], threading.Event()

    def held_worker(model, step, cache):
        if on_worker() and int(step.positions[0]) == 0:  # a prompt's first forward on the worker
            n_prompts_started[0] += 1
            if raised and n_prompts_started[0] > 1:
                assert stopped.wait(TIMEOUT_S), "the loop never stopped"
                time.sleep(0.2)  # still mid-prompt as generate ends: only a join waits for it
        return forward_packed(model, step, cache)

    def on_step(report):
        if raised and report.step == 2:
            with_worker_when_stopped.append(report.n_prefilling)
            stopped.set()  # the worker goes on: generate must stop it, and join it, on its way out
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

    monkeypatch.setattr(GPT, "forward_packed", held_worker)
    requests = [Request([1] * 20, 4) for _ in range(12)]  # all at once: 8 slots' prompts queue for the worker
    with pytest.raises(raised) if raised else nullcontext():
        ends_within(TIMEOUT_S, serve)
    assert worker_threads() == [], "the prefill worker outlived generate"
    if raised:  # the first prompt handed over and decoding; the worker on the second, 6 in its inbox
        assert with_worker_when_stopped == [7], with_worker_when_stopped

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
