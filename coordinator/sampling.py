"""A request's sampling settings on the coordinator side (torch-free); the math runs on the head shard
(`shardd.sampling`). Temperature 0 is greedy: the shards' argmax, exactly as without sampling."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: all tokens), got {self.top_k}")
        if not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def wire(self) -> dict:
        """The FORWARD header fields for the head shard."""
        return {"temperature": float(self.temperature), "top_p": float(self.top_p), "top_k": self.top_k, "seed": self.seed}

    @classmethod
    def make(cls, temperature: Optional[float], top_p: Optional[float] = None, top_k: Optional[int] = None,
             seed: Optional[int] = None) -> "Sampling":
        """Defaults as OpenAI servers use them (temperature 1 when unset is the caller's choice); no seed: a random one."""
        return cls(
            temperature=0.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=0 if top_k is None or top_k < 0 else int(top_k),
            seed=secrets.randbelow(1 << 62) if seed is None else int(seed) % (1 << 63),
        )


GREEDY = Sampling()
