"""Checkpoint loads whose sizes alternate, next to loads of one size (issue 15, goal 2).

One study's checkpoints differ in size: SGD with momentum keeps a buffer per parameter, without
it none, so a worker's consecutive loads may alternate between two sizes. A store reads each
load into the memory file it keeps (``gpu_worker.checkpoint.LoadMemory``); a file that must be
made anew has every page faulted in again (60 to 70 ms per 100 MB here).

Measured in one process, on a local store in a temporary directory: ``--repeats`` loads of one
100 MB checkpoint, then ``--repeats`` loads alternating between it and a 110 MB one (the weights
plus a tenth more, as a buffer would add), each a ``load`` (read, hash, decode by mapping) of
which one value is read, the decoded state then dropped. Printed: the median seconds of each
and their ratio.

Run: ``.venv/bin/python benchmarks/load_sizes.py [--repeats 8]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gpu_worker.checkpoint import LoadedBytes, LocalCheckpointStore, encode_state  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8, help="loads of each kind")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        store = LocalCheckpointStore(root)
        weights = torch.randn(5000, 5000)
        refs = [store.put(encode_state(state)).ref
                for state in ({"w": weights}, {"w": weights, "m": torch.randn(500, 5000)})]

        def load(ref: str) -> float:
            t0 = time.perf_counter()
            state = store.load(ref, LoadedBytes.decode)
            float(state["w"][0, 0])
            del state
            return time.perf_counter() - t0

        for ref in refs:
            load(ref)
        same = statistics.median(load(refs[0]) for _ in range(args.repeats))
        alternating = statistics.median(load(refs[i % 2]) for i in range(args.repeats))
    print(f"one size (100 MB):          {same * 1e3:6.1f} ms per load (median of {args.repeats})")
    print(f"alternating (100 / 110 MB): {alternating * 1e3:6.1f} ms per load (median of {args.repeats})")
    print(f"ratio alternating / one size: {alternating / same:.2f}")


if __name__ == "__main__":
    main()
