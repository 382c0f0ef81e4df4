"""
Batch invariance under stress: random workloads through random engines (slots, prompt chunks, pools small
enough to preempt, prefix caches with shared prefixes, the prefill worker), batch-invariant in float32, and
every sampled row's logits torch.equal to the reference's over the same prefix (test_nanobatch.py, chapter 6,
proves each mode once; here the modes mix, as they do in a server).
"""
import random

import pytest
import torch

from nanobatch import Request, generate
from tests.common import MAX_LEN, TIMEOUT_S, ends_within, random_prompt
from test_nanobatch import invariant_gpt


def random_engine(rng):
    """generate's options, drawn: a paged pool (sometimes with a prefix cache) or slots, chunks or not."""
    options = dict(n_slots=rng.randint(2, 6), prefill_chunk=rng.choice([None, 1, 3, 8]))
    if rng.random() < 0.7:
        block_size = rng.choice([2, 4, 8])
        options.update(kv_block_size=block_size, kv_blocks=MAX_LEN // block_size + rng.randint(0, 4),
                       prefix_cache=rng.random() < 0.5)
    elif rng.random() < 0.3:
        options.update(disaggregate=True)
    return options


def random_requests(rng, n_requests):
    """Greedy and sampled requests, some after one of two shared prefixes (prefix hits), arriving over time."""
    shared = [random_prompt(rng, rng.randint(4, 12)) for _ in range(2)]
    requests = []
    for i in range(n_requests):
        prompt = (rng.choice(shared) if rng.random() < 0.5 else []) + random_prompt(rng, rng.randint(1, 10))
        requests.append(Request(prompt[:MAX_LEN - 1], rng.randint(1, 20), temperature=rng.choice([0.0, 0.0, 0.9]),
                                top_k=rng.choice([None, 5]), seed=i, arrival=rng.randint(0, 8)))
    return requests


@pytest.mark.parametrize("seed", range(8))  # among them: preemptions (seeds 0-2, 4, 7), prefix hits (0, 4, 7), the worker (3, 6)
def test_random_engines_give_the_references_bits(seed):
    rng = random.Random(seed)
    model, requests, options = invariant_gpt(), random_requests(rng, 10), random_engine(rng)
    rows = []
    completions = ends_within(TIMEOUT_S, generate, model, requests, max_len=MAX_LEN, eos_id=None,
                              on_step=lambda report: rows.extend(zip(report.sampled, report.logits.clone())),
                              **options)
    seen = [0] * len(requests)
    with torch.no_grad():
        for i, row in rows:
            prefix = torch.tensor([requests[i].prompt + completions[i].tokens[:seen[i]]])  # (1, T)
            assert torch.equal(row, model(prefix)[0, -1]), f"{options}: request {i}, token {seen[i]} differs"
            seen[i] += 1
    assert seen == [len(c.tokens) for c in completions]
