"""What the fast step's tests share: a batched step's schedule checked row for row against each sequence alone, and
fla's chunked gated delta rule computed by the reference's recurrence (the GPU prefill's path on the CPU)."""

from __future__ import annotations

import torch

from shardd.engine.batch import BatchItem


def ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hidden_rows(shard, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, shard.config.hidden_size, generator=g).to(shard.dtype)


def state_bits(shard, state):
    shard.settle(state)
    kv = [(c.key[:, : state.length].clone(), c.value[:, : state.length].clone()) for c in state.kv.values()]
    return state.length, state.gdn.recurrent.clone(), state.gdn.conv.clone(), kv


def assert_same_state(a, b):
    assert a[0] == b[0]
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert all(torch.equal(x, y) for pair_a, pair_b in zip(a[3], b[3]) for x, y in zip(pair_a, pair_b))


def item(shard, state, pos, n, seed, checkpoint=False, capture=()):
    if shard.owns_embedding:
        return BatchItem(state, pos, tokens=ids(n, shard.config.vocab_size, seed), checkpoint=checkpoint,
                         capture_layers=capture)
    return BatchItem(state, pos, hidden=hidden_rows(shard, n, seed), checkpoint=checkpoint, capture_layers=capture)


def outputs_equal(a, b):
    if a.logits is not None:
        assert torch.equal(a.logits.cpu(), b.logits.cpu()) and a.ids.tolist() == b.ids.tolist()
    else:
        assert torch.equal(a.hidden, b.hidden)
    assert a.captured.keys() == b.captured.keys()
    assert all(torch.equal(a.captured[k], b.captured[k]) for k in a.captured)


def run_schedule(batched, alone, schedule, *, prompts, keeps):
    """Sequences with prompts of different lengths, then batched checkpointed steps of different lengths, each
    rolled back by its own keep: every item's output and every state after it equal the same sequence on
    `alone` (same R), stepped by itself, and so does the state after each rollback."""
    states = [batched.new_state(batched.pools.max_context) for _ in prompts]
    solo = [alone.new_state(alone.pools.max_context) for _ in prompts]
    results = batched.forward_batch([item(batched, s, 0, n, 10 + i) for i, (s, n) in enumerate(zip(states, prompts))])
    for i, n in enumerate(prompts):
        outputs_equal(results[i], alone.forward(solo[i], 0, **_args(item(alone, solo[i], 0, n, 10 + i))))
    for step, lengths in enumerate(schedule):
        capture = (batched.begin,) if step == 0 else ()
        items = [item(batched, s, s.length, n, 100 * step + i, checkpoint=True, capture=capture)
                 for i, (s, n) in enumerate(zip(states, lengths))]
        results = batched.forward_batch(items)
        for i, it in enumerate(items):
            ref = alone.forward(solo[i], it.pos, **_args(it))
            outputs_equal(results[i], ref)
        for i, (s, keep) in enumerate(zip(states, keeps[step])):
            batched.rollback(s, keep)
            alone.rollback(solo[i], keep)
            assert_same_state(state_bits(batched, s), state_bits(alone, solo[i]))


def _args(it: BatchItem) -> dict:
    return dict(tokens=it.tokens, hidden=it.hidden, checkpoint=it.checkpoint, capture_layers=it.capture_layers)


def reference_chunk_rule(q, k, v, *, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """fla's `chunk_gated_delta_rule` calling convention ([1, n, heads, dim] inputs, q/k l2-normalised in the
    kernel), computed by the reference model's token-by-token recurrence (shardd/engine/reference/delta_rule.py)."""
    from shardd.engine.reference.delta_rule import recurrent_delta_rule
    from shardd.engine.reference.gdn import l2_normalize

    assert use_qk_l2norm_in_kernel and output_final_state
    repeat = v.shape[2] // q.shape[2]  # each q/k head serves consecutive value heads
    query = (l2_normalize(q[0].float()) * scale).repeat_interleave(repeat, dim=1).transpose(0, 1)
    key = l2_normalize(k[0].float()).repeat_interleave(repeat, dim=1).transpose(0, 1)
    state = initial_state[0].float().clone()
    core = recurrent_delta_rule(query, key, v[0].float().transpose(0, 1), g[0].float().t(), beta[0].float().t(), state)
    return core.transpose(0, 1)[None].to(v.dtype), state[None]
