"""`--block-size auto`: the rows of a sequence's next verify block, chosen by what the block costs to move against
the tokens it is expected to commit.

A verify block of B rows (t0 and B-1 drafts) reads every dense weight once whatever B; on a MoE target each of its
MoE layers also reads the distinct routed experts its rows select: with E experts, k routed per token and routing
taken as uniform, E * (1 - (1 - k/E)^B) of them. Each row also writes its rollback record (a checkpoint of every
GDN layer's state, or the recurrence's log: the shards' `checkpoint_bytes_per_sequence` over `max_verify_tokens`).
Drafts are accepted one after another until the first rejection, each with the sequence's running acceptance rate
p, so the block commits 1 + p + ... + p^(B-1) tokens on average. The chosen B maximises tokens per byte moved: on a
dense target the largest block while the drafts are accepted, down to one draft when a drafter accepts almost
nothing (its rows' records are then all cost). Verification is exact whatever B is, so the output is the same as
with any fixed block size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from common.model_config import ModelConfig
from common.shapes import shard_shapes, weight_bytes_by_part

AUTO = "auto"
# The largest block `--block-size auto` chooses (the fixed default's size), unless the drafter's own limit is lower.
AUTO_LARGEST_BLOCK = 16
# The smallest: one draft, so that every step still measures the acceptance rate the choice is made from.
AUTO_SMALLEST_BLOCK = 2


@dataclass(frozen=True)
class VerifyCost:
    """The bytes a verify step moves: `dense_bytes` whatever its rows, plus, in each of `moe_layers` layers, each
    distinct routed expert its rows select (`expert_bytes`: one expert's three matrices), plus `row_bytes` per row
    (its rollback record)."""

    dense_bytes: int
    moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_bytes: int = 0
    row_bytes: int = 0

    def distinct_experts(self, rows: int) -> float:
        """Expected distinct experts `rows` tokens select in one layer, each choosing k of E uniformly."""
        if not self.moe_layers:
            return 0.0
        return self.num_experts * (1 - (1 - self.experts_per_token / self.num_experts) ** rows)

    def bytes_moved(self, rows: int) -> float:
        return (self.dense_bytes + self.moe_layers * self.distinct_experts(rows) * self.expert_bytes
                + rows * self.row_bytes)

    @classmethod
    def of_weights(cls, parts: dict[str, int], moe_layers: int = 0, num_experts: int = 0,
                   experts_per_token: int = 0, row_bytes: int = 0) -> "VerifyCost":
        """From the weights by common.shapes.WEIGHT_PARTS of the layers a step runs (a step reads the embedding's
        rows only, so it is left out), their MoE layers' routing (none: dense) and what each row writes."""
        dense = sum(n for name, n in parts.items() if name not in ("experts", "embedding"))
        if not moe_layers:
            return cls(dense + parts.get("experts", 0), row_bytes=row_bytes)
        return cls(dense, moe_layers, num_experts, experts_per_token,
                   parts.get("experts", 0) // (moe_layers * num_experts), row_bytes)

    @classmethod
    def of_config(cls, config: ModelConfig, dtype_bytes: int, row_bytes: int = 0) -> "VerifyCost":
        """A target's whole model in one dtype (an in-process target), each row writing `row_bytes`."""
        parts = weight_bytes_by_part(config, shard_shapes(config, 0, config.num_layers), begin=0,
                                     dtype_bytes=dtype_bytes)
        moe = config.moe
        if moe is None:
            return cls.of_weights(parts, row_bytes=row_bytes)
        return cls.of_weights(parts, config.num_layers, moe.num_experts, moe.num_experts_per_tok, row_bytes)

    @classmethod
    def of_hellos(cls, hellos: Iterable[dict]) -> Optional["VerifyCost"]:
        """From the shards' HELLOs (their memory plans' weights by part, the model's MoE block); None when a shard
        does not report its weights."""
        parts: dict[str, int] = {}
        moe, layers, row_bytes = None, 0, 0
        for hello in hellos:
            weights = (hello.get("memory") or {}).get("weight_parts")
            if hello.get("layers") is None:
                continue
            if weights is None:
                return None
            for name, n in weights.items():
                parts[name] = parts.get(name, 0) + n
            moe = hello["model"].get("moe")
            layers += hello["layers"][1] - hello["layers"][0]
            row_bytes += rollback_row_bytes(hello.get("rollback") or {})
        if moe is None:
            return cls.of_weights(parts, row_bytes=row_bytes)
        return cls.of_weights(parts, layers, moe["num_experts"], moe["num_experts_per_tok"], row_bytes)


def rollback_row_bytes(rollback: dict) -> int:
    """What one verify row writes of a shard's rollback storage (HELLO `rollback`): its records for the largest
    block over the block's rows; 0 without storage."""
    if not rollback.get("mode") or not rollback.get("max_verify_tokens"):
        return 0
    return int(rollback.get("checkpoint_bytes_per_sequence") or 0) // int(rollback["max_verify_tokens"])


def expected_commit(acceptance: float, rows: int) -> float:
    """Tokens a block of `rows` commits on average: t0's answer, plus each draft while all before it were
    accepted, each with probability `acceptance`: 1 + p + ... + p^(rows-1)."""
    return sum(acceptance ** index for index in range(rows))


def acceptance_estimate(accepted: int, rejected: int) -> float:
    """The per-draft acceptance rate of a sequence from its drafts accepted and its blocks cut by a rejection
    (the geometric model's estimate), with one of each assumed before any step (so it starts at 1/2)."""
    return (accepted + 1) / (accepted + rejected + 2)


def choose_block_size(cost: VerifyCost, acceptance: float, largest: int) -> int:
    """The block of AUTO_SMALLEST_BLOCK .. `largest` rows with the most expected tokens per byte moved; of equal
    ones, the largest (so a target whose rows write nothing gets `largest` unless it is a MoE)."""
    best, best_rate = largest, -1.0
    for rows in range(min(AUTO_SMALLEST_BLOCK, largest), largest + 1):
        rate = expected_commit(acceptance, rows) / cost.bytes_moved(rows)
        if rate >= best_rate:
            best, best_rate = rows, rate
    return best


def verify_cost_of(target) -> VerifyCost:
    """What `target`'s verify steps read: a Pipeline's from its shards' HELLOs, an in-process target's (`config`,
    `dtype_bytes`) from its config; ValueError when it does not say."""
    shards = getattr(target, "shards", None)
    hellos = [getattr(shard, "hello", None) for shard in shards or ()]
    if hellos and all(isinstance(hello, dict) for hello in hellos):
        cost = VerifyCost.of_hellos(hellos)
        if cost is None:
            raise ValueError("--block-size auto needs shards that report their weights in HELLO (memory.weight_parts)")
        return cost
    if getattr(target, "config", None) is not None:
        return VerifyCost.of_config(target.config, getattr(target, "dtype_bytes", 4),
                                    getattr(target, "verify_row_bytes", 0))
    raise ValueError("--block-size auto needs a target that says what its steps read")
