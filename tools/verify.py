"""
verify: the engine's greedy answers against the reference's, each judged identical, rounding or BUG.

    python tools/verify.py --dtype bfloat16      GPT-2 124M (random weights unless --weights)
    python tools/verify.py --quick               a tiny model, in seconds
    python tools/verify.py --url http://127.0.0.1:8000/      any OpenAI-compatible server: alone against under load

Exit status 0: every answer identical or apart by rounding; 1: a BUG; 2: bad input. With --url (below its
banner): 0 if no answer changed under load, 1 if any did, 2 on bad input or a server that cannot be asked.
"""
import argparse
import copy
import http.client
import json
import math
import os
import random
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanobatch.py and model.py
import nanobatch  # noqa: E402
from model import GPT  # noqa: E402
from nanobatch import (Request, check_arguments, fail, generate, generate_sequential, letter,  # noqa: E402
                       load_tokenizer, placement, sample, seeded_model)


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


# ---------------------------------------------------------------------------------------------
# Batch invariance, op by op: does a row's result depend on what else shares its call? (docs/api.md)

BATCH_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 31, 64, 100)  # rows in a call, as steps come
POSITIONS = (0, 1, 5, 16, 17, 63, 64, 100, 191, 200)  # a query's position, among its model's block_size


def varying_ops(model):
    """Each op of a step, as this model runs it (model.config.batch_invariant), measured on this machine: a row
    computed in calls of BATCH_SIZES rows (1: alone) against the same row in a call of the most, and attention's
    query also over more keys than its own (masked) and as one of a prompt's rows -> {op: where some row's bits
    differed, or "" if nowhere}. Inputs are random: an op's bits depend on the shapes it runs, not the values."""
    config, gen, device = model.config, torch.Generator().manual_seed(0), model.lm_head.weight.device
    block, C, n = model.transformer.h[0], config.n_embd, max(BATCH_SIZES)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=model.lm_head.weight.dtype).to(device)

    tokens = torch.randint(config.vocab_size, (n,), generator=gen).to(device)
    positions = torch.arange(n, device=device) % config.block_size
    rowwise = {  # op: (the op on rows x (N, ...), its inputs)
        "embeddings": (lambda i: model.embed(tokens[i], positions[i]), torch.arange(n, device=device)),
        "layer norm": (block.ln_1, randn(n, C)),
        f"linear {C} -> {3 * C}": (block.attn.c_attn, randn(n, C)),
        f"linear {4 * C} -> {C}": (block.mlp.c_proj, randn(n, 4 * C)),
        "GELU": (lambda x: F.gelu(x, approximate="tanh"), randn(n, 4 * C)),
        f"LM head {C} -> {config.vocab_size}": (model.lm_head, randn(n, C)),
        "softmax (sampling)": (lambda x: torch.softmax(x, dim=-1), randn(n, config.vocab_size)),
    }
    found = {}
    with torch.no_grad():
        for name, (op, x) in rowwise.items():
            in_the_most = op(x)  # every row in a call of n
            found[name] = ", ".join(str(size) for size in BATCH_SIZES
                                    if not torch.equal(op(x[:size]), in_the_most[:size]))
            found[name] = found[name] and f"in calls of {found[name]} rows"
        found["attention"] = attention_varies(block.attn.attention, config, randn)
    return found


def attention_varies(attend, config, randn):
    """Where a query's attention output differs from the same query alone over exactly its keys (-> "" if
    nowhere): over more keys, those past its position masked (the one-token call over the belt's longest row);
    in a batch of other slots' queries; as one of a causal call's rows (a prompt's chunk, and the reference)."""
    nh, hs, n_positions = config.n_head, config.n_embd // config.n_head, min(config.block_size, 256)
    q, k, v = (randn(1, nh, n_positions, hs) for _ in range(3))
    where = set()
    for p in [p for p in POSITIONS if p < n_positions]:
        alone = attend(q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1],
                       attn_mask=torch.ones(1, 1, 1, p + 1, dtype=torch.bool, device=q.device))
        for L in sorted({min(n_positions, L) for L in (p + 2, p + 17, 2 * p + 1, n_positions)} - {p + 1}):
            mask = (torch.arange(L, device=q.device) <= p)[None, None, None]  # (1, 1, 1, L)
            if not torch.equal(attend(q[:, :, p:p + 1], k[:, :, :L], v[:, :, :L], attn_mask=mask), alone):
                where.add("over more keys (masked)")
        for batch in (2, 3, 5, 8):  # the query in slot 0 of a batch of slots at other positions
            others = randn(batch - 1, nh, p + 1, hs)
            keys, values = torch.cat([k[:, :, :p + 1], others]), torch.cat([v[:, :, :p + 1], others])
            queries = torch.cat([q[:, :, p:p + 1], randn(batch - 1, nh, 1, hs)])
            mask = torch.ones(batch, 1, 1, p + 1, dtype=torch.bool, device=q.device)
            if not torch.equal(attend(queries, keys, values, attn_mask=mask)[:1], alone):
                where.add("in a batch")
        for T in sorted({p + 1, p + 4, n_positions}):
            if T <= n_positions and not torch.equal(
                    attend(q[:, :, :T], k[:, :, :T], v[:, :, :T], is_causal=True)[:, :, p:p + 1], alone):
                where.add("as a prompt's row")
    return "; ".join(sorted(where))


def print_varying_ops(model):
    """varying_ops for the default path and the batch-invariant one, side by side -> whether every op of the
    batch-invariant path gave each row the same bits in every call (the bitwise proof's premise)."""
    config = replace(model.config, batch_invariant=not model.config.batch_invariant)
    twin = GPT(config).to(model.lm_head.weight.device, model.lm_head.weight.dtype).eval()
    twin.load_state_dict(model.state_dict())
    paths = sorted([model, twin], key=lambda m: m.config.batch_invariant)  # default, then invariant
    found = [varying_ops(m) for m in paths]
    print(f"each op of a step: where a row's bits differ from the same row's in a call of {BATCH_SIZES[-1]} rows "
          f"({model.lm_head.weight.device}, {model.lm_head.weight.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread{'s' * (torch.get_num_threads() > 1)})")
    print(f"{'op':24}{'default path':62}batch-invariant path")
    for name in found[0]:
        print(f"{name:24}{found[0][name] or 'nowhere':62}{found[1][name] or 'nowhere'}")
    return not any(found[1].values())


def verify(args):
    """Seeded greedy requests through generate and through generate_sequential; each answer
    identical, or apart by rounding, or by a BUG. Exits with status 1 if any is a BUG, else 0."""
    model = seeded_model(args)
    tokenizer = None if args.quick else load_tokenizer(model)
    if args.ops:
        sys.exit(0 if print_varying_ops(model) else 1)
    if model.config.batch_invariant:  # the premise of bit-for-bit logits, on this machine: each op's rows alike
        varying = {op: where for op, where in varying_ops(model).items() if where}
        print("the batch-invariant ops on this machine: " + ("each gives a row the same bits in every call" if not
              varying else "; ".join(f"{op} differs {where}" for op, where in varying.items()) + ": logits may differ"))

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
                        args.prefill_chunk, args.disaggregate, args.kv_blocks, args.kv_block_size)
    except ValueError as e:
        fail(e)
    prompts_go = f"prompt chunks of {args.prefill_chunk}" if args.prefill_chunk else "whole prompts"
    if args.disaggregate:
        prompts_go += f" on a prefill worker: {placement(model.lm_head.weight.device)}"
    if args.kv_blocks:
        prompts_go += f", paged: {args.kv_blocks} blocks of {args.kv_block_size}"
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
    rows_kept = {}  # (i, k) -> the logits row of answer i's token k, for check_bits

    def on_step(report):
        for i, row in zip(report.sampled, report.logits):
            k, reference_tokens = n_rows_seen[i], reference[i].tokens
            n_rows_seen[i] += 1
            if k in (0, requests[i].max_new_tokens // 2, requests[i].max_new_tokens - 1):
                rows_kept[i, k] = row.clone()
            token = int(sample(row, requests[i], None))  # the engine's own rule: the token it took
            if i not in first_flip and k < len(reference_tokens) and token != reference_tokens[k]:
                first_flip[i] = (k, row.clone())  # a copy: the step's whole (R, V) logits need not stay

    start = time.perf_counter()
    batched = generate(model, requests, n_slots=args.slots, max_len=args.max_len, eos_id=None, policy=args.policy,
                       prefill_chunk=args.prefill_chunk, on_step=on_step, disaggregate=args.disaggregate,
                       kv_blocks=args.kv_blocks, kv_block_size=args.kv_block_size)
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
    n_unequal = check_bits(model, requests, batched, rows_kept)
    sys.exit(1 if counts["BUG"] or (n_unequal and model.config.batch_invariant) else 0)


def check_bits(model, requests, batched, rows_kept):
    """Each answer's first, middle and last token's logits row from the engine against the reference's forward
    over the same prefix, torch.equal -> how many differ (named, if batch-invariant: then none may)."""
    n_compared, unequal = 0, []
    with torch.no_grad():
        for (i, k), row in rows_kept.items():
            prefix = torch.tensor([requests[i].prompt + batched[i].tokens[:k]], device=row.device)  # (1, T)
            n_compared += 1
            if not torch.equal(model(prefix)[0, -1], row):
                unequal.append(f"{letter(i)} token {k}")
    path = "batch-invariant" if model.config.batch_invariant else "the default path: bits may differ, see --ops"
    named = f"; not {', '.join(unequal)}" if unequal and model.config.batch_invariant else ""
    print(f"bit for bit ({path}): {n_compared - len(unequal)} of {n_compared} logits rows (each answer's first, "
          f"middle and last token's) equal the reference's{named}")
    return len(unequal)


# ---------------------------------------------------------------------------------------------
# --url: the same question put to any OpenAI-compatible server, as its client (standard library only)
#
# A server's answers have no reference beside them, but they have each other: a greedy prompt asked alone
# and asked among many must come back the same. Each prompt goes alone (one at a time), then all at once,
# then --waves more times all at once in a shuffled order (so that each meets other neighbours, slots and
# batch sizes), and every answer under load is compared with its alone answer, token by token.

URL_N_PROMPTS, URL_PROMPT_LENS, URL_MAX_TOKENS, URL_WAVES = 64, (4, 48), 64, 2  # enough tokens to meet near-ties
TOP_LOGPROBS = 5  # logprobs asked for: the chosen token's and the top 5 at each token, as vLLM's completions give
NEAR_TIE_NATS = 1e-3  # how far a run under load may move the listed tokens against one another and still be
#                       rounding. Measured in process (docs/verify.md, "Asking a server"): float32 moved them by
#                       3.1e-6 at most (GPT-2 124M), a broken mask by 0.024 or more at its first flips;
#                       bfloat16's rounding moves them up to 0.047, so a bfloat16 server needs --near-tie 0.1
WORDS = ("the of and to in is was for on that with as by at from his her they this have which one you had not "
         "but all were when we there can an your their said each she time will about many then them these so "
         "some would make like him into has look two more write go see number no way could people my than "
         "first water been call who oil its now find long down day did get come made may part").split()


class ServerError(Exception):
    """What keeps the question from being put: the server unreachable, refusing, or without the API."""


def url_prompts(kind, n, seed, as_text=None):
    """n seeded greedy prompts, 4-48 tokens or words each: random token ids below GPT-2's 50,257 (any GPT-2
    server's, and valid in a larger vocabulary), or random English words (kind "text": for a server that
    takes text only). as_text: a format such as "t{}" that writes each id as a word, for a server that takes
    text only and whose tokenizer reads those words back as the same ids."""
    rng = random.Random(seed)
    lengths = [rng.randint(*URL_PROMPT_LENS) for _ in range(n)]
    if kind == "text":
        return [" ".join(rng.choice(WORDS) for _ in range(length)) for length in lengths]
    prompts = [[rng.randrange(50257) for _ in range(length)] for length in lengths]
    return prompts if as_text is None else [" ".join(as_text.format(token) for token in prompt) for prompt in prompts]


def send(server, body, method="POST", path="/v1/completions"):
    """A request sent, its answer not yet read -> the open connection."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=server.timeout_s)
    try:
        connection.request(method, server.path + path, None if body is None else json.dumps(body),
                           {"Content-Type": "application/json", **server.headers})
    except OSError as e:
        connection.close()
        raise ServerError(f"cannot reach {server.url}: {e.strerror or e}") from None
    return connection


def receive(connection):
    """The answer on a connection -> (HTTP status, its JSON, or its text if it is not JSON); the connection
    closed. A socket wait longer than the server's timeout raises ServerError."""
    try:
        response = connection.getresponse()
        data = response.read()
    except TimeoutError:
        raise ServerError(f"no answer within {connection.timeout:g} s (--timeout)") from None
    except (OSError, http.client.HTTPException) as e:
        raise ServerError(f"the connection failed: {e!r}") from None
    finally:
        connection.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode(errors="replace")


def said(reply):
    """An error reply's words: OpenAI's error.message, FastAPI's detail, or the text itself."""
    if isinstance(reply, dict):
        error = reply.get("error")
        return str(error.get("message", error) if isinstance(error, dict) else error or reply.get("detail") or reply)
    return reply.strip()[:300]


def refused(status, reply, what):
    """A clear ServerError for a reply that is not 200, saying which API or input the server lacks."""
    if status in (401, 403):
        return ServerError(f"{what}: HTTP {status}, {said(reply)}: give the server's key with --api-key KEY "
                           f"(or OPENAI_API_KEY)")
    if status in (404, 405):
        return ServerError(f"{what}: HTTP {status}, {said(reply)}: the server has no such route; it does not "
                           f"speak that part of OpenAI's API")
    return ServerError(f"{what}: HTTP {status}, {said(reply)}")


def served_model(server):
    """The model's name: the first that GET /v1/models lists (as vLLM's clients take it) -> (name, how many)."""
    status, reply = receive(send(server, None, "GET", "/v1/models"))
    if status != 200:
        raise refused(status, reply, "GET /v1/models (to learn the model's name; or give --model)")
    cards = reply.get("data") if isinstance(reply, dict) else None
    names = [card.get("id") for card in cards or [] if isinstance(card, dict) and card.get("id")]
    if not names:
        raise ServerError("GET /v1/models lists no model: give its name with --model")
    return names[0], len(names)


def fields_taken(server, body):
    """Of the fields that make answers comparable (vLLM's return_token_ids, and logprobs), those this server
    takes -> (the fields, a note for each it refused). A server that ignores one says nothing: its answers
    then simply lack it. One request of one token asks, and drops a field its refusal names."""
    fields, notes = {"return_token_ids": True, "logprobs": TOP_LOGPROBS}, []
    while True:
        status, reply = receive(send(server, {**body, "max_tokens": 1, **fields}))
        named = [name for name in fields if status in (400, 422) and name in said(reply)]
        if not named:
            break
        for name in named:
            notes.append(f"the server refuses {name} (HTTP {status}, {said(reply)})")
            del fields[name]
    if status in (400, 422) and isinstance(body["prompt"], list) and "prompt" in said(reply):
        raise ServerError(f"the server refuses a prompt of token ids (HTTP {status}, {said(reply)}): ask with "
                          f"--prompts text, or --as-text FORMAT")
    if status != 200:
        raise refused(status, reply, "POST /v1/completions")
    return fields, notes


class Answer:
    """One completion as the server gave it: its tokens (the ids of return_token_ids, else the names in its
    logprobs, else None: text only), its text, and its logprobs (vLLM's completions shape: tokens,
    token_logprobs, top_logprobs, text_offset; None if not given)."""

    def __init__(self, status, reply):
        if status != 200:
            raise refused(status, reply, "POST /v1/completions")
        try:
            choice = reply["choices"][0]
            self.text, self.logprobs = choice.get("text") or "", choice.get("logprobs")
            self.tokens = choice.get("token_ids")
            if self.tokens is None and self.logprobs:
                self.tokens = self.logprobs["tokens"]
        except (KeyError, IndexError, TypeError) as e:
            raise ServerError(f"an answer not in the completions API's shape ({e!r}): {str(reply)[:300]}") from None


def ask_alone(server, bodies):
    """Each request sent once the answer before it is in -> their Answers, in order."""
    return [Answer(*receive(send(server, body))) for body in bodies]


def ask_at_once(server, bodies, order):
    """Every request sent, in `order`, before any answer is read (so they arrive in that order and are all
    in flight together), each answer read by a thread of its own -> their Answers, in the bodies' order."""
    connections = {}
    try:
        for i in order:
            connections[i] = send(server, bodies[i])
    except ServerError:
        for connection in connections.values():
            connection.close()
        raise
    replies = {}

    def read(i):  # a thread's whole story: the reply, or the error that stopped it, kept for the caller
        try:
            replies[i] = receive(connections[i])
        except ServerError as e:
            replies[i] = e

    threads = [threading.Thread(target=read, args=(i,), name=f"verify {i}", daemon=True) for i in order]
    for thread in threads:
        thread.start()
    for thread in threads:  # each socket wait ends within the timeout, so each thread does too
        thread.join(server.timeout_s + 5)
    missing = [i for i in order if i not in replies]
    if missing:
        raise ServerError(f"{len(missing)} answers never came (--timeout {server.timeout_s:g} s)")
    failed = [reply for reply in replies.values() if isinstance(reply, ServerError)]
    if failed:
        raise failed[0]
    return [Answer(*replies[i]) for i in range(len(bodies))]


def first_difference(alone, loaded):
    """Where two answers first differ -> None if they do not: a token index, or a character index where the
    server gave text only. An answer that ends where the other goes on differs at its end."""
    a, b = (alone.tokens, loaded.tokens) if alone.tokens is not None and loaded.tokens is not None else \
        (alone.text, loaded.text)
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def judge(alone, loaded, k, near_tie_nats):
    """An answer that changed at token k, judged from the two runs' logprobs -> ('rounding', 'BUG' or
    'unjudged', the figures behind it).

    Both runs computed token k from the same prefix (the prompt and the k tokens before it), so the two
    distributions differ only by the server's arithmetic. For each token both runs list, its logprob under
    load minus alone is the same shift for all (the normaliser, logsumexp, moved) plus how far that token's
    logit moved; the spread of those differences (largest minus smallest) is how far the run under load
    moved the listed tokens against one another. 'rounding' if at most near_tie_nats: the two tokens were then
    a near-tie on both runs (the alone run put its token ahead by at most that, the loaded run its own), and
    the rest of the list barely moved. 'BUG' if further: the logits changed, not their last bits. The
    alone margin by itself is not enough: a broken mask flipped a token of the tiny random model that the
    alone run had put only 0.0008 ahead, while it moved the listed tokens 0.026 against one another. Lists
    that share fewer than two tokens moved further than any list shows: 'BUG'."""
    if alone.logprobs is None or loaded.logprobs is None:
        return "unjudged", "no logprobs"
    if k >= min(len(alone.logprobs["tokens"]), len(loaded.logprobs["tokens"])):
        return "unjudged", "one answer ended there without a token"

    def listed(logprobs):  # {token: logprob}: the top ones and the chosen one, at token k
        return {**(logprobs["top_logprobs"][k] or {}), logprobs["tokens"][k]: logprobs["token_logprobs"][k]}

    top_alone, top_loaded = listed(alone.logprobs), listed(loaded.logprobs)
    mine, theirs = alone.logprobs["tokens"][k], loaded.logprobs["tokens"][k]
    if mine == theirs:
        return "unjudged", f"the two tokens have one name in the logprobs, {mine!r}"
    moved = [top_loaded[token] - top_alone[token] for token in top_alone.keys() & top_loaded.keys()]
    spread = max(moved) - min(moved) if len(moved) > 1 else math.inf
    # each margin: a lower bound where the other run's token is not in the list (it lies below the list's last)
    margin_alone = top_alone[mine] - top_alone.get(theirs, min(top_alone.values()))
    margin_loaded = top_loaded[theirs] - top_loaded.get(mine, min(top_loaded.values()))
    both_listed = theirs in top_alone and mine in top_loaded
    figures = (f"margin alone {'' if theirs in top_alone else '>= '}{margin_alone:.2g}, under load "
               f"{'' if mine in top_loaded else '>= '}{margin_loaded:.2g}; " +
               (f"the {len(moved)} tokens both list moved {spread:.2g} against one another" if len(moved) > 1 else
                f"the two lists share {len(moved)} tokens"))
    if max(spread, margin_alone + margin_loaded) > near_tie_nats:
        return "BUG", figures
    return ("rounding" if both_listed else "unjudged"), figures


def verify_url(args):
    """Every prompt alone, then under load; each answer under load compared with its alone answer -> the exit
    status: 0 if none changed, 1 if any did."""
    parts = urlsplit(args.url)
    if parts.scheme != "http" or not parts.hostname:
        raise ServerError(f"{args.url}: give the server's address as http://HOST:PORT/ (http only)")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    server = argparse.Namespace(url=args.url, host=parts.hostname, port=parts.port or 80,
                                path=parts.path.rstrip("/"), timeout_s=args.timeout,
                                headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    model, n_models = (args.model, 1) if args.model else served_model(server)
    prompts = url_prompts(args.prompts, args.n, args.seed, args.as_text)
    bodies = [{"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
              for prompt in prompts]
    fields, notes = fields_taken(server, bodies[0])
    bodies = [{**body, **fields} for body in bodies]
    source = "random words" if args.prompts == "text" else "random token ids" + (
        f", sent as text: each written {args.as_text!r}" if args.as_text else "")
    print(f"verify --url {args.url}: {len(prompts)} greedy prompts ({source}, seed {args.seed}), {args.max_tokens} "
          f"tokens each, to `{model}`{f' (the first of {n_models} models)' if n_models > 1 else ''}: each alone, "
          f"then all at once, then in {args.waves} shuffled wave{'s' * (args.waves != 1)} at once", flush=True)
    for note in notes:
        print(f"note: {note}")
    # 1) Alone: the answers every other is compared with (fields_taken's one-token request warmed the server).
    print(f"verify: asking each of {len(prompts)} prompts alone", file=sys.stderr, flush=True)
    start = time.perf_counter()
    alone = ask_alone(server, bodies)
    print(f"alone: {len(alone)} answers, one at a time: {time.perf_counter() - start:.1f} s", flush=True)
    if alone[0].tokens is None:
        print("compared: text (the server gives no token ids): a change is placed at a character and a word, "
              "and one that prints the same text goes unseen")
    has_logprobs = alone[0].logprobs is not None
    print(f"rule: where an answer changed, its first differing token came from the same prefix on both runs: "
          f"'rounding' if the tokens both runs list among the top {TOP_LOGPROBS} moved at most {args.near_tie:g} "
          f"nats against one another (a near-tie on both), 'BUG' if further" if has_logprobs else
          "rule: none: the server gives no logprobs, so each change is 'unjudged'", flush=True)
    # 2) Under load: all at once in the prompts' order, then in shuffled orders.
    rng = random.Random(args.seed)
    runs = [("all at once", list(range(len(prompts))))]
    runs += [(f"wave {w + 1}", rng.sample(range(len(prompts)), len(prompts))) for w in range(args.waves)]
    changed, verdicts = set(), {"rounding": 0, "BUG": 0, "unjudged": 0}
    for name, order in runs:
        print(f"verify: {name}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        loaded = ask_at_once(server, bodies, order)
        differences = [(i, first_difference(alone[i], loaded[i])) for i in range(len(prompts))]
        differences = [(i, k) for i, k in differences if k is not None]
        print(f"{name}: {len(loaded)} answers at once: {time.perf_counter() - start:.1f} s, "
              f"{len(differences)} changed", flush=True)
        for i, k in differences:
            changed.add(i)
            print(f"  #{i:<3} {describe(alone[i], loaded[i], k, has_logprobs, args.near_tie, verdicts)}")
    print(f"{len(prompts)} prompts, {len(runs)} runs under load: {len(changed)} of {len(prompts)} answers changed"
          + (f" ({', '.join(f'{n} {verdict}' for verdict, n in verdicts.items())} changes)" if changed else ""))
    return 1 if changed else 0


def describe(alone, loaded, k, has_logprobs, near_tie_nats, verdicts):
    """A changed answer's line: where it first differs, the two tokens (or texts), and its verdict, counted."""
    if alone.tokens is not None and loaded.tokens is not None:
        where = f"first differs at token {k}: {shown(alone.tokens, k)} alone, {shown(loaded.tokens, k)} under load"
    else:
        where = (f"first differs at character {k} (word {len(alone.text[:k].split())}): "
                 f"{alone.text[k:k + 12]!r} alone, {loaded.text[k:k + 12]!r} under load")
    verdict, figures = judge(alone, loaded, k, near_tie_nats) if has_logprobs else ("unjudged", "")
    verdicts[verdict] += 1
    return f"{where}; {verdict}" + (f": {figures}" if figures else "")


def shown(tokens, k):
    return "the end" if k >= len(tokens) else str(tokens[k]) if isinstance(tokens[k], int) else repr(tokens[k])


def url_main(argv):
    parser = argparse.ArgumentParser(prog="tools/verify.py --url", description="does batching change which tokens "
                                     "a server computes? Greedy prompts alone, then all at once, compared token by "
                                     "token (exit status 1 if any answer changed)")
    parser.add_argument("--url", required=True, help="the server: http://HOST:PORT/ (its /v1/completions is asked)")
    parser.add_argument("--n", type=nanobatch.positive(int), default=URL_N_PROMPTS, metavar="N",
                        help=f"N prompts ({URL_N_PROMPTS})")
    parser.add_argument("--max-tokens", type=nanobatch.positive(int), default=URL_MAX_TOKENS, metavar="K",
                        help=f"tokens asked for each answer ({URL_MAX_TOKENS}; an answer stops early at EOS)")
    parser.add_argument("--prompts", choices=("ids", "text"), default="ids",
                        help="random token ids (the default), or random English words")
    parser.add_argument("--as-text", metavar="FORMAT", default=None,
                        help="send each token id as text, written with FORMAT (e.g. 't{}'), words joined by spaces: "
                             "for a server that takes text only, whose tokenizer reads them back as the ids")
    parser.add_argument("--waves", type=int, default=URL_WAVES, metavar="W",
                        help=f"after all at once, W more runs at once in shuffled orders ({URL_WAVES})")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' and the orders' seed (0)")
    parser.add_argument("--model", default=None, help="the model's name in the API (the first of GET /v1/models)")
    parser.add_argument("--api-key", metavar="KEY", default=None, help="sent as Authorization: Bearer KEY "
                        "(OPENAI_API_KEY)")
    parser.add_argument("--near-tie", type=float, default=NEAR_TIE_NATS, metavar="NATS",
                        help=f"the most a rounding may move the listed logprobs against one another "
                             f"({NEAR_TIE_NATS:g}: float32 and float64; bfloat16: 0.1)")
    parser.add_argument("--timeout", type=float, default=600, metavar="S", help="the longest wait for one answer (600)")
    args = parser.parse_args(argv)
    if args.waves < 0 or args.near_tie < 0 or args.timeout <= 0:
        parser.error("--waves and --near-tie must be at least 0, --timeout above 0")
    if args.as_text is not None and (args.prompts != "ids" or "{}" not in args.as_text):
        parser.error("--as-text writes token ids: it goes with --prompts ids, and its FORMAT holds {} (e.g. 't{}')")
    try:
        return verify_url(args)
    except ServerError as e:
        print(f"tools/verify.py: error: {e}", file=sys.stderr)
        return 2


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(arg == "--url" or arg.startswith("--url=") for arg in argv):  # a server's answers: the section above
        sys.exit(url_main(argv))
    parser = argparse.ArgumentParser(prog="tools/verify.py", description="batched against sequential answers, each "
                                     "judged: identical, rounding or BUG (exit status 1). A server's answers, alone "
                                     "against under load: --url URL (--url URL --help)")
    parser.add_argument("--ops", action="store_true", help="only each op of a step, measured on this machine: "
                        "where a row's bits depend on its batch, on the default path and the batch-invariant one")
    _, args = nanobatch.parse_args(parser, argv, nanobatch.SERVING | {"quick", "weights", "policy"})
    nanobatch.run_cli(verify, args)


if __name__ == "__main__":
    main()
