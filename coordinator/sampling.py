"""A request's sampling settings on the coordinator side (torch-free); the math runs on the head shard
(`shardd.engine.head.sampling`). Temperature 0, or any below `protocol.SAMPLING_EPS`, is greedy: the shards'
argmax, exactly as without sampling."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from protocol import samples


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # vLLM's penalties (shardd.engine.head.penalties) and logprobs (shardd.engine.head.logprobs), applied on the head shard.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None  # top logprobs per committed token; None: no logprobs at all
    # Set by the decoding loop per step: the prompt, and the tokens generated so far (the penalties' context).
    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: all tokens), got {self.top_k}")
        if not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def plain(self) -> bool:
        """The shards' argmax is the whole answer: greedy, no penalty, no logprobs (today's request)."""
        return self.greedy and not self.penalised and self.logprobs is None

    def at(self, prompt: Sequence[int], output: Sequence[int]) -> "Sampling":
        """This request at a step whose first answered row follows `output` (only penalties read the tokens)."""
        if not self.penalised:
            return self
        return replace(self, prompt=tuple(prompt) if self.repetition_penalty != 1 else (), output=tuple(output))

    @property
    def greedy(self) -> bool:
        """The argmax: temperature 0, or any below SAMPLING_EPS (as the head shard treats it)."""
        return not samples(self.temperature)

    def wire(self) -> dict:
        """The FORWARD header fields for the head shard; empty for a plain greedy request."""
        fields = {}
        if not self.greedy:
            fields.update(temperature=float(self.temperature), top_p=float(self.top_p), top_k=self.top_k,
                          seed=self.seed)
        if self.penalised:
            fields.update(presence_penalty=float(self.presence_penalty), frequency_penalty=float(self.frequency_penalty),
                          repetition_penalty=float(self.repetition_penalty), output_tokens=list(self.output))
            if self.repetition_penalty != 1:
                fields["prompt_tokens"] = list(self.prompt)
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        return fields

    @classmethod
    def make(cls, temperature: Optional[float], top_p: Optional[float] = None, top_k: Optional[int] = None,
             seed: Optional[int] = None, **extras) -> "Sampling":
        """Defaults as OpenAI servers use them (temperature 1 when unset is the caller's choice); no seed: a random one.
        `extras`: penalties and logprobs, as the fields are named."""
        return cls(
            temperature=0.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=0 if top_k is None or top_k < 0 else int(top_k),
            seed=secrets.randbelow(1 << 62) if seed is None else int(seed) % (1 << 63),
            **extras,
        )


GREEDY = Sampling()


class TokenIds(list):
    """A forward's ids, with the head shard's `logprobs` of its answered rows (the last len(drafts) + 1) when
    the request asked for them: per row [logprob of the id, [[id, logprob], ...top]]; and its prompt logprobs."""

    logprobs: Optional[list] = None
    # with prompt logprobs asked: per scored row [logprob of its next token, [[id, logprob], ...top], rank]
    prompt_logprobs: Optional[list] = None
