"""The head shard's logprobs (shardd.engine.head.logprobs: the raw distribution, as vLLM reports by default) in the
OpenAI response shapes: completions' `{tokens, token_logprobs, top_logprobs, text_offset}` and chat's
`{content: [{token, logprob, bytes, top_logprobs}]}`; the prompt's (an echoed prompt's entries in completions' shape,
and vLLM's `prompt_logprobs`). A token's text is the tokenizer's decoding of that one id, as vLLM writes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from coordinator.serve.protocol import (ChatLogprobs, CompletionLogprobs, PromptLogprob, PromptLogprobs, TokenLogprob,
                                        TopLogprob)

Entry = tuple  # (token id, [logprob, [[id, logprob], ...top]]); a prompt token's entry also has its rank last


def completion_logprobs(tokenizer, entries: Sequence[Entry], top: int, offset: int = 0) -> CompletionLogprobs:
    """`top` most likely tokens per position (plus the chosen one when it is not among them, as vLLM does);
    text offsets count from `offset` (the echoed prompt, or what earlier stream chunks sent)."""
    out = CompletionLogprobs()
    for token, scores in entries:
        logprob, ranked = scores[0], scores[1]
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


def echoed_logprobs(tokenizer, prompt: Sequence[int], scored: Sequence[list], top: int) -> CompletionLogprobs:
    """An echoed prompt's entries in completions' shape, text offsets from 0: the first token's logprob and top
    logprobs are null (nothing comes before it), each later one's come from `scored` (the row before it)."""
    first = tokenizer.decode([prompt[0]])
    out = completion_logprobs(tokenizer, list(zip(prompt[1:], scored)), top, len(first))
    out.tokens.insert(0, first)
    out.token_logprobs.insert(0, None)
    out.top_logprobs.insert(0, None)
    out.text_offset.insert(0, 0)
    return out


def joined(first: CompletionLogprobs, then: Optional[CompletionLogprobs]) -> CompletionLogprobs:
    """`first`'s entries followed by `then`'s."""
    if then is None:
        return first
    return CompletionLogprobs(**{name: getattr(first, name) + getattr(then, name) for name in CompletionLogprobs.model_fields})


def vllm_prompt_logprobs(tokenizer, prompt: Sequence[int], scored: Sequence[list], top: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {id: {logprob, rank, decoded_token}} of
    the prompt's token and the `top` most likely (ranks 1..top)."""
    out: PromptLogprobs = [None]
    for token, (logprob, ranked, rank) in zip(prompt[1:], scored):
        position = {token: PromptLogprob(logprob=logprob, rank=rank, decoded_token=tokenizer.decode([token]))}
        for place, (other, value) in enumerate(ranked[:top], start=1):
            if other not in position:
                position[other] = PromptLogprob(logprob=value, rank=place, decoded_token=tokenizer.decode([other]))
        out.append(position)
    return out


@dataclass(frozen=True)
class CompletionShape:
    """What a completion's choices carry of the head shard's scores: `logprobs` (OpenAI's shape, the echoed
    prompt's entries first with `echo`) and vLLM's `prompt_logprobs`, each None when not asked for."""

    tokenizer: object
    echo: bool
    logprobs: Optional[int]
    prompt_logprobs: Optional[int]

    @property
    def echo_scores(self) -> bool:
        """Whether the choice's logprobs begin with the echoed prompt's."""
        return self.echo and self.logprobs is not None

    def generated(self, entries: Sequence[Entry], offset: int) -> Optional[CompletionLogprobs]:
        return None if self.logprobs is None else completion_logprobs(self.tokenizer, entries, self.logprobs, offset)

    def echoed(self, prompt: Sequence[int], scored: Sequence[list]) -> CompletionLogprobs:
        return echoed_logprobs(self.tokenizer, prompt, scored, self.logprobs)

    def vllm(self, prompt: Sequence[int], scored: Optional[Sequence[list]]) -> Optional[PromptLogprobs]:
        if self.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.tokenizer, prompt, scored, self.prompt_logprobs)
