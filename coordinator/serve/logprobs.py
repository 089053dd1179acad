"""The head shard's logprobs (shardd.engine.head.logprobs: the raw distribution, as vLLM reports by default) in the
OpenAI response shapes: completions' `{tokens, token_logprobs, top_logprobs, text_offset}` and chat's
`{content: [{token, logprob, bytes, top_logprobs}]}`. A token's text is the tokenizer's decoding of that one
id, as vLLM writes it."""

from __future__ import annotations

from typing import Sequence

from coordinator.serve.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

Entry = tuple  # (token id, [logprob, [[id, logprob], ...top]])


def completion_logprobs(tokenizer, entries: Sequence[Entry], top: int, offset: int = 0) -> CompletionLogprobs:
    """`top` most likely tokens per position (plus the chosen one when it is not among them, as vLLM does);
    text offsets count from `offset` (the echoed prompt, or what earlier stream chunks sent)."""
    out = CompletionLogprobs()
    for token, (logprob, ranked) in entries:
        text = tokenizer.decode([token])
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        out.text_offset.append(offset)
        offset += len(text)
        ranking = {tokenizer.decode([i]): value for i, value in ranked[:top]}
        ranking.setdefault(text, logprob)
        out.top_logprobs.append(ranking)
    return out


def chat_logprobs(tokenizer, entries: Sequence[Entry], top: int) -> ChatLogprobs:
    content = []
    for token, (logprob, ranked) in entries:
        text = tokenizer.decode([token])
        content.append(TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")),
                                    top_logprobs=[_top(tokenizer, i, value) for i, value in ranked[:top]]))
    return ChatLogprobs(content=content)


def _top(tokenizer, token: int, logprob: float) -> TopLogprob:
    text = tokenizer.decode([token])
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
