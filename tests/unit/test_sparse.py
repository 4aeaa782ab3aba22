"""The sparse-linear target against a slow, explicit reference written here.

The reference runs one sequence token by token: the Gated DeltaNet recurrence as a Python loop
over a full-sequence causal conv, and for sparse attention, per query, the lightning-indexer
score of every key it may see (keys 0..t), the top-k by score (ties to the later position),
and dense softmax attention over exactly those keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specd.batch import ForwardBatch
from specd.models.layers import rotary_tables
from specd.models.loading import load_model, save_model
from specd.models.qwen3_next import LINEAR, apply_partial_rotary
from specd.models.sparse import FLAVOURS, SparseForCausalLM
from specd.tree import TokenTree

CONFIG = FLAVOURS["debug"]


def make_model() -> SparseForCausalLM:
    torch.manual_seed(3)
    return SparseForCausalLM(CONFIG).eval()


def gated_deltanet_reference(m, h):  # h: [T, hidden]
    T = h.shape[0]
    ratio = m.num_value_heads // m.num_key_heads
    qkvz = m.in_proj_qkvz(h).view(T, m.num_key_heads, -1)
    q, k, v, z = torch.split(qkvz, [m.key_head_dim, m.key_head_dim, ratio * m.value_head_dim, ratio * m.value_head_dim], -1)
    b, a = torch.split(m.in_proj_ba(h).view(T, m.num_key_heads, 2 * ratio), [ratio, ratio], -1)
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)  # [T, conv_dim]
    conv = F.conv1d(mixed.t()[None], m.conv1d.weight, padding=m.conv_kernel - 1, groups=m.conv_dim)[0, :, :T]
    q, k, v = torch.split(F.silu(conv).t(), [m.key_dim, m.key_dim, m.value_dim], -1)
    l2norm = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # FLA's, eps inside  # noqa: E731
    q = l2norm(q.reshape(T, m.num_key_heads, -1)).repeat_interleave(ratio, 1) / m.key_head_dim**0.5
    k = l2norm(k.reshape(T, m.num_key_heads, -1)).repeat_interleave(ratio, 1)
    v = v.reshape(T, m.num_value_heads, -1)
    g = -m.A_log.exp() * F.softplus(a.reshape(T, -1) + m.dt_bias)
    beta = b.reshape(T, -1).sigmoid()
    state = torch.zeros(m.num_value_heads, m.key_head_dim, m.value_head_dim)
    outputs = []
    for t in range(T):
        for head in range(m.num_value_heads):
            s = state[head] * g[t, head].exp()
            s = s + torch.outer(k[t, head], beta[t, head] * (v[t, head] - s.t() @ k[t, head]))
            state[head] = s
        outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    out = m.norm(torch.stack(outputs), z.reshape(T, m.num_value_heads, -1)).reshape(T, -1)
    return m.out_proj(out)


def sparse_attention_reference(m, h, rotary):  # h: [T, hidden]
    T = h.shape[0]
    q, k, v, gate = m.qkv(h[None], rotary)  # [1, heads, T, d]
    iq = apply_partial_rotary(m.indexer.wq(h).view(1, T, m.indexer.num_heads, -1).transpose(1, 2), *rotary)[0]
    ik = apply_partial_rotary(m.indexer.k_norm(m.indexer.wk(h))[None, None], *rotary)[0, 0]  # [T, d_I]
    iw = m.indexer.weights_proj(h) * (m.indexer.num_heads * m.indexer.head_dim) ** -0.5  # [T, heads_I]
    group = m.num_heads // m.num_kv_heads
    rows = []
    for t in range(T):
        score = [float((iw[t] * torch.relu(iq[:, t] @ ik[s])).sum()) for s in range(t + 1)]
        chosen = sorted(range(t + 1), key=lambda s: (-score[s], -s))[: m.top_k]
        heads = []
        for head in range(m.num_heads):
            keys, values = k[0, head // group, chosen], v[0, head // group, chosen]
            weights = torch.softmax(keys @ q[0, head, t] / m.head_dim**0.5, dim=0)
            heads.append(weights @ values)
        rows.append(torch.cat(heads))
    return m.o_proj(torch.stack(rows) * torch.sigmoid(gate[0]))


@torch.no_grad()
def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    c = model.config
    x = model.model.embed_tokens(torch.tensor(tokens))
    rotary = rotary_tables(torch.arange(len(tokens))[None], c.rotary_dim, c.rope_theta, x.dtype)
    for layer in model.model.layers:
        h = layer.input_layernorm(x)
        if layer.layer_type == LINEAR:
            x = x + gated_deltanet_reference(layer.linear_attn, h)
        else:
            x = x + sparse_attention_reference(layer.self_attn, h, rotary)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))


MODEL = make_model()
PROMPTS = [[(37 * i + 11) % 512 for i in range(18)], [3, 1, 4, 1, 5, 9, 2, 6], [400, 401, 402, 403, 404, 405, 7, 7, 7, 7, 7]]


def test_chunked_prefill_and_decode_match_reference():
    cache = MODEL.new_cache(len(PROMPTS), capacity=4)
    batch = ForwardBatch.causal(PROMPTS, cache.lengths.tolist())
    with torch.no_grad():
        logits = MODEL(batch, cache)  # ragged prefill: several GDN chunks, top-4 of up to 18 keys
    cache.commit(batch, [list(range(len(p))) for p in PROMPTS])
    worst = max((logits[b, : len(p)] - reference_logits(MODEL, p)).abs().max().item() for b, p in enumerate(PROMPTS))
    sequences = [list(p) for p in PROMPTS]
    for step in range(12):
        tokens = [[(5 * step + 17 * b + 2) % 512] for b in range(len(PROMPTS))]
        batch = ForwardBatch.causal(tokens, cache.lengths.tolist())
        with torch.no_grad():
            logits = MODEL(batch, cache)
        cache.commit(batch, [[0]] * len(PROMPTS))
        for b, token in enumerate(tokens):
            sequences[b] += token
        if step % 4 == 3:  # the reference is slow: check every few steps (the cache carries all)
            for b, sequence in enumerate(sequences):
                worst = max(worst, (logits[b, 0] - reference_logits(MODEL, sequence)[-1]).abs().max().item())
    print(f"sparse prefill+decode vs reference: {worst:.2e}")
    assert worst < 1e-5


def test_tree_matches_reference_per_path():
    context = PROMPTS[0]
    cache = MODEL.new_cache(1)
    prefill = ForwardBatch.causal([context], [0])
    with torch.no_grad():
        MODEL(prefill, cache)
    cache.commit(prefill, [list(range(len(context)))])
    # Branches at the end, inside a GDN chunk of the context, and at 0; one deeper than a chunk.
    tree = TokenTree.from_paths([
        (18, [1, 2, 3, 4, 5, 6, 7]), (18, [1, 2, 9]), (18, [8]), (13, [20, 21, 22]), (13, [20, 30]), (6, [5, 5]), (0, [44]),
    ])
    batch = ForwardBatch.from_trees([tree], cache.lengths)
    with torch.no_grad():
        logits = MODEL(batch, cache)
    worst = 0.0
    for node in range(tree.num_nodes):
        sequence = context[: int(tree.anchors[node])] + tree.tokens[tree.path(node)].tolist()
        worst = max(worst, (logits[0, node] - reference_logits(MODEL, sequence)[-1]).abs().max().item())
    print(f"sparse tree vs reference: {worst:.2e}")
    assert worst < 1e-5


def test_save_and_load_round_trip(tmp_path):
    save_model(MODEL, tmp_path)
    loaded = load_model(tmp_path)
    assert type(loaded) is SparseForCausalLM and loaded.config == MODEL.config
    batch = ForwardBatch.causal([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(MODEL(batch), loaded(batch))


def test_training_step_trains_the_indexer_through_its_kl_loss():
    torch.manual_seed(0)
    model = SparseForCausalLM(CONFIG).train()
    inputs = torch.randint(0, 512, (2, 16))
    logits = model(ForwardBatch.dense(inputs))
    logits.float().logsumexp(-1).mean().backward()
    indexer = model.model.layers[1].self_attn.indexer
    assert indexer.wq.weight.grad is not None and indexer.wq.weight.grad.abs().sum() > 0
