#!/usr/bin/python3
"""PyTorch reference for bench_llama's training step: the same Llama, the same step, timed the same way.

Run with Debian's Python, which has torch 1.13:
  /usr/bin/python3 bench/torch_llama.py [--layers 12 --hidden 768 --heads 12 --kv-heads 4
      --intermediate 2048 --vocab 32000 --seq 256 --batch 2 --steps 3 --warmup 1 --cuda 0 --bf16 0]
On a GPU (--cuda 1, a torch with scaled_dot_product_attention) attention is SDPA; --bf16 1 autocasts.
Prints one JSON line: {"framework": "pytorch", "ms_per_step", "tokens_per_second", "gflops", "params", ...}.

The model is Hugging Face's LlamaForCausalLM written from its formulas in plain PyTorch (no transformers
package): RMSNorm computed in float32, rotary embedding in the rotate_half layout, grouped-query attention
by repeat_kv with the causal softmax written out (torch 1.13 has no scaled_dot_product_attention), SwiGLU,
no biases, untied lm_head; float32. One step = forward, next-token cross-entropy on random tokens,
backward, AdamW (lr 1e-4) step, zero_grad. gflops counts 6 x parameters x tokens per second.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.d, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(heads * self.d, hidden, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k[:, :, None].expand(B, self.kv_heads, rep, T, self.d).reshape(B, self.heads, T, self.d)
            v = v[:, :, None].expand(B, self.kv_heads, rep, T, self.d).reshape(B, self.heads, T, self.d)
        if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2 (the GPU machine's): SDPA, flash
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        att = (q @ k.transpose(2, 3)) / math.sqrt(self.d)
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, -1))


class Layer(nn.Module):
    def __init__(self, hidden, heads, kv_heads, intermediate):
        super().__init__()
        self.self_attn = Attention(hidden, heads, kv_heads)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden)
        self.post_attention_layernorm = RMSNorm(hidden)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Layer(a.hidden, a.heads, a.kv_heads, a.intermediate) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden)
        self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)
        d = a.hidden // a.heads
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(a.seq).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())
        self.register_buffer("mask", torch.tril(torch.ones(a.seq, a.seq, dtype=torch.bool)))

    def forward(self, idx):
        T = idx.shape[1]
        x = self.embed_tokens(idx)
        cos, sin, mask = self.cos[:T], self.sin[:T], self.mask[:T, :T]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    for key, default in [("layers", 12), ("hidden", 768), ("heads", 12), ("kv-heads", 4), ("intermediate", 2048),
                         ("vocab", 32000), ("seq", 256), ("batch", 2), ("steps", 3), ("warmup", 1),
                         ("cuda", 0), ("bf16", 0)]:
        p.add_argument("--" + key, type=int, default=default)
    for key in ("prompt", "new"):  # bench_llama's generation sizes, accepted so one option list serves both
        p.add_argument("--" + key, type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(0)
    model = Llama(a)
    for prm in model.parameters():
        if prm.dim() >= 2:
            nn.init.normal_(prm, 0.0, 0.02)
    params = sum(prm.numel() for prm in model.parameters())
    device = "cuda" if a.cuda else "cpu"
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, loss_value = [], 0.0
    for s in range(a.warmup + a.steps):
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1)).to(device)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bool(a.bf16)):
            loss = F.cross_entropy(model(x).reshape(-1, a.vocab).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        loss_value = loss.item()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    tokens = a.batch * a.seq
    print(json.dumps({"model": "llama", "framework": "pytorch", "torch": torch.__version__, "params": params,
                      "threads": torch.get_num_threads(), "mode": "train", "device": device,
                      "precision": "bf16" if a.bf16 else "fp32", "ms_per_step": 1e3 * sec,
                      "tokens_per_second": tokens / sec, "gflops": 6 * params * tokens / sec / 1e9,
                      "loss": loss_value}))


if __name__ == "__main__":
    main()
