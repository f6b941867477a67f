"""The PyTorch side of `cargo xtask bench sharding`: the examples' character GPT
(examples/src/gpt.rs) trained for a fixed number of steps on the CPU, timed like the Rust side.

Modes (started by the bench; the distributed ones under `torchrun --nproc_per_node N`, gloo):
  single      one process, no torch.distributed
  ddp         DistributedDataParallel (ZeRO stage 0's counterpart)
  zero        DDP + torch.distributed.optim.ZeroRedundancyOptimizer (stage 1's)
  fsdp2-grad  FSDP2 fully_shard(reshard_after_forward=False), ZeRO-2-like traffic (stage 2's)
  fsdp2       FSDP2 fully_shard on every block and the root (stage 3's)

The model: token + position embeddings, pre-norm blocks of causal multi-head self-attention
(separate q/k/v/out Linear layers with bias, as Burn's MultiHeadAttention) and an exact-GELU MLP
(4x), a final LayerNorm and a linear head; AdamW(betas=(0.9, 0.99), eps=1e-5,
weight_decay=0.1), the examples' learning-rate schedule. Batches are random windows of the same
tiny shakespeare text, the global batch split over the ranks.

Rank 0 prints one line `TORCH_RESULT <json>`: rank 0's step times (ms, warm-up excluded), the
same steps split into phases (ms; `forward_ms`: `zero_grad` + forward + loss, `backward_ms`:
`loss.backward()`, `optimizer_ms`: `opt.step()` + `loss.item()`; the three add up to
`step_ms`), and for every rank its max RSS and the bytes of its parameters, gradients and
optimizer state (the local shards of DTensors).

The phases are wall time on the CPU, where every op has finished when its Python call returns.
They include PyTorch's collectives, which run inside DDP's and FSDP2's hooks and cannot be
timed apart from the outside: DDP's all-reduce is launched during backward and waited for at its
end (backward), ZeroRedundancyOptimizer's broadcast of the updated parameters runs in
`opt.step()`, FSDP2's all-gathers run in forward (and again in backward when it reshards after
forward) and its reduce-scatters in backward.
"""
import argparse
import json
import math
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.q = nn.Linear(n_embd, n_embd)
        self.k = nn.Linear(n_embd, n_embd)
        self.v = nn.Linear(n_embd, n_embd)
        self.o = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        split = lambda y: y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, block_size, n_embd, n_head, n_layer):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def lr_at(step, steps, peak, warmup):
    """examples/src/training.rs `lr_at`."""
    warmup = max(warmup, 1)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def local_bytes(t):
    """Bytes this rank stores for `t` (a DTensor's local shard)."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def optimizer_state_bytes(opt):
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the local optimizer in .optim
    total = 0
    for state in inner.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += local_bytes(v)
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["single", "ddp", "zero", "fsdp2-grad", "fsdp2"], required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of this process")
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    distributed = args.mode != "single"
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1

    text = open(args.data, encoding="utf-8").read()
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([lookup[c] for c in text[: len(text) * 9 // 10]], dtype=torch.long)

    torch.manual_seed(args.seed)
    model = Gpt(len(vocab), args.block_size, args.n_embd, args.n_head, args.n_layer)
    n_params = sum(p.numel() for p in model.parameters())
    hyper = dict(lr=args.lr, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.1)
    adamw_impl = "fused"
    if args.mode in ("single", "ddp"):
        if args.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    elif args.mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, fused=True, **hyper)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        reshard = args.mode == "fsdp2"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        # The fused CPU kernel has no DTensor rule in every release: the default implementation.
        opt = torch.optim.AdamW(model.parameters(), **hyper)
        adamw_impl = "default (foreach/for-loop)"

    local = args.batch_size // world
    gen = torch.Generator().manual_seed(args.seed + rank * 7919)
    total = args.warmup + args.steps
    times, grads_bytes = [], 0
    phases = {"forward_ms": [], "backward_ms": [], "optimizer_ms": []}
    for step in range(total):
        starts = torch.randint(0, len(ids) - args.block_size - 1, (local,), generator=gen)
        x = torch.stack([ids[s : s + args.block_size] for s in starts.tolist()])
        y = torch.stack([ids[s + 1 : s + 1 + args.block_size] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.lr, total // 20)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if step == total - 1:
            grads_bytes = sum(local_bytes(p.grad) for p in model.parameters())
        t2_resume = time.perf_counter()  # the bookkeeping above is left out of the times
        opt.step()
        loss.item()
        t3 = time.perf_counter()
        if step >= args.warmup:
            forward, backward, optimizer = (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2_resume) * 1e3
            phases["forward_ms"].append(forward)
            phases["backward_ms"].append(backward)
            phases["optimizer_ms"].append(optimizer)
            times.append(forward + backward + optimizer)

    mine = {
        "rank": rank,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params_bytes": sum(local_bytes(p) for p in model.parameters()),
        "grads_bytes": grads_bytes,
        "optim_bytes": optimizer_state_bytes(opt),
    }
    if distributed:
        # A tensor, not all_gather_object (which needs numpy).
        keys = ["rank", "max_rss_bytes", "params_bytes", "grads_bytes", "optim_bytes"]
        row = torch.tensor([mine[k] for k in keys], dtype=torch.int64)
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        ranks = [dict(zip(keys, r.tolist())) for r in rows]
        dist.destroy_process_group()
    else:
        ranks = [mine]
    if rank == 0:
        out = {
            "mode": args.mode,
            "world_size": world,
            "threads_per_rank": args.threads,
            "torch": torch.__version__,
            "adamw": adamw_impl,
            "params": n_params,
            "step_ms": times,
            **phases,
            "ranks": ranks,
        }
        print("TORCH_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
