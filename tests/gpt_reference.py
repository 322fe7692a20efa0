"""An independent NumPy implementation of the GPT of examples/gpt_text.sched, written from its
model lines and the papers (not from the kernels): pre-norm blocks of causal multi-head
self-attention (einsum over [b, t, heads, dh], -inf above the diagonal) and a GELU MLP, torch-style
layer norm, learned token and position embeddings.  Used by tests/test_examples.py and
tests/test_gpt_text.py, in float64."""

from __future__ import annotations

import numpy as np


def layer_norm(x, g, b, eps=1e-5):
    m = x.mean(axis=-1, keepdims=True)
    v = ((x - m) ** 2).mean(axis=-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * g + b


def gelu(z):
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z * z * z)))


def causal_attention(q, k, v, b, t, heads):
    dh = q.shape[1] // heads
    Q, K, V = (a.reshape(b, t, heads, dh) for a in (q, k, v))
    s = np.einsum("bihe,bjhe->bhij", Q, K, optimize=True) / np.sqrt(dh)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bjhe->bihe", p, V, optimize=True).reshape(b * t, heads * dh)


def gpt_logits(p, x, layers=2, heads=4):
    """Logits [b * t, vocab] of byte windows x [b, t] under the parameters p (name -> array)."""
    b, t = x.shape
    h = p["tok.table"][np.asarray(x).reshape(-1)] + np.tile(p["h0.table"], (b, 1))
    for i in range(1, layers + 1):
        n = layer_norm(h, p[f"n{i}.gamma"], p[f"n{i}.beta"])
        q, k, v = (n @ p[f"{c}{i}.w"] + p[f"{c}{i}.b"] for c in "qkv")
        r = h + causal_attention(q, k, v, b, t, heads) @ p[f"o{i}.w"] + p[f"o{i}.b"]
        m = layer_norm(r, p[f"m{i}.gamma"], p[f"m{i}.beta"])
        h = r + gelu(m @ p[f"f{i}.w"] + p[f"f{i}.b"]) @ p[f"p{i}.w"] + p[f"p{i}.b"]
    nf = layer_norm(h, p["nf.gamma"], p["nf.beta"])
    if "logits.w" not in p:  # the output projection tied to the token embedding (unembed)
        return nf @ p["tok.table"].T
    return nf @ p["logits.w"] + p["logits.b"]


def cross_entropy_sum(z, labels):
    """The summed (not mean) cross-entropy of logits z [n, c] against labels [n], in float64."""
    z = z - z.max(axis=1, keepdims=True)
    return float((np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(z)), labels]).sum())


def gpt_loss(p, x, y, layers=2, heads=4):
    """The mean next-byte cross-entropy (nats) of windows x [b, t] with labels y [b, t]."""
    return cross_entropy_sum(gpt_logits(p, x, layers, heads), np.asarray(y).reshape(-1)) / np.asarray(y).size
