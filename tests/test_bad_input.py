"""
Bad input is refused before any work, naming the field: every unservable request or argument of
generate, the forms a prompt may take and still serve the same, the caller's torch.autocast, and a
KV cache too large for the memory free.
"""
import math
import random
from dataclasses import replace

import pytest
import torch

import model as model_py
import nanobatch
from nanobatch import Request, generate, generate_sequential
from tests.common import GPT2_V, MAX_LEN, TINY, first_difference, random_prompt, worker_threads


# ---------------------------------------------------------------------------------------------
# Bad input is refused before any work, naming the field


GOOD = dict(prompt=[1, 2, 3], max_new_tokens=4)
BAD_INPUTS = [  # (what is wrong, fields of the second Request, generate's arguments, the name in the message)
    ("empty prompt", dict(prompt=[]), {}, r"requests\[1\]\.prompt"),
    ("empty tensor prompt", dict(prompt=torch.tensor([], dtype=torch.long)), {}, r"requests\[1\]\.prompt"),
    ("token id past the vocabulary", dict(prompt=[1, GPT2_V]), {}, r"requests\[1\]\.prompt"),
    ("token id past the vocabulary, in a tensor", dict(prompt=torch.tensor([1, GPT2_V])), {}, r"requests\[1\]\.prompt"),
    ("negative token id", dict(prompt=[-1, 2]), {}, r"requests\[1\]\.prompt"),
    ("prompt fills max_len", dict(prompt=[1] * 16), dict(max_len=16), r"requests\[1\]\.prompt"),
    # A prompt must be one flat row of int ids: not text, not a batch, not floats, not bools.
    ("text prompt", dict(prompt="The capital of France is"), {}, r"requests\[1\]\.prompt"),
    ("no prompt", dict(prompt=None), {}, r"requests\[1\]\.prompt"),
    ("nested list prompt", dict(prompt=[[1, 2], [3, 4]]), {}, r"requests\[1\]\.prompt"),
    ("2-D tensor prompt", dict(prompt=torch.tensor([[1, 2], [3, 4]])), {}, r"requests\[1\]\.prompt"),
    ("0-D tensor prompt", dict(prompt=torch.tensor(5)), {}, r"requests\[1\]\.prompt"),
    ("float token id", dict(prompt=[1, 5.0]), {}, r"requests\[1\]\.prompt"),
    ("float tensor prompt", dict(prompt=torch.tensor([1.0, 2.0])), {}, r"requests\[1\]\.prompt"),
    ("bool token id", dict(prompt=[True, 5]), {}, r"requests\[1\]\.prompt"),
    ("bool tensor prompt", dict(prompt=torch.tensor([True, False])), {}, r"requests\[1\]\.prompt"),
    ("set prompt", dict(prompt={1, 2}), {}, r"requests\[1\]\.prompt"),  # no order
    ("generator prompt", dict(prompt=(t for t in [1, 2])), {}, r"requests\[1\]\.prompt"),
    # The numbers of a request: bools are refused wherever an int is expected, though True == 1.
    ("no new tokens", dict(max_new_tokens=0), {}, r"requests\[1\]\.max_new_tokens"),
    ("max_new_tokens True", dict(max_new_tokens=True), {}, r"requests\[1\]\.max_new_tokens"),
    ("max_new_tokens 4.0", dict(max_new_tokens=4.0), {}, r"requests\[1\]\.max_new_tokens"),
    ("max_new_tokens as text", dict(max_new_tokens="4"), {}, r"requests\[1\]\.max_new_tokens"),
    ("negative temperature", dict(temperature=-0.5), {}, r"requests\[1\]\.temperature"),
    ("NaN temperature", dict(temperature=math.nan), {}, r"requests\[1\]\.temperature"),
    ("infinite temperature", dict(temperature=math.inf), {}, r"requests\[1\]\.temperature"),
    ("minus infinite temperature", dict(temperature=-math.inf), {}, r"requests\[1\]\.temperature"),
    ("temperature as text", dict(temperature="0.8"), {}, r"requests\[1\]\.temperature"),
    ("temperature True", dict(temperature=True), {}, r"requests\[1\]\.temperature"),
    ("no temperature", dict(temperature=None), {}, r"requests\[1\]\.temperature"),
    ("top_k of 0", dict(top_k=0), {}, r"requests\[1\]\.top_k"),
    ("top_k True", dict(top_k=True), {}, r"requests\[1\]\.top_k"),
    ("top_k 2.5", dict(top_k=2.5), {}, r"requests\[1\]\.top_k"),
    ("seed as text", dict(seed="abc"), {}, r"requests\[1\]\.seed"),
    ("seed 1.5", dict(seed=1.5), {}, r"requests\[1\]\.seed"),
    ("seed True", dict(seed=True), {}, r"requests\[1\]\.seed"),
    ("seed past 64 bits", dict(seed=2**64), {}, r"requests\[1\]\.seed"),
    ("negative arrival", dict(arrival=-1), {}, r"requests\[1\]\.arrival"),
    ("arrival True", dict(arrival=True), {}, r"requests\[1\]\.arrival"),
    ("arrival 1.0", dict(arrival=1.0), {}, r"requests\[1\]\.arrival"),
    ("no arrival", dict(arrival=None), {}, r"requests\[1\]\.arrival"),
    # generate's own arguments.
    ("no slots", {}, dict(n_slots=0), r"n_slots"),
    ("n_slots True", {}, dict(n_slots=True), r"n_slots"),
    ("n_slots 2.0", {}, dict(n_slots=2.0), r"n_slots"),
    ("n_slots None", {}, dict(n_slots=None), r"n_slots"),
    ("max_len past block_size", {}, dict(max_len=TINY["block_size"] + 1), r"max_len"),
    ("max_len 16.0", {}, dict(max_len=16.0), r"max_len"),
    ("max_len as text", {}, dict(max_len="16"), r"max_len"),
    ("eos_id past the vocabulary", {}, dict(eos_id=GPT2_V), r"eos_id"),
    ("negative eos_id", {}, dict(eos_id=-1), r"eos_id"),
    ("eos_id True", {}, dict(eos_id=True), r"eos_id"),
    ("eos_id as text", {}, dict(eos_id="50256"), r"eos_id"),
    ("unknown policy", {}, dict(policy="fifo"), r"policy"),
    ("policy in a list", {}, dict(policy=["continuous"]), r"policy"),
    ("no policy", {}, dict(policy=None), r"policy"),
    ("disaggregate with static", {}, dict(policy="static", disaggregate=True), r"disaggregate=True needs"),
    ("disaggregate 1", {}, dict(disaggregate=1), r"disaggregate must be True or False"),
    # Paged attention (Part 3): the pool's numbers, and the modes it does not serve.
    ("no blocks", {}, dict(kv_blocks=0), r"kv_blocks must be"),
    ("kv_blocks True", {}, dict(kv_blocks=True), r"kv_blocks must be"),
    ("kv_blocks 8.0", {}, dict(kv_blocks=8.0), r"kv_blocks must be"),
    ("blocks of no position", {}, dict(kv_blocks=8, kv_block_size=0), r"kv_block_size must be"),
    ("kv_block_size None", {}, dict(kv_blocks=8, kv_block_size=None), r"kv_block_size must be"),
    ("kv_block_size without a pool", {}, dict(kv_block_size=8), r"kv_block_size=8 applies to a paged cache only"),
    ("a prefix cache without a pool", {}, dict(prefix_cache=True), r"prefix_cache must be True or False, and True "
                                                                    r"needs kv_blocks, got True"),
    ("prefix_cache not a bool", {}, dict(kv_blocks=8, prefix_cache=1), r"prefix_cache must be True or False"),
    ("paged static", {}, dict(policy="static", kv_blocks=8), r"kv_blocks needs policy='continuous'"),
    ("paged disaggregated", {}, dict(disaggregate=True, kv_blocks=8), r"and disaggregate=False"),
    # 3 + 30 positions, in blocks of 16: 3 blocks, and the pool has 2. With fewer blocks than its own
    # sequence needs, a request could never finish, even alone on the belt.
    ("a pool smaller than a sequence", dict(max_new_tokens=30), dict(kv_blocks=2),
     r"kv_blocks=2 cannot hold requests\[1\]'s whole sequence \(its prompt and max_new_tokens, at most max_len\): "
     r"it needs 3 blocks of 16 positions"),
]


@pytest.mark.parametrize("fields, arguments, name", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_refused(gpt2_vocab, fields, arguments, name):
    """Every unservable input is a ValueError naming the field, raised before the first step: the
    good request in front of the bad one is never served. A wrong type too: never a TypeError, nor
    an error from deep inside torch."""
    requests = [Request(**GOOD), Request(**{**GOOD, **fields})]
    steps = []
    with pytest.raises(ValueError, match=name):
        generate(gpt2_vocab, requests, on_step=steps.append, **arguments)
    assert steps == [], "it failed halfway, after serving steps"
    if not {"n_slots", "policy", "disaggregate", "kv_blocks", "kv_block_size", "prefix_cache"} & arguments.keys():  # the reference
        # refuses the same requests
        with pytest.raises(ValueError, match=name):
            generate_sequential(gpt2_vocab, requests, **arguments)


@pytest.mark.parametrize("make_requests, name", [
    (lambda: Request(**GOOD), r"requests must be"),  # one request, not in a list
    (lambda: None, r"requests must be"),
    (lambda: [Request(**GOOD), "The capital of France is"], r"requests\[1\] must be a Request, got str"),
    (lambda: [Request(**GOOD), GOOD], r"requests\[1\] must be a Request, got dict"),
    (lambda: (r for r in [Request(**GOOD), None]), r"requests\[1\] must be a Request, got NoneType"),
], ids=["a lone Request", "None", "text among them", "a dict among them", "None from a generator"])
def test_requests_must_be_requests(gpt2_vocab, make_requests, name):
    """requests may be any iterable (a generator too), each of its items a Request."""
    for serve in (generate, generate_sequential):
        with pytest.raises(ValueError, match=name):
            serve(gpt2_vocab, make_requests())


def test_bad_numpy_input_is_refused(gpt2_vocab):
    """numpy arrays pass only as one row of integer ids, as tensors do; numpy's bool is no id either."""
    np = pytest.importorskip("numpy")
    for prompt in (np.array([1.0, 2.0]), np.array([[1, 2]]), np.array([True, False]), [np.bool_(True), 2],
                   np.array([1, GPT2_V])):
        with pytest.raises(ValueError, match=r"requests\[0\]\.prompt"):
            generate(gpt2_vocab, [Request(prompt, 4)])
    with pytest.raises(ValueError, match=r"requests\[0\]\.seed"):
        generate(gpt2_vocab, [Request([1, 2], 4, seed=np.float64(1.0))])


@pytest.mark.parametrize("prefill_chunk", [0, -3, True, 2.5, "4"])
def test_bad_prefill_chunk_is_refused(gpt2_vocab, prefill_chunk):
    """check_arguments already checks prefill_chunk, the most prompt tokens one step may take in:
    None or an int >= 1."""
    with pytest.raises(ValueError, match="prefill_chunk"):
        nanobatch.check_arguments(gpt2_vocab, [Request(**GOOD)], 2, MAX_LEN, None, "continuous",
                                  prefill_chunk=prefill_chunk)


def snapshot(requests):
    """Each request's fields, and its prompt's ids copied: to check later that nothing was changed."""
    return [(dict(vars(r)), [int(t) for t in r.prompt]) for r in requests]


def assert_unchanged(requests, snapshots):
    """Every field still holds the very object it held, and every prompt the same ids."""
    for i, (r, (fields, ids)) in enumerate(zip(requests, snapshots)):
        assert all(getattr(r, name) is value for name, value in fields.items()), f"requests[{i}] was changed"
        assert [int(t) for t in r.prompt] == ids, f"requests[{i}].prompt was changed"


def test_accepted_forms_serve_the_same(gpt):
    """A prompt may be a list, a tuple, a 1-D integer tensor or numpy array, or a list of numpy
    ints; a number may be a numpy number; requests may come from a generator. Each form serves
    exactly the tokens of plain lists and Python numbers, through the engine and the reference,
    and leaves the caller's requests as they were."""
    np = pytest.importorskip("numpy")
    rng = random.Random(12)
    plain = [Request(random_prompt(rng, 5), 4), Request(random_prompt(rng, 1), 3, 0.9, 20, seed=51, arrival=1),
             Request(random_prompt(rng, 9), 5, 1.3, seed=52)]  # greedy and sampled, so seeds matter
    forms = {
        "tuple": lambda r: replace(r, prompt=tuple(r.prompt)),
        "1-D tensor": lambda r: replace(r, prompt=torch.tensor(r.prompt)),
        "1-D int32 tensor": lambda r: replace(r, prompt=torch.tensor(r.prompt, dtype=torch.int32)),
        "numpy int64 array": lambda r: replace(r, prompt=np.array(r.prompt, dtype=np.int64)),
        "list of numpy ints": lambda r: replace(r, prompt=list(np.array(r.prompt))),
        "numpy numbers": lambda r: replace(  # np.float64 holds the very same float as Python's
            r, max_new_tokens=np.int64(r.max_new_tokens), temperature=np.float64(r.temperature),
            top_k=None if r.top_k is None else np.int32(r.top_k),
            seed=None if r.seed is None else np.int64(r.seed), arrival=np.int64(r.arrival)),
    }
    if torch.cuda.is_available():  # a prompt may live on another device than the model
        forms["1-D tensor on the GPU"] = lambda r: replace(r, prompt=torch.tensor(r.prompt, device="cuda"))
    for serve, settings in [(generate, dict(n_slots=2)), (generate_sequential, {})]:
        want = serve(gpt, plain, max_len=MAX_LEN, eos_id=None, **settings)
        got = serve(gpt, (r for r in plain), max_len=MAX_LEN, eos_id=None, **settings)
        assert first_difference(got, want) == "", f"{serve.__name__}, requests from a generator"
        for form, make in forms.items():
            requests = [make(r) for r in plain]
            before = snapshot(requests)
            got = serve(gpt, requests, max_len=MAX_LEN, eos_id=None, **settings)
            assert first_difference(got, want) == "", f"{serve.__name__}, {form}"
            assert_unchanged(requests, before)


def test_check_arguments_returns_plain_copies(gpt2_vocab):
    """What the engine receives: new Request objects whose prompt is a list of ints and whose numbers
    are ints and floats, equal in value to the caller's."""
    np = pytest.importorskip("numpy")
    requests = [Request(np.array([5, 6, 7]), np.int64(3), np.float32(0.5), np.int64(4), seed=np.int64(9),
                        arrival=np.int64(2)),
                Request(torch.tensor([8]), 2, 1)]
    before = snapshot(requests)
    checked = nanobatch.check_arguments(gpt2_vocab, iter(requests), 2, MAX_LEN, None, "continuous", prefill_chunk=4)
    assert_unchanged(requests, before)
    assert [type(r) for r in checked] == [Request, Request] and checked[0] is not requests[0]
    assert checked[0] == Request([5, 6, 7], 3, 0.5, 4, seed=9, arrival=2)
    assert checked[1] == Request([8], 2, 1.0)
    for r in checked:
        assert {type(t) for t in r.prompt} == {int} and type(r.prompt) is list
        assert type(r.max_new_tokens) is int and type(r.temperature) is float and type(r.arrival) is int
        assert r.seed is None or type(r.seed) is int
        assert r.top_k is None or type(r.top_k) is int


def test_a_long_bad_prompt_gives_a_short_message(gpt2_vocab):
    """A 2000-token prompt with one bad id is named by its field, the id and its place, in a line
    a person can read: a few tokens at most, never the whole prompt echoed back."""
    prompt = random_prompt(random.Random(13), 2000)
    bad_prompts = {
        "an id past the vocabulary": prompt[:1500] + [GPT2_V] + prompt[1500:],
        "the same, in a tensor": torch.tensor(prompt[:1500] + [GPT2_V] + prompt[1500:]),
        "a float": prompt[:1500] + [5.0] + prompt[1500:],
        "a batch of one": [prompt],
        "a 2-D tensor": torch.tensor([prompt]),
        "too long for max_len": prompt,
    }
    messages = {}
    for what, bad in bad_prompts.items():
        with pytest.raises(ValueError, match=r"requests\[0\]\.prompt") as error:
            generate(gpt2_vocab, [Request(bad, 4)])
        messages[what] = str(error.value)
    with pytest.raises(ValueError, match=r"requests\[0\]\.temperature") as error:
        generate(gpt2_vocab, [Request([1, 2], 4, temperature="0." + "8" * 2000)])
    messages["a 2000-character temperature"] = str(error.value)
    for what, message in messages.items():
        assert len(message) < 200, f"{what}: {len(message)} characters: {message[:300]}"
    assert f"token id {GPT2_V} (at index 1500)" in messages["an id past the vocabulary"]

# ---------------------------------------------------------------------------------------------
# The caller's autocast, and a cache that cannot fit


@pytest.mark.parametrize("disaggregate", [False, True])
def test_autocast_is_refused_up_front(gpt2_vocab, disaggregate):
    """Under torch.autocast the cache (in the model's dtype) and the keys (in autocast's) would
    disagree: generate refuses before any step, says what to do instead, and starts no worker."""
    steps = []
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=r"torch\.autocast.*"
                                                                     r"model\.to\(torch\.bfloat16\)"):
        generate(gpt2_vocab, [Request([1, 2, 3], 4)], max_len=MAX_LEN, on_step=steps.append, disaggregate=disaggregate)
    assert steps == [] and worker_threads() == []

def test_a_cache_that_cannot_fit_is_refused_before_it_is_made(gpt, monkeypatch):
    """With 10 MB free, 1000 slots of 32 positions (65,536 bytes each: 2 layers x keys and values x
    32 x 64 x 8 bytes) are refused, naming the size, what is free and what fits, and no cache is
    made: KVCache's constructor, patched to fail, is never reached. 152 slots fit, and serve."""
    real_available_memory, make_cache = model_py.available_memory, model_py.KVCache.__init__
    monkeypatch.setattr(model_py, "available_memory", lambda device: 10_000_000)

    def made(*args, **kwargs):
        raise AssertionError("a cache was made")

    monkeypatch.setattr(model_py.KVCache, "__init__", made)
    with pytest.raises(ValueError, match=r"a KV cache of 1000 slots x 32 positions takes 0.0655 GB, but cpu has "
                                         r"0.01 GB free: at most 152 slots fit at max_len=32"):
        generate(gpt, [Request([1, 2], 3)], n_slots=1000, max_len=MAX_LEN, eos_id=None)
    monkeypatch.setattr(model_py.KVCache, "__init__", make_cache)
    assert len(generate(gpt, [Request([1, 2], 3)], n_slots=152, max_len=MAX_LEN, eos_id=None)[0].tokens) == 3
    free = real_available_memory(torch.device("cpu"))
    assert free is None or free > 0  # what the machine really has: MemAvailable on Linux
    # Paged, the pool is the one allocation: 10,000 blocks of 16 positions (32,768 bytes each) cannot fit.
    monkeypatch.setattr(model_py.KVCache, "__init__", made)
    with pytest.raises(ValueError, match=r"a KV cache of 10000 blocks x 16 positions takes 0.328 GB, but cpu has "
                                         r"0.01 GB free: at most 305 blocks fit at kv_block_size=16"):
        generate(gpt, [Request([1, 2], 3)], n_slots=4, max_len=MAX_LEN, eos_id=None, kv_blocks=10_000)


def test_a_pool_that_fits_the_longest_sequence_exactly_serves_it(gpt):
    """The smallest pool the check lets through serves: a prompt of 5 and 27 new tokens fill max_len
    = 32, 2 blocks of 16; alone, the request runs to its end (context) in a pool of exactly 2."""
    request = Request(random_prompt(random.Random(0), 5), 27)
    with pytest.raises(ValueError, match="kv_blocks=1 cannot hold"):
        generate(gpt, [request], max_len=MAX_LEN, eos_id=None, kv_blocks=1)
    got = generate(gpt, [request, request], n_slots=2, max_len=MAX_LEN, eos_id=None, kv_blocks=2)
    assert first_difference(got, generate_sequential(gpt, [request, request], max_len=MAX_LEN, eos_id=None)) == ""
