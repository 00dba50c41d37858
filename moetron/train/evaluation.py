"""Validation loss on held-out data (`train.eval_every`, `train.eval_batches`) and greedy text
samples from a fixed prompt (`train.sample_every`).

Held out: the built-in corpus's last tokens; a prepared folder's last documents (whole documents,
so no text is in both splits). Only when `train.eval_every > 0` is anything held out, so turning
evaluation on changes the training data by that tail and nothing else. Validation batches are
consecutive windows of the held-out tokens, the same at every evaluation; data-parallel replicas
split them and the loss is their token-weighted mean. Samples decode with the byte tokenizer
(built-in data) or the prepared folder's tokenizer.json.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from moetron.data.builtin import TokenBatches
from moetron.data.packed import PackedBatches, PreparedCorpus
from moetron.data.prepare import TOKENIZER_FILE, load_tokenizer
from moetron.parallel.context_parallel import split_batch

__all__ = ["HeldOut", "build_data", "validation_loss", "greedy_sample", "Sampler", "check_supported"]

IGNORE_INDEX = -100
BUILTIN_PROMPT = "import os\n\n\ndef "
TEXT_PROMPT = "The meaning of"


def check_supported(recipe) -> None:
    """Evaluation and samples run the model directly: not across pipeline stages (yet)."""
    t, p = recipe.train, recipe.parallel
    if t.eval_every and p.pp > 1:
        raise ValueError("train.eval_every with parallel.pp > 1 is not supported yet (the validation forward does "
                         "not run through the pipeline schedule); set train.eval_every=0 or parallel.pp=1")
    if t.sample_every and (p.pp > 1 or p.cp > 1 or p.tp > 1):
        raise ValueError("train.sample_every needs parallel.pp=1, parallel.cp=1 and parallel.tp=1 (the greedy "
                         "decoder reads whole logits of one sequence); set train.sample_every=0")


class HeldOut:
    """`eval_batches` micro-batches of consecutive windows over a held-out token stream."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, num_batches: int,
                 separator_id: int | None = None):
        self.tokens, self.seq_len, self.batch_size, self.num_batches = tokens, seq_len, batch_size, num_batches
        self.separator_id = separator_id  # labels after it are ignored (train.data_mask_boundary)

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        span = self.tokens.numel() - self.seq_len - 1
        starts = [((i * self.batch_size + r) * self.seq_len) % (span + 1) for r in range(self.batch_size)]
        windows = torch.stack([self.tokens[s: s + self.seq_len + 1].to(torch.int64) for s in starts])
        inputs, labels = windows[:, :-1], windows[:, 1:].clone()
        if self.separator_id is not None:
            labels[inputs == self.separator_id] = IGNORE_INDEX
        return inputs, labels


class _TrainingPart(PreparedCorpus):
    """The first `num_documents` documents of a prepared corpus (the rest is held out)."""

    def __init__(self, corpus: PreparedCorpus, num_documents: int):  # no super().__init__: a view
        self.__dict__.update(corpus.__dict__)
        self.num_documents = num_documents
        self.num_tokens = int(corpus.offsets[num_documents])
        self.offsets = corpus.offsets[: num_documents + 1]
        self.tokens = corpus.tokens[: self.num_tokens]


def _needed(t) -> int:
    return t.eval_batches * t.micro_batch_size * t.seq_len + 1


def build_data(recipe, tokens_fn, dp: int):
    """`(training batches, HeldOut or None)` for `recipe`; `tokens_fn()` gives the built-in corpus."""
    t, c = recipe.train, recipe.model
    need = _needed(t)
    if t.data == "builtin":
        tokens = tokens_fn()
        held = None
        if t.eval_every:
            if tokens.numel() < 2 * need:
                raise ValueError(f"train.eval_batches={t.eval_batches}: holding out {need:,} tokens leaves too "
                                 f"little of the built-in corpus ({tokens.numel():,} tokens); lower it")
            tokens, rest = tokens[:-need], tokens[-need:]
            held = HeldOut(rest, t.seq_len, t.micro_batch_size, t.eval_batches)
        return TokenBatches(tokens, t.seq_len, t.micro_batch_size, t.seed), held
    corpus = PreparedCorpus(t.data)
    held = None
    if t.eval_every:
        position = max(corpus.num_tokens - need, 0)
        first = int(torch.searchsorted(corpus.offsets, torch.tensor([position]), right=True)[0]) - 1
        first = max(min(first, corpus.num_documents - 1), 0)
        train_part = _TrainingPart(corpus, first)
        if first < 1 or train_part.num_tokens < t.seq_len + 1:
            raise ValueError(f"train.eval_batches={t.eval_batches}: {corpus.path} has {corpus.num_documents:,} "
                             f"documents ({corpus.num_tokens:,} tokens); holding out {need:,} tokens of whole "
                             "documents leaves too few to train on; lower train.eval_batches or prepare more text")
        held = HeldOut(corpus.tokens[int(corpus.offsets[first]):], t.seq_len, t.micro_batch_size, t.eval_batches,
                       corpus.separator_id if t.data_mask_boundary else None)
        corpus = train_part
    data = PackedBatches(corpus, t.seq_len, t.micro_batch_size, t.seed, micro_batches_per_step=t.grad_accum * dp,
                         mask_boundary_labels=t.data_mask_boundary, model_vocab_size=c.vocab_size)
    return data, held


@torch.no_grad()
def validation_loss(run, held: HeldOut) -> float:
    """The token-weighted mean LM loss over the held-out batches (every rank calls it)."""
    model, ps = run.model, run.ps
    rank, dp = run.data_rank
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=run.device)
    try:
        for i in range(rank, held.num_batches, dp):
            inputs, labels = (x.to(run.device) for x in held.batch(i))
            count = int((labels != IGNORE_INDEX).sum())
            if ps.cp.size > 1:
                out = model(**split_batch(ps.cp, inputs, labels=labels))
            else:
                out = model(inputs, labels=labels)
            total += torch.tensor([float(out.loss) * count, count], dtype=torch.float64, device=run.device)
    finally:
        model.train(was_training)
        model.reset_load_stats()  # the next step's load statistics are the training tokens' only
    if dp > 1:
        dist.all_reduce(total, group=ps.dp.handle)
    return float(total[0] / total[1].clamp_min(1))


@torch.no_grad()
def greedy_sample(model, prompt: list[int], new_tokens: int, max_len: int, device) -> list[int]:
    """`new_tokens` tokens continuing `prompt`, each the argmax of the model's next-token logits."""
    was_training = model.training
    model.eval()
    ids = torch.tensor([prompt], dtype=torch.int64, device=device)
    try:
        for _ in range(new_tokens):
            logits = model(ids[:, -max_len:]).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    finally:
        model.train(was_training)
        model.reset_load_stats()
    return ids[0, len(prompt):].tolist()


class Sampler:
    """The fixed prompt, encoded once, and the decoding of a continuation."""

    def __init__(self, data: str, new_tokens: int = 32):
        self.new_tokens = new_tokens
        if data == "builtin":
            self.prompt_text = BUILTIN_PROMPT
            self.prompt = list(BUILTIN_PROMPT.encode())
            self.decode = lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        else:
            tokenizer = load_tokenizer(Path(data) / TOKENIZER_FILE)
            self.prompt_text = TEXT_PROMPT
            self.prompt = tokenizer.encode(TEXT_PROMPT).ids
            self.decode = lambda ids: tokenizer.decode(ids)

    def __call__(self, run) -> str:
        ids = greedy_sample(run.model, self.prompt, self.new_tokens, run.recipe.train.seq_len, run.device)
        return self.prompt_text + self.decode(ids)
