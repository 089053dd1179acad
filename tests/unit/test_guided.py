"""Constrained decoding (coordinator.guided, the head's token mask): output that keeps to its grammar, speculation
that changes nothing of it (greedy: the same tokens for every drafter and rollback mode; sampled: the same
distribution, by chi-square), a batch of different grammars equal to each alone, a compiled grammar cached, and the
wire's `token_mask` checked before anything runs."""

from __future__ import annotations

import json
from collections import Counter
from typing import Annotated, Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

pytest.importorskip("xgrammar")

from coordinator.drafting.drafters import NgramDrafter, OracleDrafter  # noqa: E402
from coordinator.guided import GrammarCompiler, GrammarError, GrammarSpec  # noqa: E402
from coordinator.sampling import Sampling  # noqa: E402
from coordinator.scheduler.requests import Request  # noqa: E402
from coordinator.scheduler.scheduler import decode_all  # noqa: E402
from coordinator.tokenizer import HFTokenizer  # noqa: E402
from protocol import ErrorCode, Forward, ForwardBatch, ProtocolError, WireTensor, decode_request, encode_request  # noqa: E402
from protocol.layout import CHECKPOINT, REPLAY, REPLAY_SSM  # noqa: E402
from shardd.engine.head.answer import HeadRequest, allowed_tokens, answer_batch  # noqa: E402
from shardd.engine.head.sampling import SamplingParams  # noqa: E402
from shardd.engine.reference.rollback import RollbackStorage  # noqa: E402
from shardd.local import LocalTarget  # noqa: E402
from shardd.weights.loading import ModelSource  # noqa: E402
from tests.support.stats import chi2_critical, two_sample_chi2  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "member": {"type": "boolean"}},
          "required": ["name", "age", "member"], "additionalProperties": False}
COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "shades": {"type": "array", "items": {"type": "integer", "maximum": 9},
                                                      "maxItems": 3}},
          "required": ["colour", "shades"]}
NEW = 60


def tiny(mode: str = CHECKPOINT) -> LocalTarget:
    return LocalTarget(ModelSource(synthetic="tiny"), splits=[(0, 3), (3, 6)], storage=RollbackStorage(mode, 16))


@pytest.fixture(scope="module")
def local():
    return tiny()


@pytest.fixture(scope="module")
def compiler(local):
    vocab = local.config.vocab_size
    return GrammarCompiler(HFTokenizer.synthetic_for(vocab), vocab)


@pytest.fixture(scope="module")
def tokenizer(local):
    return HFTokenizer.synthetic_for(local.config.vocab_size)


def decode(local, compiler, prompt, schema, *, drafter=None, sampling=None, rollback=CHECKPOINT, n=1):
    requests = [Request(prompt, NEW, sampling=sampling, drafter=drafter() if drafter else None, block_size=4,
                        guide=compiler.guide(GrammarSpec.json_schema(schema))) for _ in range(n)]
    return decode_all(local, requests, rollback=rollback)


class Person(BaseModel):  # PERSON, as pydantic checks it
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    member: bool


class Colour(BaseModel):  # COLOUR
    model_config = ConfigDict(strict=True)
    colour: Literal["red", "green", "blue"]
    shades: list[Annotated[int, Field(le=9)]] = Field(max_length=3)


def test_greedy_output_keeps_to_its_schema(local, compiler, tokenizer):
    for schema, model in ((PERSON, Person), (COLOUR, Colour)):
        (result,) = decode(local, compiler, tokenizer.encode("Write JSON: "), schema)
        assert result.finish_reason == "stop" and len(result.tokens) < NEW
        model.model_validate(json.loads(tokenizer.decode(result.tokens), strict=False))  # raw control characters may occur


@pytest.mark.parametrize("rollback", [CHECKPOINT, REPLAY_SSM, REPLAY])
def test_speculation_gives_the_plain_constrained_tokens(local, compiler, tokenizer, rollback):
    prompt = tokenizer.encode("Write JSON: ")
    local = tiny(REPLAY_SSM) if rollback == REPLAY_SSM else local
    (plain,) = decode(local, compiler, prompt, PERSON)
    (ngram,) = decode(local, compiler, prompt, PERSON, drafter=NgramDrafter, rollback=rollback)
    # the oracle knows the answer but for a wrong token per block, some of which the grammar forbids
    oracle = lambda: OracleDrafter(plain.tokens, len(prompt), lambda rng: rng.randrange(4), seed=3)  # noqa: E731
    (spoken,) = decode(local, compiler, prompt, PERSON, drafter=oracle, rollback=rollback)
    assert ngram.tokens == plain.tokens and spoken.tokens == plain.tokens
    assert spoken.accepted > 0 and spoken.steps < len(plain.tokens)


def test_a_draft_the_grammar_forbids_costs_no_row(local, compiler, tokenizer):
    """A drafter that always guesses a byte no JSON starts with: every block is cut to the target's own row."""
    prompt = tokenizer.encode("Write JSON: ")

    class Wrong:
        name = "wrong"

        def propose(self, history, n):
            return [ord("~")] * n

    (plain,) = decode(local, compiler, prompt, COLOUR)
    (wrong,) = decode(local, compiler, prompt, COLOUR, drafter=Wrong)
    assert wrong.tokens == plain.tokens and wrong.drafted == 0


def test_a_batch_of_grammars_equals_each_alone(local, compiler, tokenizer):
    prompts = [tokenizer.encode(text) for text in ("Write JSON: ", "A colour: ", "Someone: ")]
    schemas = [PERSON, COLOUR, PERSON]
    alone = [decode(local, compiler, prompt, schema)[0].tokens for prompt, schema in zip(prompts, schemas)]
    unconstrained = Request(prompts[0], 12)
    requests = [Request(prompt, NEW, drafter=NgramDrafter(), block_size=4,
                        guide=compiler.guide(GrammarSpec.json_schema(schema)))
                for prompt, schema in zip(prompts, schemas)]
    together = decode_all(local, [*requests, unconstrained])
    assert [result.tokens for result in together[:3]] == alone
    assert together[3].tokens == decode_all(local, [Request(prompts[0], 12)])[0].tokens  # no mask: untouched


def test_sampling_under_a_mask_is_lossless(local, compiler, tokenizer):
    """The first tokens of a sampled value, plain and speculative (ngram), by chi-square over seeds."""
    prompt = tokenizer.encode("Colour: ")
    schema = {"type": "object", "properties": {"c": {"type": "string", "maxLength": 3}}, "required": ["c"]}

    def counts(drafter) -> Counter:
        requests = [Request(prompt, 8, sampling=Sampling(temperature=1.0, seed=seed), drafter=drafter and drafter(),
                            block_size=4, guide=compiler.guide(GrammarSpec.json_schema(schema)))
                    for seed in range(200)]
        return Counter(tuple(result.tokens[6:8]) for result in decode_all(local, requests))

    plain, speculated = counts(None), counts(NgramDrafter)
    assert len(plain) > 5
    stat, df = two_sample_chi2(plain, speculated)
    assert stat < chi2_critical(df), (stat, df)


def test_the_masked_sampler_draws_from_the_renormalised_distribution():
    """answer_batch with a mask: every draw allowed, frequencies those of softmax over the allowed tokens."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0] * 5])
    allowed = [1, 4, 6, 33, 38]
    mask = torch.zeros((1, 2), dtype=torch.int32)
    for token in allowed:
        mask[0, token // 32] |= 1 << (token % 32)
    answers = answer_batch([(logits, [0], 0, HeadRequest(SamplingParams(1.0, seed=seed), token_mask=mask))
                            for seed in range(4000)])
    drawn = Counter(ids[0] for ids, _, _ in answers)
    assert set(drawn) <= set(allowed)
    probs = torch.softmax(logits[0, allowed], dim=-1)
    expected = Counter({token: float(p) * 4000 for token, p in zip(allowed, probs)})
    stat, df = two_sample_chi2(drawn, Counter({k: round(v) for k, v in expected.items()}))
    assert stat < chi2_critical(df), (stat, df, drawn)
    greedy = answer_batch([(logits, [0], 0, HeadRequest(token_mask=mask))])[0][0]
    assert greedy == [1]  # the argmax of the allowed tokens, not of the row


def test_allowed_tokens_reads_bit_31():
    mask = torch.tensor([[-(1 << 31), 1]], dtype=torch.int32)  # tokens 31 and 32
    assert allowed_tokens(mask, 40).nonzero()[:, 1].tolist() == [31, 32]


def test_a_compiled_grammar_is_cached_and_a_bad_schema_is_named(compiler):
    spec = GrammarSpec.json_schema(PERSON)
    assert compiler.compile(spec) is compiler.compile(GrammarSpec.json_schema(dict(PERSON)))
    with pytest.raises(GrammarError, match="frob") as refused:
        compiler.compile(GrammarSpec.json_schema({"type": "frob"}))
    assert refused.value.param == "response_format"
    with pytest.raises(GrammarError, match="not among"):
        GrammarSpec.tool_calls([{"name": "a"}], "b", parallel=False)


def test_a_tool_call_grammar_writes_qwens_tags(local, compiler, tokenizer):
    from coordinator.serve.tools import parse_tool_calls

    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}, {"name": "noop"}]
    guide = compiler.guide(GrammarSpec.tool_calls(tools, "get_weather", parallel=False))
    (result,) = decode_all(local, [Request(tokenizer.encode("Call: "), 80, guide=guide)])
    assert result.finish_reason == "stop"
    _, calls = parse_tool_calls(tokenizer.decode(result.tokens))
    assert [call.function.name for call in calls] == ["get_weather"]
    assert set(json.loads(calls[0].function.arguments)) == {"city"}


# ---- the wire ------------------------------------------------------------------------------------

def mask_of(rows: int, words: int = 10) -> WireTensor:
    return WireTensor.from_torch(torch.full((rows, words), -1, dtype=torch.int32))


def test_the_token_mask_travels_per_item_and_bad_shapes_are_refused():
    masked = Forward(id=0, seq=1, pos=0, tokens=[5, 6, 7], drafts=[6, 7], mask_rows=3, token_mask=mask_of(3))
    batch = decode_request(encode_request(ForwardBatch(id=1, items=(masked, Forward(id=0, seq=2, pos=0, tokens=[1])))))
    assert batch.items[0].token_mask.shape == (3, 10) and batch.items[1].token_mask is None
    bad = [
        dict(mask_rows=2, token_mask=mask_of(2)),  # not the answered rows (len(drafts) + 1)
        dict(mask_rows=3, token_mask=mask_of(2)),  # rows disagree with mask_rows
        dict(token_mask=mask_of(3)),  # without mask_rows
        dict(mask_rows=3),  # without the tensor
    ]
    for fields in bad:
        with pytest.raises(ProtocolError) as refused:
            encode_request(Forward(id=0, seq=1, pos=0, tokens=[5, 6, 7], drafts=[6, 7], **fields))
        assert refused.value.code == ErrorCode.BAD_REQUEST
    floats = WireTensor.from_torch(torch.zeros((3, 10)))
    frames = encode_request(Forward(id=0, seq=1, pos=0, tokens=[5, 6, 7], drafts=[6, 7], mask_rows=3,
                                    token_mask=floats), validate=False)
    with pytest.raises(ProtocolError, match="int32"):
        decode_request(frames)


def test_the_head_shard_checks_the_mask_width():
    """One int32 word per 32 tokens of the model's vocabulary, on the head shard only (BAD_REQUEST otherwise)."""
    from shardd.server.handlers.forward import check_token_mask

    class Head:
        owns_head = True

        class config:
            vocab_size = 320

    check_token_mask(mask_of(1, 10), Head)
    with pytest.raises(ProtocolError, match="11 words per row") as refused:
        check_token_mask(mask_of(1, 11), Head)
    assert refused.value.code == ErrorCode.BAD_REQUEST
    Head.owns_head = False
    with pytest.raises(ProtocolError, match="without the head"):
        check_token_mask(mask_of(1, 10), Head)
