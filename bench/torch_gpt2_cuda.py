"""PyTorch side of bench_gpt2_cuda: the same GPT-2-small shape (nanoGPT without weight tying: 12 layers,
width 768, 12 heads, vocab 50257, context 1024, GELU tanh, no dropout), AdamW, eager mode, on the same
GPU. Precisions: fp32 with TF32 matmuls, fp16 (torch.autocast + GradScaler), bf16 (torch.autocast).
--attention sdpa uses F.scaled_dot_product_attention (flash kernels), math the explicit softmax(QK^T)V
that booster computes. Prints one JSON line per precision, like bench_gpt2_cuda.

  python3 bench/torch_gpt2_cuda.py [--batch 8] [--steps 10] [--warmup 3] [--attention sdpa|math]
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads, attention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.heads = heads
        self.attention = attention

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, context, width, layers, heads, attention):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def bf16_peak():
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * 20 / (time.perf_counter() - t0) / 1e12


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attention", default="sdpa")
    p.add_argument("--precision", default="all")
    a = p.parse_args()
    peak = bf16_peak()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "bf16_gemm_peak_tflops": peak}), flush=True)
    precisions = ["fp32", "fp16", "bf16"] if a.precision == "all" else [a.precision]
    V, T, W, L, H = 50257, a.context, 768, 12, 12
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randint(0, V, (a.batch, T), generator=g).cuda()
    target = torch.randint(0, V, (a.batch * T,), generator=g).cuda()
    for prec in precisions:
        torch.backends.cuda.matmul.allow_tf32 = prec == "fp32"
        torch.manual_seed(0)
        model = GPT(V, T, W, L, H, a.attention).cuda()
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cuda", enabled=prec == "fp16")
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(prec)
        torch.cuda.reset_peak_memory_stats()

        def step():
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(idx).view(-1, V).float(), target)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        for _ in range(a.warmup):
            step()
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
        s = sorted(times)[len(times) // 2]
        tokens = a.batch * T
        flops = tokens * (6 * params + 12 * L * W * T)
        print(json.dumps({"framework": "torch", "attention": a.attention, "precision": prec, "batch": a.batch,
                          "context": T, "params": params, "ms_per_step": s * 1e3, "tokens_per_s": tokens / s,
                          "tflops": flops / s / 1e12, "mfu_vs_bf16_gemm": flops / s / 1e12 / peak, "loss": loss,
                          "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
        del model, opt


if __name__ == "__main__":
    main()
