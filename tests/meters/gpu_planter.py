"""A separate process that holds the CUDA context, so the meter's process never has one.

Protocol on stdin/stdout (one JSON line each): prints {"uuid": ...} once CUDA is up, then for every line
"plant <gib> <hold_ms>" allocates, holds, frees and prints the epoch times; "matmul <n> <iters>" runs a
bf16 matmul loop and prints its seconds; "quit" ends it.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main() -> None:
    torch.cuda.init()
    warm = torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    props = torch.cuda.get_device_properties(0)
    print(json.dumps({"uuid": f"GPU-{props.uuid}", "name": props.name}), flush=True)
    mats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "plant":
            size, hold = int(float(cmd[1]) * (1 << 30)), float(cmd[2]) / 1000
            t_a = time.time()
            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            t_b = time.time()
            time.sleep(hold)
            t_c = time.time()
            del x
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            t_d = time.time()
            print(json.dumps({"alloc_start": t_a, "allocated": t_b, "free_start": t_c, "freed": t_d}), flush=True)
        elif cmd[0] == "matmul":
            n, iters = int(cmd[1]), int(cmd[2])
            if n not in mats:
                mats[n] = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
                           torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
            a, b = mats[n]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                a @ b
            torch.cuda.synchronize()
            print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
    del warm


if __name__ == "__main__":
    main()
