"""The one place that knows how a model's layers split into shards, and the rollback mode names.

Torch-free: both the daemon (which builds a shard) and the coordinator (which plans and checks a
shard set) import it.
"""

from __future__ import annotations

from typing import Iterable, Sequence

# Rollback modes. The daemon implements CHECKPOINT and REPLAY_SSM; REPLAY is the coordinator's
# baseline (snapshot, restore, forward the kept tokens again), not a daemon mode.
CHECKPOINT = "checkpoint"
REPLAY_SSM = "replay-ssm"
REPLAY = "replay"
SHARD_ROLLBACK_MODES = (CHECKPOINT, REPLAY_SSM)
ROLLBACK_MODES = (CHECKPOINT, REPLAY_SSM, REPLAY)


def parse_layer_range(spec: str) -> tuple[int, int]:
    """'BEGIN:END' -> (begin, end) with 0 <= begin < end; check_layer_range says whether it fits a model."""
    try:
        begin_text, end_text = spec.split(":")
        begin, end = int(begin_text), int(end_text)
    except ValueError:
        raise ValueError(f"a layer range looks like BEGIN:END (e.g. 0:32), got {spec!r}") from None
    if begin < 0 or end < 0:
        raise ValueError(f"layer range {spec} has a negative bound")
    if begin > end:
        raise ValueError(f"layer range {spec} is reversed: BEGIN must be below END (did you mean {end}:{begin}?)")
    if begin == end:
        raise ValueError(f"layer range {spec} is empty")
    return begin, end


def check_layer_range(begin: int, end: int, num_layers: int) -> None:
    if not 0 <= begin < end <= num_layers:
        raise ValueError(f"layer range {begin}:{end} is not inside 0:{num_layers}")


def parse_layer_ranges(spec: str) -> list[tuple[int, int]]:
    """'0:3,3:8' -> [(0, 3), (3, 8)]; coverage is check_coverage's to say."""
    return [parse_layer_range(part) for part in spec.split(",")]


def owns_embedding(begin: int) -> bool:
    """The shard that starts at layer 0 owns the token embedding."""
    return begin == 0


def owns_head(end: int, num_layers: int) -> bool:
    """The shard that ends at the last layer owns the final norm and lm_head."""
    return end == num_layers


def balanced_split(costs: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges covering every layer, each layer weighing `costs[i]` (its bytes, the embedding with
    layer 0 and the head with the last), minimising the heaviest range; among those, the one whose ranges are
    closest to equal (least sum of squares), then the one with the longer ranges first. Exact, by dynamic
    programming over the split points."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts} shards")
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[j]: the best split of layers [0, j) into the ranges placed so far, as (max, sum of squares, -lengths, ends)
    best: list = [None] * (n + 1)
    best[0] = (0, 0, (), ())
    for placed in range(1, parts + 1):
        following: list = [None] * (n + 1)
        for end in range(placed, n - (parts - placed) + 1):  # leave a layer for each range still to place
            for begin in range(placed - 1, end):
                before = best[begin]
                if before is None:
                    continue
                weight = prefix[end] - prefix[begin]
                key = (max(before[0], weight), before[1] + weight * weight, before[2] + (begin - end,),
                       before[3] + (end,))
                if following[end] is None or key[:3] < following[end][:3]:
                    following[end] = key
        best = following
    ends = best[n][3]
    return [(begin, end) for begin, end in zip((0, *ends[:-1]), ends)]


def even_split(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges covering 0:num_layers, sizes differing by at most one (the longer ones first)."""
    return balanced_split([1] * num_layers, parts)


def coverage_problems(ranges: Sequence[tuple[int, int]], num_layers: int, names: Iterable[str] | None = None) -> list[str]:
    """Every gap and overlap of `ranges` (in any order) against 0:num_layers; [] when they form the model.

    `names` labels each range in the messages (defaults to 'layers B:E')."""
    labels = list(names) if names is not None else [f"layers {b}:{e}" for b, e in ranges]
    ordered = sorted(zip(ranges, labels), key=lambda item: item[0])
    problems: list[str] = []
    covered, previous = 0, None
    for (begin, end), label in ordered:
        if begin > covered:
            after = f" (after {previous})" if previous else ""
            problems.append(f"gap: no shard serves layers {covered}:{begin}{after}, before {label}")
        elif begin < covered:
            problems.append(f"overlap: {previous} and {label} both serve layers {begin}:{min(covered, end)}")
        if end > covered:
            covered, previous = end, label
    if covered < num_layers:
        problems.append(f"gap: no shard serves layers {covered}:{num_layers}" + (f" (after {previous})" if previous else ""))
    return problems
