"""A simulated GPU on Kafka (``python -m gpu_worker.simulated_worker``): the worker process of
``benchmarks/cluster_load.py``, which loads the control plane at paper scale without GPUs.

It is a real ``stagetree worker`` (:class:`~gpu_worker.kafka_worker.KafkaWorker`: its own
dispatch stream, transactional appends, heartbeats, drain on SIGTERM) whose runner does not
train: a step takes the time the study's :class:`~gpu_worker.simulation_models.CostModel` gives
it, multiplied by ``--time-scale`` and spent in ``time.sleep``, and reports what the
:class:`~gpu_worker.simulation_models.CurveModel` gives (the same numbers ``stagetree simulate``
computes). Checkpoints are the curve's state in a directory shared by the workers of one host
(``--checkpoints``), one file per ref.

It imports no torch (tests/test_kafka_cluster.py checks the import chain), so forty of them fit
on a small machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path

import orjson

from events.execution import Control, Emit, EndBatches, StageFault, run_path
from events.kafka_log import DEFAULT_PLAN_PARTITIONS, KafkaLog, security_from_env
from events.models import Event, StageDispatched
from gpu_worker.kafka_worker import KafkaWorker
from gpu_worker.simulation_models import CostModel, Curve, SimulatedWorker, models_from_json


class CheckpointFiles(MutableMapping[str, float]):
    """Simulated checkpoints (ref -> the curve's loss) as files of a directory: shared by the
    simulated workers of one host, as a checkpoint store is by real ones."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def __getitem__(self, ref: str) -> float:
        try:
            return float.fromhex((self.root / ref).read_text())
        except FileNotFoundError:
            raise KeyError(ref) from None

    def __setitem__(self, ref: str, loss: float) -> None:
        tmp = self.root / f".{ref}.{os.getpid()}"
        tmp.write_text(loss.hex())
        tmp.replace(self.root / ref)

    def __delitem__(self, ref: str) -> None:
        (self.root / ref).unlink(missing_ok=True)

    def __iter__(self) -> Iterator[str]:
        return (p.name for p in self.root.iterdir() if not p.name.startswith("."))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class RealTimeWorker(SimulatedWorker):
    """A :class:`SimulatedWorker` on the wall clock: what the cost model says a step takes is
    slept, scaled by ``time_scale``."""

    def __init__(self, cost: CostModel, curve: Curve, checkpoints: MutableMapping[str, float],
                 time_scale: float) -> None:
        super().__init__(cost, curve, checkpoints)  # type: ignore[arg-type]
        self.time_scale = time_scale

    def begin(self, d: StageDispatched) -> None:
        try:
            super().begin(d)
        except KeyError:
            raise StageFault("checkpoint_missing", f"no simulated checkpoint {d.source.ref if d.source else None}",
                             d.source.ref if d.source else None) from None

    def _spend(self, seconds: float) -> None:
        time.sleep(seconds * self.time_scale)

    def now(self) -> float:
        return time.monotonic()


class SimulatedRunner:
    """The :class:`~gpu_worker.kafka_worker.Runner` of a simulated GPU."""

    device = "sim"

    def __init__(self, worker_id: str, backend: RealTimeWorker) -> None:
        self.worker_id = worker_id
        self.backend = backend

    def prepare(self) -> None:
        return None

    def _stamp(self, event: Event) -> Event:
        return event.model_copy(update={"producer": f"worker:{self.worker_id}", "ts": time.time()})

    def run(self, dispatch: StageDispatched, emit: Emit, control: Control, should_stop: Callable[[], bool],
            ends: EndBatches | None = None) -> bool:
        return run_path(dispatch, self.backend, emit, self.worker_id, self._stamp, control, should_stop, ends)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpu_worker.simulated_worker", description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap-servers", default=os.environ.get("STAGETREE_BOOTSTRAP_SERVERS"), required=False)
    p.add_argument("--topic-prefix", default=os.environ.get("STAGETREE_TOPIC_PREFIX", ""))
    p.add_argument("--plan-partitions", type=int, default=DEFAULT_PLAN_PARTITIONS)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--models", required=True, help="JSON file of gpu_worker.simulation_models.models_to_json")
    p.add_argument("--time-scale", type=float, required=True, help="wall seconds per simulated second")
    p.add_argument("--checkpoints", required=True, help="directory of the simulated checkpoints")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats (default 1)")
    args = p.parse_args(argv)
    if not args.bootstrap_servers:
        p.error("--bootstrap-servers (or $STAGETREE_BOOTSTRAP_SERVERS) is required")
    cost, curve = models_from_json(orjson.loads(Path(args.models).read_bytes()))

    def make_log() -> KafkaLog:
        return KafkaLog(args.bootstrap_servers, client_id=f"stagetree-sim-{args.worker_id}",
                        topic_prefix=args.topic_prefix, plan_partitions=args.plan_partitions,
                        security=security_from_env())

    backend = RealTimeWorker(cost, curve, CheckpointFiles(Path(args.checkpoints)), args.time_scale)
    worker = KafkaWorker(make_log, args.worker_id, SimulatedRunner(args.worker_id, backend),
                         heartbeat_s=args.heartbeat)
    signal.signal(signal.SIGTERM, lambda *_: worker.drain())
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
