"""What the embedded workers' fork server imports once, before it forks each worker.

Where no worker can use a GPU, ``stagetree run`` starts its workers with multiprocessing's
``forkserver`` start method (:func:`stagetree.embedded.worker_start_method`): a server process
imports this module (multiprocessing's *preload*), then forks every worker, which starts with
torch, ``torch._dynamo`` (imported by every torch optimizer step: about half of torch's import
time here) and the worker's modules already imported, shared copy-on-write.

In that server this module also

* freezes what it imported out of the garbage collector's sight (``gc.freeze``): otherwise the
  first full collection in each forked worker walks every object torch created (and writes to
  each, faulting in a private copy of its page), about 0.2 s here before the worker's first step;
* registers an exit without interpreter teardown: the server leaves once the coordinator is
  gone, and tearing down an interpreter that has imported torch takes about a second, during
  which it would hold the run's output pipes (which the workers share) open. The workers it
  forks leave through ``os._exit`` themselves (multiprocessing's and
  :func:`gpu_worker.boot.embedded_worker_main`'s).

Imported anywhere else, it only imports.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys

import torch._dynamo  # noqa: F401  (every torch optimizer step imports it)

import gpu_worker.process  # noqa: F401  (torch, the executor, the checkpoint store, gpu_worker.boot)


def in_fork_server() -> bool:
    """Whether this process is multiprocessing's fork server (started as ``python -c "from
    multiprocessing.forkserver import main; main(...)"``)."""
    return sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules


def _leave() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if in_fork_server():
    atexit.register(_leave)
    gc.freeze()
