"""
GPT-2 from scratch, with a KV cache preallocated once: a block of max_len positions per slot, or, paged,
a pool of small blocks.

Shape legend, used in every comment below and in nanobatch.py:
    B  sequences in a batch             T  tokens per sequence (or in one prompt chunk)
    M  tokens packed into one step: its rows, one token each
    D  of them one-token rows: a request that feeds one token (a decode, or a one-token prompt), one a slot
    S  slots: requests a step holds     L  cache positions attended over
    C  embedding size (n_embd)          nh heads, hs head size (C = nh * hs)
    V  vocabulary size                  R  rows whose logits are wanted

`GPT.forward(idx)` is the textbook causal forward with no cache: the reference for everything else.
`GPT.forward_packed(step, cache)` runs one step of the engine: M new tokens from any mix of slots, packed side
by side, no padding between them. It writes their keys and values into the cache at (slot, position), through
a block table when the cache is paged, and attends under masks that nanobatch.py builds: the caller owns the
slots. Below the transformer: batch invariance (GPTConfig.batch_invariant), the attention cut (an optimisation
pack_step applies), then checkpoint loading.
"""
import json
import math
import os
import struct
import sys
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn import functional as F

# ---------------------------------------------------------------------------------------------
# The transformer


@dataclass
class GPTConfig:
    block_size: int = 1024  # positions GPT-2 was trained on: the position table has this many rows
    vocab_size: int = 50257  # 50,000 BPE merges + 256 byte tokens + <|endoftext|>
    n_layer: int = 12  # 12/24/36/48 for the 124M/350M/774M/1558M checkpoints
    n_head: int = 12  # every GPT-2 size has heads of 64 dimensions: n_head = n_embd / 64
    n_embd: int = 768  # 768/1024/1280/1600: the width that sets the four sizes apart
    batch_invariant: bool = False  # every row's logits the same bits whatever shares its step (below)


@dataclass
class PackedStep:
    """One engine step's tokens, packed: M tokens from any mix of slots, side by side, no padding between them
    (the only filler rows are those a static batch asks for on purpose). Rows [0, D) hold one token each, every
    one in a slot of its own, and attend together, in one call. The other rows come in chunks, each attending
    over its own slot: consecutive tokens of one prompt (or, past the step's attention_cut, one token of a long
    slot). Positions are a slot's own, 0 up; block_tables say where their keys live (None: slot s is block s)."""
    tokens: torch.Tensor  # (M,) token ids
    positions: torch.Tensor  # (M,) each token's position in its slot
    slots: torch.Tensor  # (M,) each token's slot
    n_one_token: int  # D: rows [0, D) are one-token rows
    one_token_mask: torch.Tensor  # (S, 1, L) bool: slot s's one-token query may see position l; L, the cut
    chunks: list  # (rows, slot, mask): a slice of rows, their slot, (T, L) bool mask over that slot
    logit_rows: torch.Tensor  # (R,) rows whose next-token logits are wanted
    block_tables: torch.Tensor | None = None  # (S, n_table), paged: slot s's position p in block [s, p // block_size]


class Linear(nn.Module):
    """y = x W^T + b, W (out, in) as nn.Linear keeps it, computed as (W x^T)^T: MKL streams W over a decode step's few
    rows with its kernel for a few columns (docs/benchmarks.md). Zeros, dropped after, make at least min_rows rows (2:
    MKL's one-row kernel is slower; batch-invariant, MIN_ROWS_INVARIANT: its general kernel for every call) and, above
    8, whole groups of 8 (it takes a remainder of columns slowly), unless one thread runs x W^T faster there."""

    def __init__(self, n_in, n_out, bias=True, batch_invariant=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None
        self.batch_invariant, self.min_rows = batch_invariant, MIN_ROWS_INVARIANT if batch_invariant else 2

    def forward(self, x):
        rows = x.reshape(-1, x.size(-1))  # (N, in): every row, whatever the batch's shape
        if len(rows) > 8 and torch.get_num_threads() == 1 and not self.batch_invariant:
            return F.linear(x, self.weight, self.bias)  # (..., out): one thread, above 8 rows
        n = max(self.min_rows, len(rows) if len(rows) <= 8 else -(-len(rows) // 8) * 8)  # rows computed: zeros added
        padded = rows if n == len(rows) else F.pad(rows, (0, 0, 0, n - len(rows)))  # (n, in)
        y = self.weight @ padded.t() if self.bias is None else torch.addmm(self.bias[:, None], self.weight, padded.t())
        return y.t()[:len(rows)].contiguous().view(*x.shape[:-1], y.size(0))  # (..., out), row by row again


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, batch_invariant=config.batch_invariant)  # q, k, v
        self.c_proj = Linear(config.n_embd, config.n_embd, batch_invariant=config.batch_invariant)
        # torch's fused kernel, or, batch-invariant, the same sums in blocks of keys of a fixed size (below)
        self.attention = attention_in_key_blocks if config.batch_invariant else F.scaled_dot_product_attention

    def forward(self, x, kv_cache=None, step=None):
        return self.c_proj(self.attend_causal(x) if kv_cache is None else self.attend_packed(x, kv_cache, step))

    def attend_causal(self, x):
        """The reference: x (B, T, C), each row a whole sequence, so plain causal attention."""
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # each (B, nh, T, hs)
                   for t in self.c_attn(x).split(C, dim=2))
        y = self.attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return y.transpose(1, 2).reshape(B, T, C)  # heads side by side again

    def attend_packed(self, x, kv_cache, step):
        """x (M, C): one step's packed tokens. Each token attends over its own slot in the cache."""
        M, C = x.size()
        q, k, v = (t.view(M, self.n_head, C // self.n_head) for t in self.c_attn(x).split(C, dim=1))
        # q, k, v: each (M, nh, hs). Each cache (n_blocks, nh, block_size, hs), per slot (S, nh, max_len, hs),
        # with a buffer that a paged read gathers it into (slot_positions).
        (k_cache, k_gathered), (v_cache, v_gathered) = kv_cache
        # Store the new keys and values first, so that a token can attend to itself: one write of M cells, each at
        # its own (slot, position), or, paged, at the block and offset its slot's block table gives the position.
        if step.block_tables is None:
            blocks, offsets = step.slots, step.positions
        else:
            block_size = k_cache.size(2)
            blocks, offsets = step.block_tables[step.slots, step.positions // block_size], step.positions % block_size
        k_cache[blocks, :, offsets] = k
        v_cache[blocks, :, offsets] = v
        y = torch.empty_like(q)  # (M, nh, hs)
        # One-token rows, in one call (paged, in groups), each query over its slot's first L positions, L the step's
        # cut. Per slot the call reads the whole belt, a view (a copy of just the D slots measured slower): query s is
        # slot s's, a slot with no row a dummy's. Paged, every read is a copy: only the D slots, in row order.
        D = step.n_one_token
        if D:
            L = self.n_keys(step.one_token_mask.size(-1), k_cache, step.block_tables)
            one_token_slots = step.slots[:D]  # (D,)
            if step.block_tables is None:  # the slots the call reads, and each row's place among them
                read_slots, places = slice(None), one_token_slots
                groups = [(slice(None), read_slots)]  # one group: every slot, one view
            else:
                read_slots, places = one_token_slots, slice(None)
                size = paged_group_size(D, L, k_cache, q.device)  # its copies read back while cached
                groups = [(slice(first, first + size), read_slots[first:first + size]) for first in range(0, D, size)]
            one_token_mask = step.one_token_mask[read_slots]  # (S, 1, L)
            queries = q.new_zeros(one_token_mask.size(0), self.n_head, 1, C // self.n_head)  # (S, nh, 1, hs)
            queries[places] = q[:D, :, None]
            out = torch.empty_like(queries)  # (S, nh, 1, hs)
            for part, slots in groups:  # part: the group's queries; slots: the slots that it reads
                keys = slot_positions(k_cache, k_gathered, step.block_tables, slots, L)  # (n, nh, L, hs)
                values = slot_positions(v_cache, v_gathered, step.block_tables, slots, L)
                out[part] = self.attention(
                    queries[part], keys, values,
                    attn_mask=one_token_mask[part, None],  # (n, 1, 1, L): the same mask for every head
                )  # (n, nh, 1, hs)
            y[:D] = out[places, :, 0]
        # Chunks, one call each: T queries over the first L positions of their own slot (per slot, a
        # view): a prompt chunk, or the one token of a slot past the cut. No call pads to another's length.
        for rows, slot, mask in step.chunks:
            L = self.n_keys(mask.size(-1), k_cache, step.block_tables)
            keys = slot_positions(k_cache, k_gathered, step.block_tables, slice(slot, slot + 1), L)  # (1, nh, L, hs)
            values = slot_positions(v_cache, v_gathered, step.block_tables, slice(slot, slot + 1), L)
            out = self.attention(
                q[rows].transpose(0, 1)[None],  # (1, nh, T, hs)
                keys, values,  # (1, nh, L, hs)
                attn_mask=mask[None, None],  # (1, 1, T, L)
            )  # (1, nh, T, hs)
            y[rows] = out[0].transpose(0, 1)
        return y.view(M, C)

    def n_keys(self, L, cache, block_tables):  # positions read for a mask over L: batch-invariant, whole key blocks
        if self.attention is not attention_in_key_blocks:  # (as far as the cache or the tables hold, so no copy)
            return L
        held = cache.size(2) * (1 if block_tables is None else block_tables.size(1))
        return min(-(-L // KEY_BLOCK) * KEY_BLOCK, max(L, held))


def slot_positions(cache, gathered, block_tables, slots, L):
    """The first L positions of some slots, in position order: (n, nh, L, hs) from one layer's keys (or values),
    cache (n_blocks, nh, block_size, hs). Per slot (block_tables None), block s is slot s: a view, no copy.
    Paged (Part 3), each slot's blocks are gathered in table order into a copy, `gathered`, since torch's
    attention wants a sequence's keys side by side; a paged kernel (vLLM's) reads them where they lie."""
    if block_tables is None:
        return cache[slots, :, :L]
    n_blocks_read, nh, block_size, hs = -(-L // cache.size(2)), *cache.shape[1:]  # the blocks of positions 0..L-1
    table = block_tables[slots, :n_blocks_read]  # (n, n_blocks_read)
    # Each head of each block is a row of block_size keys in cache.view(-1, block_size, hs): gathered by head,
    # then block, each head's keys lie side by side, as attention reads them.
    rows = table[:, None, :] * nh + torch.arange(nh, device=table.device)[None, :, None]  # (n, nh, n_blocks_read)
    # The KVCache keeps `gathered` from step to step: a fresh copy (19 MB of keys at 64 rows of 96 positions)
    # went back to the system when freed, faulted in again in every layer. resize_(0) keeps its memory.
    torch.index_select(cache.view(-1, block_size, hs), 0, rows.flatten(), out=gathered.resize_(0))
    return gathered.view(table.size(0), nh, -1, hs)[:, :, :L]  # (n, nh, L, hs)


# A paged one-token call reads its slots in groups of about this many bytes of copied keys and values, read back
# from the CPU's caches, not from memory (docs/benchmarks.md). On a GPU, one group: a launch costs more (a guess).
PAGED_GROUP_BYTES = {"cpu": 8_000_000, "gpu": math.inf}


def paged_group_size(n_slots, L, cache, device):
    """Slots in each of as few equal groups as keep each group's copies within about PAGED_GROUP_BYTES."""
    slot_bytes = 2 * -(-L // cache.size(2)) * cache[0].numel() * cache.element_size()  # its blocks, k and v
    n_groups = max(1, math.ceil(n_slots * slot_bytes / PAGED_GROUP_BYTES["cpu" if device.type == "cpu" else "gpu"]))
    return math.ceil(n_slots / n_groups)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, batch_invariant=config.batch_invariant)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, batch_invariant=config.batch_invariant)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2 used the tanh GELU


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, step=None):
        x = x + self.attn(self.ln_1(x), kv_cache, step)  # pre-LayerNorm, residual around each half
        return x + self.mlp(self.ln_2(x))


class KVCache:
    """Keys and values for every layer, in one tensor made once: n_blocks blocks of block_size positions.
    Per slot, a block is a slot: S blocks of max_len positions, slot s's sequence in block s. Paged
    (nanobatch Part 3), many small blocks, and a sequence's positions fill the blocks of its block table.
    Heads come first in a block, as in vLLM's: a head's keys lie side by side, a view a matrix product takes."""

    def __init__(self, config, n_blocks, block_size, device, dtype):
        # (n_layer, k|v, n_blocks, nh, block_size, hs); per slot, n_blocks is S and block_size max_len
        shape = (config.n_layer, 2, n_blocks, config.n_head, block_size, config.n_embd // config.n_head)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)  # zeros: see clear() for why
        # Paged reads' copies, of keys and of values, shared by every layer: see slot_positions.
        self.gathered = (torch.empty(0, device=device, dtype=dtype), torch.empty(0, device=device, dtype=dtype))

    def layer(self, i):  # (keys, their buffer), (values, theirs): views, each (n_blocks, nh, block_size, hs)
        return (self.kv[i, 0], self.gathered[0]), (self.kv[i, 1], self.gathered[1])

    def clear(self, blocks, n_positions):
        """Zero the first n_positions of a sequence held in these blocks, in order: what its request wrote, as it
        leaves (per slot, blocks is [its slot]). The mask hides a previous occupant's keys, but only by giving them
        weight 0, and 0 * NaN is NaN: one that overflowed would poison the next. Zeroing only what was written, not
        the slot's whole max_len, keeps the cost proportional to the work done."""
        for first_position, block in zip(range(0, n_positions, self.block_size), blocks):
            self.kv[:, :, block, :, :n_positions - first_position].zero_()

    def send(self, slot, n_positions, to, to_slot):
        """Copy the first n_positions of one slot, every layer's keys and values, into a slot of
        another cache, on this device or another, in one copy; returns the bytes moved. This is the
        handover of disaggregated prefill, which a real deployment sends over NVLink or RDMA."""
        to.kv[:, :, to_slot, :, :n_positions].copy_(self.kv[:, :, slot, :, :n_positions])
        return self.kv[:, :, slot, :, :n_positions].numel() * self.kv.element_size()

    @property
    def block_size(self):  # positions a block holds (per slot: max_len)
        return self.kv.size(4)

    @property
    def n_positions(self):  # what the cache can hold, all blocks together
        return self.kv.size(2) * self.block_size


def available_memory(device):
    """Bytes that a new tensor on `device` can take now, or None where that cannot be told."""
    if device.type == "cuda":  # free on the GPU, and what torch holds for reuse: an earlier cache, say
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    try:  # Linux: what can be had without swapping, the reclaimable page cache included
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_cache_fits(config, n_slots, max_len, device, dtype, unit="slots"):
    """A ValueError, before any allocation, if a KVCache would not fit in the memory free now: it
    is the engine's one large tensor, and its size is known (as vLLM sizes its own). Paged, unit is
    "blocks": n_slots blocks of max_len (kv_block_size) positions."""
    per_slot = config.n_layer * 2 * max_len * config.n_embd * dtype.itemsize  # keys and values, every layer
    free = available_memory(device)
    if free is not None and n_slots * per_slot > free:
        raise ValueError(f"a KV cache of {n_slots} {unit} x {max_len} positions takes {n_slots * per_slot / 1e9:.3g} "
                         f"GB, but {device} has {free / 1e9:.3g} GB free: at most {free // per_slot} {unit} fit at "
                         f"{'max_len' if unit == 'slots' else 'kv_block_size'}={max_len}")


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        # Names follow Hugging Face's GPT-2, so a checkpoint loads by name.
        self.transformer = nn.ModuleDict(dict(
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        # GPT-2 ties its token embeddings to the LM head: token t's embedding is row t of the head's weight (V, C).
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False, batch_invariant=config.batch_invariant)
        for name, p in self.named_parameters():  # std 0.02 as GPT-2 (not its scaled residuals)
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)  # linear and embedding weights
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def new_cache(self, n_blocks, block_size):  # on this model's device, in its dtype; per slot: (S, max_len)
        p = self.lm_head.weight
        return KVCache(self.config, n_blocks, block_size, p.device, p.dtype)

    def embed(self, tokens, positions):  # each token's embedding and its position's, summed: (..., C)
        return F.embedding(tokens, self.lm_head.weight) + self.transformer.wpe(positions)

    def forward(self, idx):
        """The reference: idx (B, T) token ids -> logits (B, T, V), causal, no cache."""
        x = self.embed(idx, torch.arange(idx.size(1), device=idx.device))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, V)

    def forward_packed(self, step, cache):
        """One engine step: step.tokens (M,) through the model, reading and writing the cache -> logits (R, V) for
        step.logit_rows only. Every linear layer sees exactly the M tokens fed, no empty slots; the LM head, 39M
        multiply-adds a token in GPT-2 124M (half what its 12 blocks cost), only the rows that will sample."""
        x = self.embed(step.tokens, step.positions)  # (M, C)
        for i, block in enumerate(self.transformer.h):
            x = block(x, kv_cache=cache.layer(i), step=step)
        return self.lm_head(self.transformer.ln_f(x[step.logit_rows]))  # (R, V)

    @classmethod
    def from_pretrained(cls, source, cache_dir=None, batch_invariant=False):
        """GPT-2 from a Hugging Face checkpoint: a directory, a .safetensors or .bin file, or a
        name in HF_MODELS (downloaded once into cache_dir, default ~/.cache/nanobatch)."""
        path = find_checkpoint(source, cache_dir or default_cache_dir())
        tensors = read_safetensors(path) if path.suffix == ".safetensors" else read_bin(path)
        model = cls(replace(config_from_tensors(tensors, path), batch_invariant=batch_invariant))
        load_hf_tensors(model, tensors, path)
        return model


# ---------------------------------------------------------------------------------------------
# Batch invariance: each row's numbers the same whatever shares its step (GPTConfig.batch_invariant)
#
# Batching should change when a token is computed, never which. In float32 it changes the last bits of the logits
# where a kernel sums a row's products in an order that depends on what shares its call (Thinking Machines, 2025),
# and at a near-tie another token wins. Measured op by op (tools/verify.py --ops, docs/api.md), two ops do so here:
# a matrix product, which MKL computes for 8 rows or fewer with a kernel other than its general one (which the
# reference's long prompts take), so a batch-invariant Linear computes at least MIN_ROWS_INVARIANT rows; and torch's
# fused attention, which sums up to 512 keys in one product that MKL splits at length-dependent points, so
# attention_in_key_blocks sums KEY_BLOCK keys at a time, in order. The reference runs the same ops (GPT.forward).

MIN_ROWS_INVARIANT = 16  # rows a batch-invariant Linear computes at least: from 12, MKL's general kernel for (W x^T)
ROW_MULTIPLE = 4  # rows attention's batched products take at a time, as MKL computes them alike
KEY_BLOCK = 64  # keys summed in one matrix product: one length for every call, far below where MKL splits a sum


def attention_in_key_blocks(query, key, value, attn_mask=None, is_causal=False):
    """F.scaled_dot_product_attention, batch-invariant: query (B, nh, T, hs), key and value (B, nh, L, hs),
    attn_mask (B or 1, 1, T or 1, L' <= L) bool, True where a query sees a key (past L': unseen) -> (B, nh, T, hs)."""
    T, L = query.size(-2), key.size(-2)
    query = F.pad(query, (0, 0, 0, -T % ROW_MULTIPLE))  # (B, nh, T', hs): rows of zeros to a multiple of ROW_MULTIPLE
    n_pad_keys = -L % KEY_BLOCK  # keys of no one's, unseen, to whole blocks (none where the caller read whole blocks)
    if n_pad_keys:
        key, value = (F.pad(t, (0, 0, 0, n_pad_keys)) for t in (key, value))  # (B, nh, L', hs)
    if is_causal:
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
    elif attn_mask.size(-2) > 1:  # the padded queries see every key: no row without a key, so no NaN
        attn_mask = F.pad(attn_mask, (0, 0, 0, query.size(-2) - T), value=True)
    attn_mask = F.pad(attn_mask, (0, key.size(-2) - attn_mask.size(-1)), value=False)  # (.., T' or 1, L')
    scores = (query @ key.transpose(-1, -2)) * query.size(-1) ** -0.5  # (B, nh, T', L'): one length, hs
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(value.dtype)
    out = probs[..., :KEY_BLOCK] @ value[..., :KEY_BLOCK, :]  # (B, nh, T', hs): the first block's sum
    for first in range(KEY_BLOCK, key.size(-2), KEY_BLOCK):  # then each block's, added in order
        out += probs[..., first:first + KEY_BLOCK] @ value[..., first:first + KEY_BLOCK, :]
    return out[..., :T, :]


# ---------------------------------------------------------------------------------------------
# The attention cut: attention that follows the work (same results, less of it)
#
# The one-token rows attend in one call over every slot's first L positions. With L the longest row's length,
# one long request among short ones makes every slot pay its length: 64 chat turns of 48 tokens beside one
# 940-token document read 64 x 940 keys a layer, where the slots hold 63 x 48 + 940. A row attending alone
# reads only its own keys, but pays for a call of its own. nanobatch's pack_step cuts between the two.
# A call's cost, in keys it could read instead (a key: one position's keys and values, every head): measured
# on a 2-core CPU, GPT-2 124M in float32, about 150; on a GPU a guess: 30 us of launches, 20,000 keys of 6 KB.
CALL_COST_IN_KEYS = {"cpu": 150, "gpu": 20_000}


def attention_cut(lengths, n_slots, device):
    """The cut that costs least for one-token rows of these lengths (position + 1): rows no longer
    than it attend together over n_slots x cut keys; each longer one alone, its keys and a call."""
    call_cost = CALL_COST_IN_KEYS["cpu" if device.type == "cpu" else "gpu"]
    lengths, best = sorted(lengths), (math.inf, 1)  # (cost, cut); no row at all: a cut of 1
    keys_above = sum(lengths)  # of the rows after i, taken as longer than the cut
    every_row_alone = keys_above + len(lengths) * call_cost  # a cut of 0, no call together (its scatter costs a call)
    for i, cut in enumerate(lengths):  # of equal lengths, only the last is costed right; it is the cheaper
        keys_above -= cut
        best = min(best, (n_slots * cut + keys_above + (len(lengths) - 1 - i) * call_cost, cut))
    # A few long rows on a belt of empty slots: each alone reads its own keys, not every slot's, and costs less.
    return 0 if lengths and every_row_alone < best[0] else best[1]


def split_at_cut(feeds, n_slots, device):
    """A step's feeds, each (run, slot, first position, token ids) as nanobatch.pack_step lays them out ->
    (one_token, chunks, cut): the one-token feeds no longer than the cut, which attend together over every
    slot's first `cut` positions, and the rest, alone over their own slot: a prompt's chunk, or the one token
    of a slot past the cut (a cut of 0: every one). At the longest one's length, every one attends together."""
    cut = attention_cut([position + 1 for _, _, position, ids in feeds if len(ids) == 1], n_slots, device)
    attends_together = [len(ids) == 1 and position < cut for _, _, position, ids in feeds]
    one_token = [feed for feed, together in zip(feeds, attends_together) if together]
    chunks = [feed for feed, together in zip(feeds, attends_together) if not together]
    return one_token, chunks, cut


# ---------------------------------------------------------------------------------------------
# Loading real GPT-2 checkpoints (Hugging Face layout)

HF_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # the four released sizes
HF_URL = "https://huggingface.co/openai-community/{name}/resolve/main/model.safetensors"
# GPT-2 was written with Conv1D layers, which store weights as (in, out); Linear keeps nn.Linear's (out, in).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32,
                      "F16": torch.float16, "BF16": torch.bfloat16}
MAX_HEADER_BYTES = 100_000_000  # a real header is kilobytes; a corrupt length must not eat memory


def default_cache_dir():
    return Path(os.environ.get("NANOBATCH_CACHE", Path.home() / ".cache" / "nanobatch"))


def find_checkpoint(source, cache_dir):
    """The weights file that `source` names: a known model name, a directory, or a file."""
    if source in HF_MODELS:
        return download_checkpoint(source, cache_dir)
    path = Path(source)
    if path.is_dir():
        weights = (path / "model.safetensors", path / "pytorch_model.bin")
        path = next((p for p in weights if p.is_file()), None)
        if path is None:
            raise FileNotFoundError(f"{source}: holds neither model.safetensors nor pytorch_model.bin")
    elif not path.is_file():
        raise FileNotFoundError(f"{source}: no such file or directory, nor one of {list(HF_MODELS)}")
    return path


def download_checkpoint(name, cache_dir, timeout=10):
    """Download once into cache_dir/name/; the file appears there only when it is complete."""
    target = Path(cache_dir) / name / "model.safetensors"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial, url = target.with_suffix(".partial"), HF_URL.format(name=name)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as out:
            total, done = int(response.headers.get("Content-Length") or 0), 0
            while chunk := response.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                percent = f"{100 * done / total:.0f}%" if total else ""
                print(f"\rdownloading {name}: {done / 1e6:.0f} MB {percent}", end="", file=sys.stderr)
        print(file=sys.stderr)
        if total and done != total:  # a dropped connection can end the stream early, silently
            raise OSError(f"got {done} of {total} bytes")
    except OSError as e:  # URLError, timeouts, refused and dropped connections are all OSErrors
        partial.unlink(missing_ok=True)
        raise ConnectionError(f"could not download {name} from {url} ({e}): offline? "
                              f"Pass a local checkpoint instead") from None
    os.replace(partial, target)  # atomic: a crash mid-download never leaves a truncated target
    return target


def read_safetensors(path):
    """Tensors of a .safetensors file: an 8-byte header length, a JSON header, then raw bytes."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0] if file_size >= 8 else None
        if header_len is None or header_len > min(MAX_HEADER_BYTES, file_size - 8):
            raise ValueError(f"{path}: corrupt or truncated safetensors header ({file_size} bytes in all)")
        entries = {}  # name -> (dtype, shape, first byte, end byte) within the data section
        try:
            header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            for name, info in header.items():
                begin, end = info["data_offsets"]
                if not (isinstance(begin, int) and isinstance(end, int)):
                    raise TypeError(f"tensor {name} has data_offsets {info['data_offsets']}, not integers")
                entries[name] = (SAFETENSORS_DTYPES[info["dtype"]], torch.Size(info["shape"]), begin, end)
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # bad JSON, field or dtype
            raise ValueError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
        data_start, tensors = 8 + header_len, {}
        for name, (dtype, shape, begin, end) in entries.items():
            n_bytes = shape.numel() * dtype.itemsize
            if not (0 <= begin <= end <= file_size - data_start and end - begin == n_bytes):
                raise ValueError(f"{path}: tensor {name} claims bytes {begin}..{end}, which do not fit its "
                                 f"shape {list(shape)} or the file (truncated?)")
            f.seek(data_start + begin)
            raw = bytearray(f.read(n_bytes))  # torch.frombuffer wants writable, non-empty memory
            tensors[name] = (torch.frombuffer(raw, dtype=dtype).reshape(shape) if n_bytes
                             else torch.empty(shape, dtype=dtype))
    return tensors


def read_bin(path):
    """Tensors of a pytorch_model.bin; weights_only=True unpickles tensors and never runs code."""
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for truncated, foreign or unsafe files
        raise ValueError(f"{path}: not a PyTorch checkpoint of plain tensors ({type(e).__name__})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"{path}: expected a dict of named tensors")
    return tensors


def config_from_tensors(tensors, path):
    """The sizes, read off the tensors themselves: they cannot disagree with the weights."""
    tensors = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    wte, wpe = tensors.get("wte.weight"), tensors.get("wpe.weight")
    if wte is None or wpe is None or wte.dim() != 2 or wpe.dim() != 2:
        raise ValueError(f"{path}: no 2-D wte.weight and wpe.weight, so not a GPT-2 checkpoint")
    (vocab_size, n_embd), block_size = wte.shape, wpe.shape[0]
    n_layer = len({name.split(".")[1] for name in tensors if name.startswith("h.")})
    # Only the head count is in no shape: config.json says it, or else GPT-2's heads of 64 do.
    n_head, config_file = n_embd // 64, path.parent / "config.json"
    if config_file.is_file():
        try:
            n_head = json.loads(config_file.read_text()).get("n_head", n_head)
        except (ValueError, AttributeError) as e:  # not JSON, or not a JSON object
            raise ValueError(f"{config_file}: unreadable ({type(e).__name__}: {e})") from None
    if not (isinstance(n_head, int) and n_head > 0 and n_embd % n_head == 0):
        raise ValueError(f"{path}: n_head={n_head!r} does not divide n_embd={n_embd}")
    return GPTConfig(block_size, vocab_size, n_layer, n_head, n_embd)


def load_hf_tensors(model, tensors, path):
    """Copy every parameter from Hugging Face named tensors; anything missing or extra is an error."""
    found = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("transformer.")  # the hub has checkpoints with and without it
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers, not weights: our attention builds its own mask
        if name in found:
            raise ValueError(f"{path}: tensor {name} appears twice, with and without 'transformer.'")
        found[name] = tensor
    lm_head = found.pop("lm_head.weight", None)
    if lm_head is not None and not torch.equal(lm_head, found.get("wte.weight", lm_head)):
        raise ValueError(f"{path}: lm_head.weight differs from wte.weight, but GPT-2 ties them")
    found["lm_head.weight"] = found.pop("wte.weight")  # the tied embeddings (V, C), our LM head's weight (GPT)
    expected = {name.removeprefix("transformer."): p for name, p in model.named_parameters()}
    missing, unexpected = expected.keys() - found.keys(), found.keys() - expected.keys()
    for problem, names in [("missing", missing), ("unexpected", unexpected)]:
        if names:
            raise ValueError(f"{path}: {len(names)} {problem} tensors, e.g. {sorted(names)[:3]}")
    with torch.no_grad():
        for name, param in expected.items():
            is_conv1d = name.endswith(CONV1D_WEIGHTS)
            want = param.shape[::-1] if is_conv1d else param.shape  # as the file should store it
            if found[name].shape != want:
                raise ValueError(f"{path}: tensor {name} has shape {list(found[name].shape)}, "
                                 f"the model expects {list(want)}")
            param.copy_(found[name].t() if is_conv1d else found[name])
