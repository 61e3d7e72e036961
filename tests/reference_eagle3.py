"""PyTorch references of the EAGLE authors' draft models, written after their code, not ours.

`Eagle3Reference` follows `eagle/model/cnets.py`: `Model.forward` (the input embedding of each entry's
token, the FC over the concatenated aux features when they arrive 3D wide, the draft layer, its KV
cache as (k, v) tensors it concatenates to) and `LlamaDecoderLayeremb.forward` (residual = the fed
hidden state; input_layernorm(emb) and hidden_norm(hidden) concatenated into a 2D-wide attention
whose q/k/v read 2D; post-attention norm and MLP), scored as `topK_genrate` does: lm_head(norm(out))
over the draft vocabulary, draft id i being target id i + d2t[i]. Three published variants on top, as
speculators defines them (`models/eagle3/model_definitions.py`, `core.py`): norm_before_residual
(residual = hidden_norm(hidden)), fc_norm (an RMSNorm per aux feature before the FC), norm_output
(the next step is fed norm(out), and lm_head reads it without another norm).

`Eagle1Reference` follows `eagle/model/cnets1.py`: x = fc(cat(emb, hidden)) with bias, a decoder layer
whose index 0 skips input_layernorm, no final norm; `topK_genrate` scores with the base model's lm_head
(`head`), and `ea_model.py` feeds it `base_model.model`'s output, the state after the final norm.

Both run a drafting chain as `topK_genrate` does for one branch: the committed entries (entry t holds
token t+1 and the feature at t) at positions 0..T-1, then each drafted token at the next position with
the previous output as its hidden state, attending to everything before it (a chain's tree mask).
Weights are the checkpoint's own tensors (PyTorch's [out, in]), float32.
"""

from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: in float32, then the weight."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(head_dim: int, theta: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LlamaRotaryEmbedding's cos, sin [T, H] at `positions` (the default rope: no scaling)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.einsum("i,j->ij", positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class DraftLayer:
    """The authors' draft decoder layer over `weights[prefix + ...]`, attention as LlamaAttention with a
    (k, v) cache; `config` holds the layer's config.json keys."""

    def __init__(self, weights: dict, config: dict, prefix: str):
        self.w = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config["hidden_size"] // self.heads  # as cnets.LlamaAttention computes it
        self.eps = config["rms_norm_eps"]
        self.theta = config.get("rope_theta", 10000.0)

    def attention(self, x, positions, past):
        """x [1, T, W] -> (attention output [1, T, D], the cache (k, v) [1, K, S + T, H])."""
        bsz, q_len, _ = x.shape
        h = self.head_dim
        q = (x @ self.w["self_attn.q_proj.weight"].T).view(bsz, q_len, self.heads, h).transpose(1, 2)
        k = (x @ self.w["self_attn.k_proj.weight"].T).view(bsz, q_len, self.kv_heads, h).transpose(1, 2)
        v = (x @ self.w["self_attn.v_proj.weight"].T).view(bsz, q_len, self.kv_heads, h).transpose(1, 2)
        cos, sin = rotary(h, self.theta, positions)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        cache = (k, v)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(h)
        s = k.shape[2]
        causal = torch.ones(q_len, s, dtype=torch.bool).tril(s - q_len)  # the new entries see all before them
        scores = scores.masked_fill(~causal, torch.finfo(torch.float32).min)
        out = torch.softmax(scores, dim=-1, dtype=torch.float32) @ v
        out = out.transpose(1, 2).reshape(bsz, q_len, self.heads * h)
        return out @ self.w["self_attn.o_proj.weight"].T, cache

    def rest(self, x):
        """The post-attention half: x + mlp(post_attention_layernorm(x))."""
        y = rms_norm(x, self.w["post_attention_layernorm.weight"], self.eps)
        gate, up = y @ self.w["mlp.gate_proj.weight"].T, y @ self.w["mlp.up_proj.weight"].T
        return x + (torch.nn.functional.silu(gate) * up) @ self.w["mlp.down_proj.weight"].T


class Eagle3Reference:
    """cnets.Model (EAGLE-3): weights by the checkpoint's names (the draft layer under `prefix`), the
    target's input embedding `embed` [V, D]; `switches` the speculators variants that are on."""

    def __init__(self, weights: dict, config: dict, embed: torch.Tensor, prefix: str = "midlayer.",
                 switches: tuple[str, ...] = ()):
        self.w, self.embed, self.switches = weights, embed, switches
        self.layer = DraftLayer(weights, config, prefix)
        self.prefix = prefix
        self.eps = config["rms_norm_eps"]
        n = weights["lm_head.weight"].shape[0]
        self.targets = torch.arange(n) + weights["d2t"] if "d2t" in weights else torch.arange(n)

    def forward(self, hidden_states, input_ids, positions, past=None):
        """Model.forward + LlamaDecoderLayeremb.forward: hidden_states [1, T, 3D] (committed entries: the
        aux features) or [1, T, D] (drafted ones: the previous output); input_ids [1, T]. Returns (the
        layer output [1, T, D], normed when norm_output is on; the cache)."""
        inputs_embeds = self.embed[input_ids]
        if hidden_states.shape[-1] != inputs_embeds.shape[-1]:
            if "fc_norm" in self.switches:
                chunks = hidden_states.chunk(3, dim=-1)
                hidden_states = torch.cat([rms_norm(c, self.w[f"fc_norm.{i}.weight"], self.eps)
                                           for i, c in enumerate(chunks)], dim=-1)
            hidden_states = hidden_states @ self.w["fc.weight"].T
        residual = hidden_states
        hidden = rms_norm(hidden_states, self.w[self.prefix + "hidden_norm.weight"], self.eps)
        emb = rms_norm(inputs_embeds, self.w[self.prefix + "input_layernorm.weight"], self.eps)
        if "norm_before_residual" in self.switches:
            residual = hidden
        attn, cache = self.layer.attention(torch.cat((emb, hidden), dim=-1), positions, past)
        out = self.layer.rest(residual + attn)
        if "norm_output" in self.switches:
            out = rms_norm(out, self.w["norm.weight"], self.eps)
        return out, cache

    def logits(self, out) -> torch.Tensor:
        """[..., N] draft-vocabulary logits, lm_head(norm(out)) (lm_head(out) when out is normed already)."""
        if "norm_output" not in self.switches:
            out = rms_norm(out, self.w["norm.weight"], self.eps)
        return out @ self.w["lm_head.weight"].T

    def chain(self, features, tokens, path) -> list[torch.Tensor]:
        """Draft logits [N] at the root and after each token of path[1:]: features [1, T, 3D] at the
        committed positions, tokens [1, T] the token each entry holds (the last is the root, path[0])."""
        t = tokens.shape[1]
        out, cache = self.forward(features, tokens, torch.arange(t))
        last, logits = out[:, -1:], [self.logits(out[0, -1])]
        for j, token in enumerate(path[1:]):
            last, cache = self.forward(last, torch.tensor([[token]]), torch.tensor([t + j]), cache)
            logits.append(self.logits(last[0, -1]))
        return logits


class Eagle1Reference:
    """cnets1.Model (EAGLE-1) with layer `layers.0.`, fed the base model's normed states and scored by
    its lm_head `head` [V, D]."""

    def __init__(self, weights: dict, config: dict, embed: torch.Tensor, head: torch.Tensor):
        self.w, self.embed, self.head = weights, embed, head
        self.layer = DraftLayer(weights, config, "layers.0.")

    def forward(self, hidden_states, input_ids, positions, past=None):
        x = torch.cat((self.embed[input_ids], hidden_states), dim=-1) @ self.w["fc.weight"].T
        if "fc.bias" in self.w:
            x = x + self.w["fc.bias"]
        attn, cache = self.layer.attention(x, positions, past)  # layer index 0: no input_layernorm
        return self.layer.rest(x + attn), cache

    def chain(self, features, tokens, path) -> list[torch.Tensor]:
        """As `Eagle3Reference.chain`, features [1, T, D] the base model's normed states; logits [V]."""
        t = tokens.shape[1]
        out, cache = self.forward(features, tokens, torch.arange(t))
        last, logits = out[:, -1:], [out[0, -1] @ self.head.T]
        for j, token in enumerate(path[1:]):
            last, cache = self.forward(last, torch.tensor([[token]]), torch.tensor([t + j]), cache)
            logits.append(last[0, -1] @ self.head.T)
        return logits
