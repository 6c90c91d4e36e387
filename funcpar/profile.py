"""``python -m funcpar.profile``: measure a device profile for the layout search.

    python -m funcpar.profile --out my.json                      # this device, no collectives
    python -m funcpar.profile --ranks 4 --out cpu4.json          # + gloo collectives, 4 ranks
    torchrun --nproc_per_node 8 -m funcpar.profile --out node.json   # + NCCL collectives
    python -m funcpar.profile --show h100                        # a shipped profile's figures

Matmul and attention throughput per dtype, memory bandwidth, op latency, and, on several ranks,
alpha and beta of all_reduce, all_gather, reduce_scatter, all_to_all and p2p per group size
(``funcpar.auto.profile.measure``). On a CPU each rank runs ``--threads`` torch threads
(default 1, as funcpar's gloo ranks and ``benchmarks/bench_auto.py`` run), and the profile
records the cores the ranks share. Rank 0 writes the JSON; ``auto_parallel(profile=path)``
and ``train_lm.py --auto --profile path`` read it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

__all__ = ["main"]


def _measure_rank(device: str, quick: bool, name: str | None, threads: int | None = None
                  ) -> dict:
    import torch

    from funcpar.auto.profile import measure

    if threads:
        torch.set_num_threads(threads)
    kw = {"reps": 3, "sizes": (64, 128, 256)} if quick else {}
    return measure(device, name=name, **kw).to_json()


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m funcpar.profile", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--ranks", type=int, default=1,
                   help="measure collectives on this many local gloo ranks (not under torchrun)")
    p.add_argument("--out", default=None, help="write the profile here (JSON)")
    p.add_argument("--name", default=None, help="the profile's name")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank on a CPU (default 1)")
    p.add_argument("--show", default=None, metavar="PROFILE",
                   help="print a profile's figures and sources (a shipped name or a JSON file)")
    args = p.parse_args(argv)
    import torch

    from funcpar.auto.profile import DeviceProfile, load_profile

    if args.show is not None:
        prof = load_profile(args.show)
        print(prof.describe())
        return prof.to_json()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    threads = None if device == "cuda" else (args.threads or 1)
    if args.ranks > 1 and not under_torchrun:
        from funcpar.testing import run_ranks

        data = run_ranks(_measure_rank, args.ranks, device, args.quick, args.name, threads,
                         timeout=600)[0]
    else:
        if under_torchrun:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl" if device == "cuda" else "gloo")
            if device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        data = _measure_rank(device, args.quick, args.name, threads)
    prof = DeviceProfile.from_json(data)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(prof.describe())
        if args.out:
            prof.save(args.out)
            print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    main()
