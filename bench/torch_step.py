#!/usr/bin/python3
"""PyTorch reference for `booster bench`: the same two training steps, timed the same way.

Run with Debian's Python, which has torch 1.13:
  /usr/bin/python3 bench/torch_step.py [--steps N] [--workload mlp|gpt|all] [--precision fp32|bf16]
Prints one JSON line per workload: {"workload": "mlp"|"gpt", "model", "precision", "ms_per_step",
"gflops", "framework": "pytorch"}. --precision bf16 runs forward and loss under
torch.autocast("cpu", dtype=torch.bfloat16), the only CPU autocast dtype torch 1.13 has.

Workloads (float32, one step = forward, backward, AdamW step, zero_grad):
  mlp: MLP 784-1024-1024-10 (ReLU), batch 256, cross-entropy on random data and labels.
  cnn: conv32-bn-relu-pool, conv64-bn-relu-pool, 3136-128-10 on 1x28x28 images, batch 128 (the
       `cnn` model type's default).
  gpt: GPT-2 style decoder, vocab 256, context 128, width 256, 4 layers, 4 heads, pre-norm blocks,
       GELU (tanh), causal attention written out with matmul/softmax (torch 1.13 has no SDPA),
       no weight tying, lm_head without bias; batch 8 of random tokens, next-token cross-entropy.
gflops counts 6 x parameters x (samples or tokens) per second, the usual training estimate.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        layers = []
        for i in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i + 2 < len(sizes):
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads, context):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.register_buffer("mask", torch.tril(torch.ones(context, context, dtype=torch.bool)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, width, heads, context):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, context)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, context, width, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads, context) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        return self.lm_head(self.ln_f(self.blocks(x)))


def time_steps(model, make_loss, warmup, steps, precision):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = make_loss()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


class CNN(nn.Module):
    """booster's CNNClassifier: conv3x3(pad 1) -> BatchNorm2d -> ReLU -> MaxPool2d(2) per block, then
    Flatten -> Linear -> ReLU -> Linear."""

    def __init__(self, channels=(32, 64), hidden=128, classes=10):
        super().__init__()
        layers, prev, side = [], 1, 28
        for c in channels:
            layers += [nn.Conv2d(prev, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2)]
            prev, side = c, side // 2
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(prev * side * side, hidden), nn.ReLU(),
                                        nn.Linear(hidden, classes))

    def forward(self, x):
        return self.classifier(self.features(x.view(x.shape[0], 1, 28, 28)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per workload (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--workload", choices=["mlp", "gpt", "cnn", "all"], default="all")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    if args.workload in ("mlp", "all"):
        batch = 256
        model = MLP([784, 1024, 1024, 10])
        x = torch.randn(batch, 784)
        y = torch.randint(0, 10, (batch,))
        sec = time_steps(model, lambda: F.cross_entropy(model(x), y), args.warmup, args.steps, args.precision)
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"workload": "mlp", "model": "mlp_784_1024_1024_10_b256", "precision": args.precision,
                          "ms_per_step": sec * 1e3,
                          "gflops": 6 * params * batch / sec / 1e9, "params": params,
                          "threads": torch.get_num_threads(), "framework": "pytorch"}), flush=True)

    if args.workload in ("gpt", "all"):
        batch, context, vocab = 8, 128, 256
        model = GPT(vocab, context, 256, 4, 4)
        idx = torch.randint(0, vocab, (batch, context))
        tgt = torch.randint(0, vocab, (batch, context))
        sec = time_steps(model, lambda: F.cross_entropy(model(idx).view(-1, vocab), tgt.view(-1)),
                         args.warmup, args.steps, args.precision)
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"workload": "gpt", "model": "gpt_v256_t128_w256_l4_h4_b8", "precision": args.precision,
                          "ms_per_step": sec * 1e3,
                          "gflops": 6 * params * batch * context / sec / 1e9, "params": params,
                          "threads": torch.get_num_threads(), "framework": "pytorch"}), flush=True)

    if args.workload in ("cnn", "all"):
        batch = 128
        model = CNN()
        x = torch.randn(batch, 784)
        y = torch.randint(0, 10, (batch,))
        sec = time_steps(model, lambda: F.cross_entropy(model(x), y), args.warmup, args.steps, args.precision)
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"workload": "cnn", "model": "cnn_c32_c64_h128_b128", "precision": args.precision,
                          "ms_per_step": sec * 1e3, "params": params,
                          "threads": torch.get_num_threads(), "framework": "pytorch"}), flush=True)


if __name__ == "__main__":
    main()
