"""The CPU stand-in for MiniMax-M3's sparse attention (tooling/src/kvbroker_tools/serving/minimax.py).

What the PD tests lean on: the stand-in stores K, V and the index K through SGLang's own pool, reads
them back from it, and picks the blocks it attends over by the index K, so a wrong index K in the
pool changes the answer. Pure-logic checks of the block choice first, then the stand-in installed on
SGLang's real `MiniMaxSparseAttnBackend` over a real `MiniMaxSparseKVPool`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvbroker_tools.serving.cpu_torchvision import declare_torchvision_ops

declare_torchvision_ops()

from kvbroker_tools.serving import minimax  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, INDEX_HEADS, INDEX_DIM = 4, 2, 16, 2, 16
SPARSE = [3, 4, 5, 6]


def test_a_short_context_attends_every_block():
    idx_q = torch.randn(INDEX_HEADS, INDEX_DIM)
    for pos in range(minimax.TOPK * minimax.BLOCK):
        chosen = minimax.select_blocks(idx_q, torch.randn(pos + 1, INDEX_DIM), pos, KV_HEADS, minimax.BLOCK,
                                       minimax.TOPK, minimax.INIT, minimax.LOCAL, 1.0)
        assert chosen.all(), pos


def test_the_free_blocks_are_those_the_index_k_scores_highest():
    block, topk, init, local = 2, 4, 1, 1
    pos = 19  # 10 blocks: block 0 and block 9 are forced, two of 1..8 are chosen
    idx_q = torch.zeros(INDEX_HEADS, INDEX_DIM)
    idx_q[:, 0] = 1.0
    idx_k = torch.zeros(pos + 1, INDEX_DIM)
    idx_k[5 * block + 1, 0] = 3.0  # block 5 scores 3 by its second token (score type "max")
    idx_k[2 * block, 0] = 2.0  # block 2 scores 2
    idx_k[8 * block, 0] = 1.0  # block 8 scores 1: left out
    chosen = minimax.select_blocks(idx_q, idx_k, pos, KV_HEADS, block, topk, init, local, 1.0)
    assert chosen.tolist() == [[b in (0, 2, 5, 9) for b in range(10)]] * KV_HEADS
    idx_k[8 * block, 0] = 4.0  # now block 8 outscores block 2
    chosen = minimax.select_blocks(idx_q, idx_k, pos, KV_HEADS, block, topk, init, local, 1.0)
    assert chosen.tolist() == [[b in (0, 5, 8, 9) for b in range(10)]] * KV_HEADS


def test_equal_scores_choose_the_lowest_blocks():
    pos = 19
    chosen = minimax.select_blocks(torch.ones(INDEX_HEADS, INDEX_DIM), torch.zeros(pos + 1, INDEX_DIM), pos,
                                   KV_HEADS, 2, 4, 1, 1, 1.0)
    assert chosen.tolist() == [[b in (0, 1, 2, 9) for b in range(10)]] * KV_HEADS


def test_with_every_block_chosen_it_is_causal_attention():
    n = minimax.TOPK * minimax.BLOCK
    q, k, v = torch.randn(n, HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
    out = minimax.sparse_attention(q, k, v, torch.randn(n, INDEX_HEADS, INDEX_DIM), torch.randn(n, INDEX_DIM),
                                   list(range(n)), 0.25, 0.25, minimax.BLOCK, minimax.TOPK, minimax.INIT,
                                   minimax.LOCAL)
    rep = HEADS // KV_HEADS
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1),
        is_causal=True, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# The stand-in on SGLang's backend class and pool.

PROMPT = 20  # > TOPK * BLOCK: the index K decides blocks


@pytest.fixture(scope="module")
def sglang_backend():
    from sglang.srt.layers.attention.minimax_sparse_backend import MiniMaxSparseAttnBackend
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

    minimax.install()
    pool = MiniMaxSparseKVPool(size=64, page_size=1, dtype=torch.float32, head_num=KV_HEADS, head_dim=HEAD_DIM,
                               idx_head_dim=INDEX_DIM, dense_layer_ids=[0, 1, 2], sparse_layer_ids=SPARSE,
                               disable_value_sparse_layer_ids=SPARSE, device="cpu", start_layer=0, end_layer=7)
    backend = object.__new__(MiniMaxSparseAttnBackend)  # what the stand-in reads of the backend SGLang builds
    backend.kv_pool = pool
    backend.req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    backend.disable_value_layer_ids = set(SPARSE)
    backend.idx_head_dim = INDEX_DIM
    backend.block_size_k, backend.topk_blocks = minimax.BLOCK, minimax.TOPK
    backend.init_blocks, backend.local_blocks = minimax.INIT, minimax.LOCAL
    return backend


def _layer(layer_id=3):
    return SimpleNamespace(layer_id=layer_id, scaling=HEAD_DIM**-0.5, tp_q_head_num=HEADS, qk_head_dim=HEAD_DIM,
                           v_head_dim=HEAD_DIM, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS, k_scale_float=None,
                           v_scale_float=None, idx_k_scale_float=None, idx_v_scale_float=None, k_scale=None,
                           v_scale=None)


def _batch(slots, seq_len, extend):
    return SimpleNamespace(out_cache_loc=slots, seq_lens_cpu=torch.tensor([seq_len]), extend_seq_lens_cpu=[extend],
                           req_pool_indices=torch.tensor([1]), minimax_m3_precached_sparse_layers=None)


def _step(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HEADS, HEAD_DIM, generator=g), torch.randn(n, KV_HEADS, HEAD_DIM, generator=g),
            torch.randn(n, KV_HEADS, HEAD_DIM, generator=g), torch.randn(n, INDEX_HEADS, INDEX_DIM, generator=g),
            torch.randn(n, 1, INDEX_DIM, generator=g))


def test_it_stores_through_the_pool_and_reads_the_index_k_back_from_it(sglang_backend):
    """A prefill of 20 tokens, then a decode step: the decode's answer changes when the prompt's index-K
    pages in the pool change (as a transfer that lost them would leave them), and not otherwise."""
    backend, layer = sglang_backend, _layer()
    assert type(backend).forward_extend is minimax._forward_extend
    slots = torch.randperm(63)[:PROMPT + 1] + 1  # scattered slots, as SGLang's allocator hands them out
    backend.req_to_token[1, :PROMPT + 1] = slots.to(torch.int32)
    q, k, v, idx_q, idx_k = _step(PROMPT, seed=1)
    _, out = backend.forward_extend(q, k, v, layer, _batch(slots[:PROMPT], PROMPT, PROMPT), idx_q=idx_q,
                                    idx_k=idx_k, idx_v=None)
    index_k = backend.kv_pool.get_index_k_buffer(layer.layer_id)
    assert torch.equal(index_k[slots[:PROMPT]], idx_k)
    assert torch.equal(backend.kv_pool.get_kv_buffer(layer.layer_id)[0][slots[:PROMPT]], k)
    want = minimax.sparse_attention(q, k, v, idx_q, idx_k[:, 0], list(range(PROMPT)), layer.scaling,
                                    INDEX_DIM**-0.5, minimax.BLOCK, minimax.TOPK, minimax.INIT, minimax.LOCAL)
    assert torch.equal(out, want.reshape(PROMPT, -1))

    step = _step(1, seed=2)

    def decode():
        q1, k1, v1, iq1, ik1 = step
        return backend.forward_decode(q1, k1, v1, layer, _batch(slots[PROMPT:], PROMPT + 1, 1), idx_q=iq1,
                                      idx_k=ik1, idx_v=None)[1]

    first = decode()
    assert torch.equal(decode(), first)  # deterministic
    saved = index_k[slots[:PROMPT]].clone()
    index_k[slots[:PROMPT]] = 0
    assert not torch.equal(decode(), first)
    index_k[slots[:PROMPT]] = -saved
    assert not torch.equal(decode(), first)
    index_k[slots[:PROMPT]] = saved
    assert torch.equal(decode(), first)


def test_the_switch_perturbs_the_index_k_as_read(sglang_backend, tmp_path, monkeypatch):
    backend, layer = sglang_backend, _layer(4)
    slots = torch.arange(PROMPT) + 30
    backend.req_to_token[1, :PROMPT] = slots.to(torch.int32)
    q, k, v, idx_q, idx_k = _step(PROMPT, seed=3)

    def extend():
        return backend.forward_extend(q, k, v, layer, _batch(slots, PROMPT, PROMPT), idx_q=idx_q, idx_k=idx_k,
                                      idx_v=None)[1]

    switch = tmp_path / "index-k"
    monkeypatch.setenv(minimax.CORRUPT_ENV, str(switch))
    clean = extend()
    switch.write_text("zero")
    zeroed = extend()
    switch.write_text("negate")
    negated = extend()
    switch.unlink()
    assert torch.equal(extend(), clean)
    assert not torch.equal(zeroed, clean) and not torch.equal(negated, clean)
    switch.write_text("garbage")
    with pytest.raises(ValueError, match=r"must hold 'zero' or 'negate'"):
        extend()


def test_a_layer_with_an_index_v_is_refused(sglang_backend):
    backend = sglang_backend
    q, k, v, idx_q, idx_k = _step(2, seed=4)
    backend.disable_value_layer_ids = set(SPARSE) - {5}
    try:
        with pytest.raises(NotImplementedError, match="layer 5 has an index V"):
            backend.forward_extend(q, k, v, _layer(5), _batch(torch.tensor([40, 41]), 2, 2), idx_q=idx_q,
                                   idx_k=idx_k, idx_v=idx_k)
    finally:
        backend.disable_value_layer_ids = set(SPARSE)


def test_randomized_weights_are_the_same_in_every_process_and_not_the_dummy_scale():
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(64, 32, bias=False)
    model.input_layernorm = torch.nn.Module()
    model.input_layernorm.weight = torch.nn.Parameter(torch.empty(64))
    twin = torch.nn.Module()
    twin.proj = torch.nn.Linear(64, 32, bias=False)
    twin.input_layernorm = torch.nn.Module()
    twin.input_layernorm.weight = torch.nn.Parameter(torch.empty(64))
    with torch.no_grad():
        minimax.randomize_weights(model)
        minimax.randomize_weights(twin)
    assert torch.equal(model.proj.weight, twin.proj.weight)
    assert torch.equal(model.input_layernorm.weight, torch.ones(64))
    assert 0.5 < float(model.proj.weight.detach().std() * 64**0.5) < 2.0


# A real SGLang 0.5.23 server of the MiniMax model, started as the serving tools start theirs.

SERVER_START_S = 900.0  # one server starts in about two minutes on 2 idle cores; far longer on busy ones


@pytest.mark.integration
@pytest.mark.timeout(SERVER_START_S + 300)
async def test_a_server_answers_deterministically_and_the_answer_depends_on_the_index_k(tmp_path):
    """Greedy tokens of a plain server of the model: the same prompt twice (the second from its radix
    cache) gives the same tokens; with the index K read as zeros, or negated, every prompt's tokens
    change; with the switch off again they are back."""
    import aiohttp

    from kvbroker_tools.serving import client, stack

    switch = tmp_path / "index-k"
    server = await stack.start_reference(minimax.minimax(), tmp_path, args=minimax.SERVER_ARGS,
                                         env={"KVBROKER_SERVING_MINIMAX": "1", **minimax.SERVER_ENV,
                                              minimax.CORRUPT_ENV: str(switch)},
                                         timeout=SERVER_START_S)
    try:
        prompts = client.prompts(3, 24, seed=20)  # 24 tokens: 12 blocks, of which the index K picks 2

        async def answers():
            async with aiohttp.ClientSession() as session:
                return [(await client.generate(session, server.url, p, 8)).output_ids for p in prompts]

        clean = await answers()
        assert await answers() == clean
        switch.write_text("zero")
        zeroed = await answers()
        switch.write_text("negate")
        negated = await answers()
        switch.unlink()
        assert await answers() == clean
        for i in range(len(prompts)):
            assert zeroed[i] != clean[i] and negated[i] != clean[i], (i, clean[i], zeroed[i], negated[i])
    finally:
        await server.stop()
