"""The shard set as its daemons describe themselves: each shard's HELLO (`ShardInfo`), what makes a restarted daemon
the same shard, and the layer order, refusing a set that would compute something other than the model: layer
ranges that leave a gap or overlap, different weights (fingerprints), protocol versions or activation dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from protocol import PROTOCOL_VERSION
from protocol.layout import coverage_problems


class PipelineError(RuntimeError):
    """The shard set cannot serve a request as asked; the message names the shard(s)."""


@dataclass(frozen=True)
class ShardInfo:
    """A shard as its HELLO describes it."""

    endpoint: str
    hello: dict

    @property
    def owns_layers(self) -> bool:
        """False for a daemon that hosts only a drafter (HELLO `layers: null`)."""
        return self.hello["layers"] is not None

    @property
    def begin(self) -> int:
        return self.hello["layers"][0]

    @property
    def end(self) -> int:
        return self.hello["layers"][1]

    @property
    def layers(self) -> str:
        return f"{self.begin}:{self.end}"

    @property
    def model(self) -> dict:
        return self.hello["model"]

    @property
    def owns_head(self) -> bool:
        return bool(self.hello["owns_head"])

    @property
    def rollback_mode(self) -> Optional[str]:
        return self.hello["rollback"]["mode"]

    @property
    def max_verify_tokens(self) -> int:
        return self.hello["rollback"]["max_verify_tokens"]

    @property
    def max_tokens_per_request(self) -> int:
        return self.hello["limits"]["max_tokens_per_request"]

    @property
    def has_gdn_layers(self) -> bool:
        if not self.owns_layers:
            return False
        types = self.model["layer_types"][self.begin:self.end]
        return any(kind == "linear_attention" for kind in types)

    def __str__(self) -> str:
        if not self.owns_layers:
            return f"{self.endpoint} (drafter only)"
        return f"{self.endpoint} (layers {self.layers})"


# What makes a daemon the same shard: a restarted one must match in all of these before it is re-filled.
SHARD_IDENTITY = {
    "protocol": lambda h: h.get("protocol_version"),
    "fingerprint": lambda h: (h.get("model") or {}).get("fingerprint"),
    "layers": lambda h: h.get("layers"),
    "dtype": lambda h: h.get("dtype"),
    "head": lambda h: h.get("owns_head"),
    "embedding": lambda h: h.get("owns_embedding"),
    # engine, step rows, prefill piece, attention launch, FP8 scheme and tiles: a token's bits depend on each
    "numerics": lambda h: h.get("numerics"),
}


def identity_changes(before: dict, now: dict) -> list[str]:
    """How the daemon described by HELLO `now` differs from the shard of HELLO `before`."""
    changes = []
    for name, key in SHARD_IDENTITY.items():
        if key(now) != key(before):
            changes.append(f"{name} {key(now)!r} (was {key(before)!r})")
    return changes


def order_shards(shards: Sequence[ShardInfo]) -> list[ShardInfo]:
    """The shards that own layers, in layer order, or PipelineError listing every reason the
    set cannot form the model: protocol version, fingerprint, dtype, gaps and overlaps.
    Drafter-only daemons must agree on version, fingerprint and dtype but cover no layers."""
    if not shards:
        raise PipelineError("no shards given")
    problems = []
    for shard in shards:
        if shard.hello.get("protocol_version") != PROTOCOL_VERSION:
            problems.append(
                f"{shard.endpoint} speaks protocol version {shard.hello.get('protocol_version')!r}, "
                f"this coordinator speaks {PROTOCOL_VERSION}"
            )
    for what, key in (("model fingerprints", lambda s: s.model["fingerprint"]), ("dtypes", lambda s: s.hello["dtype"])):
        groups: dict[str, list[str]] = {}
        for shard in shards:
            groups.setdefault(str(key(shard)), []).append(shard.endpoint)
        if len(groups) > 1:
            listed = "; ".join(f"{value}: {', '.join(endpoints)}" for value, endpoints in groups.items())
            problems.append(f"shards disagree on {what} ({listed})")
    if problems:
        raise PipelineError("refusing this shard set: " + "; ".join(problems))

    ordered = sorted((s for s in shards if s.owns_layers), key=lambda s: (s.begin, s.end))
    if not ordered:
        raise PipelineError(f"no shard owns target layers: {', '.join(map(str, shards))} host only a drafter")
    num_layers = ordered[0].model["num_layers"]
    problems = coverage_problems([(s.begin, s.end) for s in ordered], num_layers, names=map(str, ordered))
    if problems:
        raise PipelineError(f"refusing this shard set for a {num_layers}-layer model: " + "; ".join(problems))
    return ordered
