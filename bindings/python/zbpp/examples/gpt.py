"""A small GPT (token and position embedding, pre-norm attention and MLP blocks, final layer norm,
LM head) cut into pipeline stages, and a generated text to train it on.

What this is: the model of the main job and of the pipeline tests. `build_stages` builds the whole
model from a seed on every rank (so every rank and a single-process reference agree on the
parameters bit for bit) and returns the S stage modules; a rank keeps the ones it holds.

What this is not: fast, or a tokenizer. Characters are the tokens; the text is generated.
"""

import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "Embed", "Block", "Head", "build_stages", "build_vocab_parallel_stages", "generate_text",
           "Batches", "loss_fn"]


class GPTConfig:
    def __init__(self, vocab=32, seq=32, d_model=64, n_head=4, n_layer=4, ffn=4):
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} must be a multiple of n_head={n_head}")
        self.vocab, self.seq, self.d_model, self.n_head, self.n_layer, self.ffn = vocab, seq, d_model, n_head, n_layer, ffn


class Embed(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq, c.d_model)

    def forward(self, idx):
        return _add_positions(self.pos, self.tok(idx))


def _add_positions(pos, x):
    return x + pos(torch.arange(x.shape[1], device=x.device))


class Positions(nn.Module):
    """Stage 0's part of Embed under Vocabulary Parallelism: the token embedding is split over the
    ranks (zbpp.VocabParallel) and arrives as this module's input; the positions are added here."""

    def __init__(self, embed):
        super().__init__()
        self.pos = embed.pos

    def forward(self, x):
        return _add_positions(self.pos, x)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)); causal attention written
    out (softmax(QK^T / sqrt(d)) V with a mask) so it runs on torch 1.13 and 2.x alike."""

    def __init__(self, c):
        super().__init__()
        self.n_head = c.n_head
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.ffn * c.d_model)
        self.fc2 = nn.Linear(c.ffn * c.d_model, c.d_model)
        self.register_buffer("mask", torch.tril(torch.ones(c.seq, c.seq, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        B, T, D = x.shape
        h = self.n_head
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.reshape(B, T, h, D // h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // h))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln = nn.LayerNorm(c.d_model)
        self.out = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def build_stages(config, num_stages, seed=0):
    """The whole model, built from `seed`, cut into num_stages nn.Sequential stages: the embedding
    goes with stage 0, the head with the last, the blocks are spread as evenly as they go (earlier
    stages get the extra ones)."""
    if config.n_layer < num_stages:
        raise ValueError(f"{config.n_layer} layers cannot fill {num_stages} stages; use at least one "
                         "layer per stage (--layers)")
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        embed, blocks, head = Embed(config), [Block(config) for _ in range(config.n_layer)], Head(config)
    finally:
        torch.set_rng_state(state)
    stages, k = [], 0
    for s in range(num_stages):
        n = config.n_layer // num_stages + (1 if s < config.n_layer % num_stages else 0)
        mods = ([embed] if s == 0 else []) + blocks[k:k + n] + ([head] if s == num_stages - 1 else [])
        k += n
        stages.append(nn.Sequential(*mods))
    return stages


def build_vocab_parallel_stages(config, num_stages, seed=0):
    """The model of build_stages (the same parameters, bit for bit), cut for Vocabulary
    Parallelism: (stages, token embedding, output layer). Stage 0 starts with Positions (it takes
    the token embedding's output), the last ends with the final layer norm (it returns hidden
    states); the token embedding and the output layer go to zbpp.VocabParallel."""
    stages = build_stages(config, num_stages, seed)
    embed, head = stages[0][0], stages[-1][-1]
    stages[0][0] = Positions(embed)
    stages[-1][-1] = head.ln
    return stages, embed.tok, head.out


def loss_fn(logits, target):
    """Next-character cross entropy, averaged over the microbatch's tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


_ALPHABET = "0123456789+=\n abcdefghijklmnopqr"  # 32 characters: the vocabulary


def generate_text(n_chars, seed=0):
    """Sums written out, one per line ("17+25=42"), with some words between them: structure a small
    model learns within a few dozen steps, so the loss visibly falls."""
    rng = random.Random(seed)
    words = ["add", "bad", "cab", "dead", "face", "beef", "jab", "hop", "ride"]
    parts, n = [], 0
    while n < n_chars:
        a, b = rng.randrange(100), rng.randrange(100)
        line = f"{a}+{b}={a + b}\n" if rng.random() < 0.8 else rng.choice(words) + " " + rng.choice(words) + "\n"
        parts.append(line)
        n += len(line)
    return "".join(parts)[:n_chars]


class Batches:
    """Deterministic (input, target) batches of character ids from the generated text."""

    def __init__(self, seq, batch, seed=0, n_chars=200_000):
        text = generate_text(n_chars, seed)
        self.data = torch.tensor([_ALPHABET.index(ch) for ch in text], dtype=torch.long)
        self.seq, self.batch = seq, batch
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        starts = torch.randint(0, len(self.data) - self.seq - 1, (self.batch,), generator=self.gen)
        x = torch.stack([self.data[s:s + self.seq] for s in starts])
        y = torch.stack([self.data[s + 1:s + self.seq + 1] for s in starts])
        return x, y
