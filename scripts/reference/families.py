"""Shared f32 NumPy reference for every family Kestrel runs (no llama.cpp, no torch).

`Model(reader)` reads a GGUF through the `gguf` package, dequantizes every
tensor with `gguf.quants.dequantize` and runs the decoder of its
`general.architecture` in f32, the way llama.cpp defines each family:

- llama:  adjacent-pair ("interleaved") RoPE on the converter-permuted Q/K,
          `rope_freqs.weight` (Llama 3) dividing the frequencies, and a
          `llama.attention.sliding_window` key meaning Mistral-style windows.
- qwen2:  Q/K/V bias, NEOX (half-split) RoPE.
- qwen3:  per-head RMSNorm of q and k before RoPE, NEOX RoPE.
- gemma3: embeddings * sqrt(hidden), per-head q/k norms, post-attention and
          post-FFN norms, GELU-tanh, five sliding-window layers (RoPE base
          10 000) per global one (base `rope.freq_base`), attention scale
          1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer 27B). The
          converter already added Gemma's `1 +` to the stored norm weights.

`SpmTokenizer` is llama.cpp's SentencePiece-BPE algorithm (merge the adjacent
pair whose concatenation has the highest score, byte fallback), written out
plainly; `ByteBPE` (smollm2_golden.py) covers `gpt2` vocabularies.
"""
import numpy as np
import regex
from gguf.quants import dequantize


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


class SpmTokenizer:
    """SentencePiece BPE from GGUF metadata, as llama.cpp tokenizes it."""

    def __init__(self, reader):
        self.tokens = field(reader, "tokenizer.ggml.tokens")
        scores = field(reader, "tokenizer.ggml.scores")
        types = field(reader, "tokenizer.ggml.token_type")
        self.ids = {}
        for i, t in enumerate(self.tokens):
            self.ids.setdefault(t, i)
        # Merge targets: normal tokens only (control/user-defined are split out first).
        self.score = {t: s for t, s, ty in zip(self.tokens, scores, types) if ty == 1}
        self.space_prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
        specials = sorted((t for t, ty in zip(self.tokens, types) if ty in (3, 4)), key=len, reverse=True)
        self.special_re = regex.compile("(" + "|".join(regex.escape(s) for s in specials) + ")")
        self.special = set(specials)

    def bpe(self, text):
        syms = list(text)
        while len(syms) > 1:
            best = None
            for i in range(len(syms) - 1):
                s = self.score.get(syms[i] + syms[i + 1])
                if s is not None and (best is None or s > best[0]):
                    best = (s, i)
            if best is None:
                break
            i = best[1]
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
        out = []
        for s in syms:
            if s in self.ids:
                out.append(self.ids[s])
            else:
                out += [self.ids["<0x%02X>" % b] for b in s.encode("utf-8")]
        return out

    def encode(self, text):
        out = []
        first = True
        for chunk in self.special_re.split(text):
            if not chunk:
                continue
            if chunk in self.special:
                out.append(self.ids[chunk])
            else:
                esc = chunk.replace(" ", "\u2581")
                if self.space_prefix and first:
                    esc = "\u2581" + esc
                out += self.bpe(esc)
            first = False
        return out

    def decode(self, ids):
        buf = b""
        for i in ids:
            t = self.tokens[i]
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                buf += bytes([int(t[3:5], 16)])
            else:
                buf += t.replace("\u2581", " ").encode("utf-8")
        text = buf.decode("utf-8", errors="replace")
        return text[1:] if self.space_prefix and text.startswith(" ") else text


class Model:
    def __init__(self, reader):
        arch = self.arch = field(reader, "general.architecture")
        assert arch in ("llama", "qwen2", "qwen3", "gemma3"), arch
        k = lambda s, d=None: field(reader, f"{arch}.{s}", d)
        self.n_layers = int(k("block_count"))
        self.n_heads = int(k("attention.head_count"))
        self.n_kv = int(k("attention.head_count_kv", self.n_heads))
        self.hidden = int(k("embedding_length"))
        self.head_dim = int(k("attention.key_length", self.hidden // self.n_heads))
        self.theta = float(k("rope.freq_base", 10000.0))
        self.eps = np.float32(k("attention.layer_norm_rms_epsilon"))
        self.w = {}
        for t in reader.tensors:
            arr = dequantize(t.data, t.tensor_type).astype(np.float32)
            self.w[t.name] = arr.reshape([int(d) for d in reversed(t.shape)])  # [rows, cols]
        self.emb = self.w["token_embd.weight"]
        self.lm_head = self.w.get("output.weight", self.emb)
        gemma = arch == "gemma3"
        self.interleaved = arch == "llama"
        self.qk_norm = arch in ("qwen3", "gemma3")
        self.post_norms = gemma
        self.gelu = gemma
        self.emb_scale = np.float32(np.sqrt(self.hidden)) if gemma else np.float32(1)
        if gemma:
            scalar = self.hidden // self.n_heads if self.n_layers == 62 else self.head_dim
            self.attn_scale = np.float32(1.0 / np.sqrt(np.float32(scalar)))
        else:
            self.attn_scale = np.float32(1.0 / np.sqrt(np.float32(self.head_dim)))
        self.softcap = k("final_logit_softcapping") if gemma else None
        self.freq_factors = self.w.get("rope_freqs.weight")
        self.linear_scale = float(k("rope.scaling.factor", 1.0)) if k("rope.scaling.type") == "linear" else 1.0
        window = k("attention.sliding_window")
        self.windows, self.ropes = [], []
        for i in range(self.n_layers):
            if gemma:
                period = int(k("attention.sliding_window_pattern", 6))
                local = (i + 1) % period != 0
                self.windows.append(int(window) if local else None)
                self.ropes.append((float(k("rope.freq_base_swa", 10000.0)), None, 1.0) if local
                                  else (self.theta, self.freq_factors, self.linear_scale))
            else:
                self.windows.append(int(window) if (arch == "llama" and window is not None) else None)
                self.ropes.append((self.theta, self.freq_factors, self.linear_scale))

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos, spec):  # x: [T, heads, head_dim]
        theta, factors, scale = spec
        half = self.head_dim // 2
        freqs = theta ** (-np.arange(half, dtype=np.float64) * 2 / self.head_dim)
        if factors is not None:
            freqs = freqs / factors.astype(np.float64)
        ang = np.outer(np.asarray(pos, dtype=np.float64) / scale, freqs)
        cos, sin = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
        if self.interleaved:
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def forward(self, ids, cache, all_logits=False):
        """Logits of the last position (every position with `all_logits`);
        `cache` is a list of per-layer (K, V)."""
        start = cache[0][0].shape[0] if cache else 0
        T, hd = len(ids), self.head_dim
        pos = np.arange(start, start + T)
        x = self.emb[ids] * self.emb_scale
        group = self.n_heads // self.n_kv
        qpos, kpos = pos[:, None], np.arange(start + T)[None, :]
        for i in range(self.n_layers):
            w = lambda s: self.w[f"blk.{i}.{s}.weight"]
            b = lambda s: self.w.get(f"blk.{i}.{s}.bias", np.float32(0))
            h = self.rms(x, w("attn_norm"))
            q = (h @ w("attn_q").T + b("attn_q")).reshape(T, self.n_heads, hd)
            k = (h @ w("attn_k").T + b("attn_k")).reshape(T, self.n_kv, hd)
            v = (h @ w("attn_v").T + b("attn_v")).reshape(T, self.n_kv, hd)
            if self.qk_norm:
                q, k = self.rms(q, w("attn_q_norm")), self.rms(k, w("attn_k_norm"))
            q, k = self.rope(q, pos, self.ropes[i]), self.rope(k, pos, self.ropes[i])
            if len(cache) <= i:
                cache.append((k, v))
            else:
                cache[i] = (np.concatenate([cache[i][0], k]), np.concatenate([cache[i][1], v]))
            K, V = cache[i]
            K, V = np.repeat(K, group, axis=1), np.repeat(V, group, axis=1)
            visible = kpos <= qpos
            if self.windows[i] is not None:
                visible &= qpos - kpos < self.windows[i]
            mask = np.where(visible, np.float32(0), np.float32(-np.inf))
            s = np.einsum("thd,shd->hts", q, K) * self.attn_scale + mask
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", p, V).reshape(T, -1) @ w("attn_output").T
            if self.post_norms:
                o = self.rms(o, w("post_attention_norm"))
            x = x + o
            h = self.rms(x, w("ffn_norm"))
            g, u = h @ w("ffn_gate").T, h @ w("ffn_up").T
            if self.gelu:
                act = np.float32(0.5) * g * (np.float32(1) + np.tanh(np.float32(np.sqrt(2 / np.pi)) * (g + np.float32(0.044715) * g * g * g)))
            else:
                act = g / (1 + np.exp(-g))
            d = (act * u) @ w("ffn_down").T
            if self.post_norms:
                d = self.rms(d, w("post_ffw_norm"))
            x = x + d
        rows = x if all_logits else x[-1]
        logits = self.rms(rows, self.w["output_norm.weight"]) @ self.lm_head.T
        if self.softcap:
            logits = np.float32(self.softcap) * np.tanh(logits / np.float32(self.softcap))
        return logits


def generate(model, ids, n, top=5, names=None):
    """Greedy decode of `n` tokens after prefilling `ids`; per step the top-k
    logits and the top-1 margin."""
    cache, steps, out = [], [], []
    logits = model.forward(ids, cache)
    for step in range(n):
        order = np.argsort(-logits, kind="stable")[:top]
        nxt = int(order[0])
        steps.append({
            "step": step,
            "top5": [[int(t), names[t] if names else "", round(float(logits[t]), 4)] for t in order],
            "top1_margin": round(float(logits[order[0]] - logits[order[1]]), 4),
        })
        out.append(nxt)
        logits = model.forward([nxt], cache)
    return out, steps
