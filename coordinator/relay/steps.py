"""One sequence's part of a step: what the caller asks, what the relay carries, what comes back, the head's fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from coordinator.relay.rows import side_by_side
from coordinator.sampling import TokenIds
from protocol import WireTensor


@dataclass
class BatchForward:
    """One sequence's part of `Pipeline.forward_batch`: the arguments of `Pipeline.forward` for it (and, for a
    feature drafter, of `Pipeline.capture`)."""

    seq: int
    pos: int
    tokens: list[int]
    checkpoint: bool = False
    sampling: object = None  # a coordinator.sampling.Sampling, or None for greedy
    drafts: Optional[list[int]] = None
    capture: Optional[list[int]] = None  # layers whose outputs come back: the item's answer is a `Captured`
    propose: Optional[int] = None  # a greedy verify [t0, drafts...]: the head, hosting the drafter, proposes so many
    save_prefix: Optional[int] = None  # a prompt chunk: every shard keeps its state after it as this prefix entry
    # prompt logprobs: the head scores the first len(next_tokens) rows against these, with this many top logprobs
    prompt_logprobs: Optional[int] = None
    next_tokens: Optional[list[int]] = None
    token_mask: Optional[WireTensor] = None  # int32 [len(drafts) + 1, ceil(V / 32)]: the tokens each answered row may take


@dataclass
class Captured:
    """`forward_batch`'s answer for an item that captured: the head's ids, each captured layer's outputs
    (`WireTensor` [n, hidden_size]), and the head's `proposal` when the item asked to `propose`."""

    ids: TokenIds
    outputs: dict[int, WireTensor]
    proposal: Optional[dict] = None


@dataclass
class Step:
    """One sequence's part of a relay (`StepRelay.run`): its request at every shard."""

    seq: int
    pos: int
    chunks: list[list[int]]  # the tokens of each request: one, or several for a long input relayed alone
    checkpoint: bool = False
    capture: Optional[list[int]] = None  # layers whose outputs come back (CAPTURE on the shards owning one)
    head: Optional[dict] = None  # the head shard's extra fields (sampling, drafts, propose, carried_layers)
    save_prefix: Optional[int] = None  # every shard keeps its state after the last chunk as this prefix entry


def head_fields(sampling, drafts, token_mask: Optional[WireTensor] = None) -> Optional[dict]:
    """The head shard's extra FORWARD fields for a sampled or constrained step; None for plain greedy (today's argmax
    request). A token mask covers the answered rows, so its step names its drafts whether it samples or not."""
    fields = sampling.wire() if sampling is not None else {}
    if token_mask is not None:
        fields.update(mask_rows=token_mask.shape[0], token_mask=token_mask)
    if not fields:
        return None
    if drafts:
        fields["drafts"] = list(drafts)
    return fields


def head_request(step: Step, parts: dict, offset: int, n: int, carried_by_rows: bool = False) -> Optional[dict]:
    """The head shard's extra fields for the chunk of `step` at rows `offset .. offset + n - 1`: its `head`,
    with the next tokens of that chunk's rows alone (none left: no prompt logprobs), and the layers captured
    before (`carried_layers`) side by side in `carried` (an item's `propose`: `Pipeline._batch_step`), or, where the
    earlier shards pass them on with their rows (`carried_by_rows`), named alone."""
    head = step.head
    if head is not None and "next_tokens" in head:
        scored = head["next_tokens"][offset:offset + n]
        head = {key: value for key, value in head.items() if key not in ("next_tokens", "prompt_logprobs")}
        if scored:
            head.update(prompt_logprobs=step.head["prompt_logprobs"], next_tokens=scored)
        head = head or None
    if head is None or "carried_layers" not in head:
        return head
    carried = head["carried_layers"]
    fields = {key: value for key, value in head.items() if key != "carried_layers"}
    if carried:
        fields["carried_layers"] = carried
        if not carried_by_rows:
            fields["carried"] = side_by_side([parts[layer][0] for layer in carried])
    return fields
