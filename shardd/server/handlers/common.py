"""What several handlers share: the layer range and drafter a request needs, and the reply of a batch."""

from __future__ import annotations

from protocol import ErrorCode, ProtocolError, WireTensor
from protocol.codec import clip_message
from shardd.server.errors import Refusals, code_and_message
from shardd.server.tensors import joined_on_host


def layers_of(shard, request):
    """The daemon's engine, for a request that needs target layers."""
    if shard is None:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{request.type.value}: this daemon hosts only a drafter and owns no target layers"
        )
    return shard


def batch_reply(request, answers: list, refusals: Refusals) -> tuple[dict, dict]:
    """`{"items": [...]}`: per item its result or `{"seq", "error": {code, message}}`; each tensor holds the rows of
    the items that answered it, in item order (one frame per name for the whole batch)."""
    items, parts = [], {}
    for item, answer in zip(request.items, answers):
        seq = item.seq
        if isinstance(answer, Exception):
            code, message = code_and_message(answer)
            refusals.note(request.type, code, message, seq)
            items.append({"seq": seq, "error": {"code": ErrorCode(code).value, "message": clip_message(message)}})
            continue
        result, tensors = answer
        items.append(result)
        for name, tensor in tensors.items():
            parts.setdefault(name, []).append(tensor)
    # on the host before joining: an engine's items need not share a device (a fast shard's step rows come
    # back in pinned host memory, an item longer than its step through the prefill path on the GPU)
    tensors = {name: WireTensor.from_torch(joined_on_host(chunks)) for name, chunks in parts.items()}
    return {"items": items}, tensors
