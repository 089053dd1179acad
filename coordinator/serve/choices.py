"""A request's choices: one GenerateParams each (what the request may cost checked first), run together, counted."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

from coordinator.guided import GrammarError
from coordinator.serve.chat import chat_prompt
from coordinator.serve.engine import Engine, GenerateParams
from coordinator.serve.errors import refuse
from coordinator.serve.limits import MAX_CHOICE_TOKENS, MAX_CHOICES, MAX_STOP_CHARS, MAX_STOP_STRINGS
from coordinator.serve.protocol import ChatCompletionRequest, UsageInfo, response_format_grammar
from coordinator.serve.tools import END as TOOL_CALL_END
from coordinator.serve.tools import START as TOOL_CALL_START
from coordinator.serve.tools import ToolError, check_tool_choice, tool_call_grammar


def grammar_of(response_format):
    try:
        return response_format_grammar(response_format)
    except GrammarError as error:
        refuse(str(error), error.param)


def max_tokens_of(engine: Engine, requested: Optional[int], prompt_len: int, default: int) -> int:
    """vLLM's answer to a budget beyond the context: 400; no budget: the default, cut to the room left."""
    room = engine.max_context - prompt_len
    if requested is None:
        return min(default, room)
    if requested > room:
        refuse(f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum context "
               f"length is {engine.max_context} tokens and your request has {prompt_len} input tokens "
               f"({requested} > {engine.max_context} - {prompt_len}).", "max_tokens")
    return requested


def params_of(engine: Engine, body, prompt_ids: list[int], max_tokens: Optional[int], default_max: int,
              logprobs: Optional[int], prompt_logprobs: Optional[int] = None, grammar=None) -> list[GenerateParams]:
    """One GenerateParams per choice; choice i samples with seed + i. What a request may cost is checked here,
    before anything is admitted: its choices, their tokens, its stop strings, its grammar (compiled).
    `prompt_logprobs`: the prompt is scored, with so many top logprobs per position."""
    engine.check_prompt(prompt_ids)
    if grammar is not None:
        engine.compile(grammar)
    stop = body.stop_strings()
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        refuse(f"'stop' holds at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each "
               f"(got {len(stop)}, the longest {max(map(len, stop))})", "stop")
    if body.n > MAX_CHOICES:
        refuse(f"'n' is at most {MAX_CHOICES} on this server (got {body.n})", "n")
    sampling = engine.sampling(body.temperature, body.top_p, body.top_k, body.seed,
                               presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                               repetition_penalty=body.repetition_penalty, logprobs=logprobs)
    budget = max_tokens_of(engine, max_tokens, len(prompt_ids), default_max)
    if body.n * budget > MAX_CHOICE_TOKENS:
        refuse(f"'n' x 'max_tokens' is at most {MAX_CHOICE_TOKENS} tokens on this server (got {body.n} x "
               f"{budget})", "n")
    first = GenerateParams(
        prompt_ids=prompt_ids,
        max_tokens=budget,
        sampling=sampling,
        stop=stop,
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        cache_salt=body.cache_salt or "",
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
    )
    return [dataclasses.replace(first, sampling=dataclasses.replace(sampling, seed=(sampling.seed + i) % (1 << 63)))
            for i in range(body.n)]


async def chat_choices(engine: Engine, body: ChatCompletionRequest) -> tuple[list[GenerateParams], Optional[int], bool]:
    """A chat request's choices, its top logprobs (None: none asked) and whether tool calls are parsed."""
    if body.top_logprobs is not None and not body.logprobs:
        refuse("when using 'top_logprobs', 'logprobs' must be set to true", "top_logprobs")
    try:
        parse_tools = check_tool_choice(body.tools, body.tool_choice)
        calls = tool_call_grammar(body.tools, body.tool_choice, parallel=body.parallel_tool_calls is not False)
    except ToolError as error:
        refuse(str(error), "tool_choice")
    grammar = grammar_of(body.response_format)
    if grammar is not None and calls is not None:
        refuse("'response_format' and a tool_choice that requires a call constrain the output twice; send one",
               "response_format")
    ids = await asyncio.to_thread(  # on a worker thread: a template and a tokenizer take time
        chat_prompt, engine, body.messages, body.tools, body.add_generation_prompt, body.chat_template_kwargs)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    choices = await asyncio.to_thread(  # a grammar compiles on a worker thread
        lambda: params_of(engine, body, ids, max_tokens, engine.max_context - len(ids), top, grammar=grammar or calls))
    if parse_tools:  # a tokenizer that marks the call markers special must not strip them from the text parsed
        markers = engine.tokenizer.special_ids(TOOL_CALL_START, TOOL_CALL_END)
        choices = [dataclasses.replace(choice, shown_special=markers) for choice in choices]
    return choices, top, parse_tools


async def complete_all(engine: Engine, choices: list[GenerateParams]) -> list:
    """Every choice's (text, result, logprobs); the first failure cancels the others and is raised as itself."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(engine.complete(params)) for params in choices]
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]


def usage_of(results, per_prompt: Optional[int] = None) -> UsageInfo:
    """The results of one request's choices, `per_prompt` of each prompt (default: all of one prompt): each
    prompt (and its cached prefix) counted once, every choice's tokens."""
    results = results if isinstance(results, list) else [results]
    per_prompt = per_prompt or len(results) or 1
    prompt = cached = 0
    for start in range(0, len(results), per_prompt):
        done = [r for r in results[start:start + per_prompt] if r is not None]
        prompt += done[0].prompt_tokens if done else 0
        cached += done[0].cached_tokens if done else 0
    completion = sum(len(result.tokens) for result in results if result is not None)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})
