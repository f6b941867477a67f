"""PyTorch's fused AdamW on CPU, timed like `cargo xtask bench adam` times ours.

Prints one line per size: "<elements> <fastest ms per step>" (the minimum, as the Rust side).
"""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    for n in [int(s) for s in args.sizes.split(",")]:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-4, eps=1e-5, fused=True)
        times = []
        for i in range(args.reps + 1):
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            if i > 0:
                times.append((t1 - t0) * 1e3)
        print(n, min(times), flush=True)


if __name__ == "__main__":
    main()
