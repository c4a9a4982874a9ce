"""Token sampling: pure tensor ops on the logits.

`SamplingParams` says how a request picks its tokens. `sample` (one SamplingParams for a batch:
greedy, temperature, min-p, top-k, top-p, seeded) is the single-stream Generator's. The
serving engine samples a step's rows together (engine/step_sampler.py) from these batched,
sync-free pieces, each row with its own settings, applied in this order (vLLM's):

1. a grammar's token bitmask (`apply_bitmask_ref`; the grammar module's kernel where present),
2. `logit_bias` (added to the logits, OpenAI's semantics),
3. penalties (`apply_penalties`): repetition (HF/vLLM: over prompt and generated tokens, a
   positive logit divided by it, a negative one multiplied), then frequency and presence
   (OpenAI: `- frequency * count - presence * (count > 0)` over generated tokens),
4. greedy rows (temperature 0) take the argmax of that; the others divide by the temperature,
   drop tokens below min_p times the top token's probability, keep the top_k, keep the top_p
   nucleus (`filtered_rows`) and draw by an exponential race with per-row noise
   (`sample_rows`), so a seeded row's draw depends on its own generator alone.

Logprobs (`TokenLogprob`) are of the model's raw distribution: log_softmax of the logits before
the grammar, the bias, the penalties and the temperature (vLLM's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20  # alternatives a token's logprob may list (OpenAI's top_logprobs limit)
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Fields with a `help` are also CLI flags of `moetier
    generate` (the single-stream Generator takes those); the others are the serving engine's."""

    max_new_tokens: int = field(
        default=256, metadata={"help": "stop after this many new tokens (1 or more)"}
    )
    temperature: float = field(default=0.7, metadata={"help": "0 = greedy"})
    top_p: float = field(default=0.95, metadata={"help": "nucleus sampling mass (1 = off)"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens (0 = off)"})
    seed: int | None = field(
        default=None, metadata={"help": "random seed for reproducible sampling"}
    )
    stop: tuple[str, ...] = field(default=(), metadata={"help": "stop string (repeatable)"})
    min_p: float = field(
        default=0.0,
        metadata={"help": "drop tokens below min_p x the most likely token's probability"},
    )
    # the serving engine's alone (no CLI flag)
    presence_penalty: float = field(default=0.0, metadata={"flag": False})
    frequency_penalty: float = field(default=0.0, metadata={"flag": False})
    repetition_penalty: float = field(default=1.0, metadata={"flag": False})
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), metadata={"flag": False})
    logprobs: int | None = field(default=None, metadata={"flag": False})  # None / 0 / top N
    prompt_logprobs: int | None = field(default=None, metadata={"flag": False})
    grammar: tuple[str, str] | None = field(default=None, metadata={"flag": False})
    # (budget tokens, the end-of-reasoning marker's ids[, the start marker's ids: the budget
    # holds only for an answer that opens with it]): engine/reasoning_budget.py
    reasoning_budget: (
        tuple[int, tuple[int, ...]] | tuple[int, tuple[int, ...], tuple[int, ...]] | None
    ) = field(default=None, metadata={"flag": False})

    def __post_init__(self) -> None:
        def refuse(name: str, value: object, allowed: str) -> None:
            raise ValueError(f"{name} = {value!r}: use {allowed}")

        if self.max_new_tokens < 0:
            refuse("max_new_tokens", self.max_new_tokens, "an integer >= 0")
        if not 0 <= self.temperature < math.inf:
            refuse("temperature", self.temperature, "a number >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            refuse("top_p", self.top_p, "a number in (0, 1] (1 = off)")
        if self.top_k < 0:
            refuse("top_k", self.top_k, "an integer >= 0 (0 = off)")
        if not 0 <= self.min_p <= 1:
            refuse("min_p", self.min_p, "a number in [0, 1] (0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                refuse(name, getattr(self, name), "a number in [-2, 2] (0 = off)")
        if not 0 < self.repetition_penalty < math.inf:
            refuse("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off)")
        for entry in self.logit_bias:
            if len(entry) != 2:
                refuse("logit_bias entry", entry, "(token id, bias) pairs")
            token, bias = entry
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                refuse("logit_bias token id", token, "an integer token id >= 0")
            if not -100 <= bias <= 100:
                refuse(f"logit_bias of token {token}", bias, "a number in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                refuse(name, value, f"an integer in [0, {MAX_LOGPROBS}], or none")
        if self.grammar is not None and (
            len(self.grammar) != 2 or self.grammar[0] not in GRAMMAR_KINDS
        ):
            refuse("grammar", self.grammar, f"(kind, spec) with kind one of {GRAMMAR_KINDS}")
        if self.reasoning_budget is not None:
            budget, end_ids = self.reasoning_budget[:2]
            if budget < 1 or not end_ids:
                refuse("reasoning budget", budget, "at least 1 token, with an end marker")
            if self.grammar is not None:
                refuse("grammar", self.grammar[0], "none with a reasoning budget (not both)")

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def speculable(self) -> bool:
        """Whether speculative drafts may be verified for it (engine/speculative.py): a
        distribution of temperature, top-k, top-p and min-p alone, no token reported back."""
        return (
            not self.penalized
            and not self.logit_bias
            and self.grammar is None
            and self.reasoning_budget is None
            and self.logprobs is None
            and self.prompt_logprobs is None
        )

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: nothing to apply before the argmax, no logprobs."""
        return (
            self.temperature == 0
            and not self.penalized
            and not self.logit_bias
            and self.grammar is None
            and self.reasoning_budget is None
            and self.logprobs is None
        )


@dataclass
class TokenLogprob:
    """A token's log-probability under the model's raw distribution (log_softmax of the
    logits before grammar, bias, penalties and temperature) and the `top` N most likely tokens
    at its position, most likely first, as (token, logprob)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64, same device)."""
    if params.temperature == 0:
        return logits.float().argmax(dim=-1)
    probs = filtered_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [B, V] -> fp32 logits / temperature with tokens outside min-p / top-k / top-p at
    -inf: the distribution `sample` draws from (temperature > 0)."""
    batch = logits.shape[0]

    def per_row(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((batch,), value, dtype=dtype, device=logits.device)

    return filtered_rows(
        logits,
        per_row(params.temperature, torch.float32),
        per_row(params.top_k, torch.int64),
        per_row(params.top_p, torch.float32),
        per_row(params.min_p, torch.float32),
    )


def filtered_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    sort: bool = True,
) -> torch.Tensor:
    """Per-row `filtered_logits`, no host sync: logits [B, V]; temperature [B] (rows at 0 are
    left unscaled); top_k [B] int64 (0 = off); top_p [B] in (0, 1] (1 = off); min_p [B] in
    [0, 1] (0 = off) -> fp32 [B, V], each row's logits / temperature with the tokens outside
    its filters at -inf. Filters in vLLM's order: min-p, then top-k, then top-p over what is
    left (ties at a cut kept). `sort` False: no row has top-k or top-p on (the caller knows),
    so the vocabulary is not sorted."""
    logits = logits.float()
    vocab = logits.shape[-1]
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if not sort:
        floor = scaled.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
        return scaled.masked_fill(scaled < floor, float("-inf"))
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
    # min-p: p >= min_p * p_max, i.e. logit >= top logit + log(min_p)
    floor = sorted_logits[:, :1] + torch.log(min_p)[:, None]  # min_p 0: -inf, keeps all
    sorted_logits = sorted_logits.masked_fill(sorted_logits < floor, float("-inf"))
    # top-k: keep every token >= the k-th largest
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).clamp(min=1)
    kth = sorted_logits.gather(-1, (k - 1)[:, None])  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # top-p over what is left: drop a token when the mass before it already reaches top_p
    probs = sorted_logits.softmax(dim=-1)
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    generator: torch.Generator | None,
    noise: torch.Tensor | None = None,
    sort: bool = True,
) -> torch.Tensor:
    """Batched, sync-free `sample`: each row its own settings, no host sync, no data-dependent
    shape, so it captures into a CUDA graph.

    logits [B, V] and the per-row settings of `filtered_rows` -> token ids [B] int64; rows with
    temperature 0 take the argmax. The others draw from `filtered_rows`' distribution by an
    exponential race (argmax over tokens of p / E, E ~ Exp(1), is a draw from p): `noise`
    [B, V] are the E (a row drawn from its own generator repeats whatever shares its batch),
    else drawn from `generator`. `sort` as `filtered_rows`'."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    probs = filtered_rows(logits, temperature, top_k, top_p, min_p, sort).softmax(dim=-1)
    if noise is None:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    # a 0 draw would make 0 / 0 for a dropped token
    noise = noise.clamp(min=torch.finfo(noise.dtype).tiny)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


def to_device(
    values: list, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A tensor of `values` on `device`, without a host sync: on CUDA through pinned memory
    and a non-blocking copy (a plain copy from pageable memory would wait for the work queued
    before it, the step's forward)."""
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def sampling_tensors(
    params: list[SamplingParams], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature, top_k, top_p, min_p) [B] for `sample_rows`, built once per batch."""
    values = to_device(
        [[p.temperature, p.top_k, p.top_p, p.min_p] for p in params], device, torch.float64
    )
    temperature, top_k, top_p, min_p = values.unbind(1)
    return temperature.float(), top_k.long(), top_p.float(), min_p.float()


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    seen: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V] fp32; output_counts [B, V]: how often each token was generated; seen
    [B, V] bool: in the prompt or generated; presence, frequency, repetition [B] -> penalized
    logits [B, V] (a new tensor). Repetition first (a seen token's positive logit divided by
    it, a negative one multiplied), then `- frequency * count - presence * (count > 0)`."""
    rep = repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    counts = output_counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(counts)


def token_counts(sequences: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(sequences), vocab] float32: how often each token occurs in each sequence."""
    counts = torch.zeros(len(sequences), vocab, dtype=torch.float32, device=device)
    flat = [t for seq in sequences for t in seq]
    if flat:
        rows = [row for row, seq in enumerate(sequences) for _ in seq]
        index = (to_device(rows, device, torch.int64), to_device(flat, device, torch.int64))
        counts.index_put_(index, torch.ones(len(flat), device=device), accumulate=True)
    return counts


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [B, V] at -inf wherever the token's bit in bitmask [B, ceil(V/32)]
    int32 is 0 (bit j of word w is token 32 * w + j, xgrammar's layout)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32)[:, :, None] >> shifts) & 1  # [B, W, 32]
    allowed = bits.flatten(1)[:, :vocab].to(device=logits.device, dtype=torch.bool)
    logits.masked_fill_(~allowed, float("-inf"))


def bitmask_words(vocab: int) -> int:
    return -(-vocab // 32)
