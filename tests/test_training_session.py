"""TrainingSession, ResumableSampler and the digits example, on real torch and real data.

Checks DESIGN.md invariant 1 (merged = independent, bit for bit): training
straight through equals training in stages, each stage a new session loaded
from the previous stage's checkpoint bytes.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from counted_builds import CountedBuilds
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hp import Constant, Cosine, CyclicLR, Exponential, HPConfig, MultiStep, Warmup
from gpu_worker import checkpoint
from gpu_worker.checkpoint import LocalCheckpointStore, SnapshotBuffers, decode_state, encode_state
from gpu_worker.sampler import ResumableSampler
from gpu_worker.session import TrainingSession, step_seed
from gpu_worker.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "digits.py"
MAX_STEPS = 60


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stagetree_example_digits", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


digits = _load_example()


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread, as in a worker: small steps on shared cores stall with more."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def new_session(seed: int = 7, device: str = "cpu") -> TrainingSession:
    return TrainingSession(digits.DigitsTrainer(), seed, device)


def straight(config: HPConfig, steps: int, seed: int = 7, device: str = "cpu") -> TrainingSession:
    session = new_session(seed, device)
    session.start_fresh()
    session.train(config, steps)
    return session


def chunked(config: HPConfig, boundaries: list[int], steps: int, seed: int = 7) -> TrainingSession:
    """Train ``[0, steps)`` in stages ending at ``boundaries`` and ``steps``.

    Each stage runs in a new session loaded from the previous stage's
    checkpoint bytes; the returned session is loaded from the last one.
    """
    session = new_session(seed)
    session.start_fresh()
    for boundary in [*boundaries, steps]:
        session.train(config, boundary)
        data = session.save()
        session = new_session(seed)
        session.load(data)
    return session


def assert_same_training(a: TrainingSession, b: TrainingSession) -> None:
    assert a.step == b.step
    state_a = a.trainer.model.state_dict()
    state_b = b.trainer.model.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name
    assert a.save() == b.save()
    assert a.evaluate() == b.evaluate()


def lr_functions(steps: int) -> st.SearchStrategy:
    milestones = st.lists(st.integers(1, steps), min_size=1, max_size=3, unique=True).map(sorted)
    return st.one_of(
        st.sampled_from([0.01, 0.05, 0.1]).map(Constant),
        st.builds(MultiStep, st.sampled_from([0.05, 0.1]), milestones, st.sampled_from([0.1, 0.5])),
        st.builds(
            Warmup,
            st.just(0.001),
            st.integers(1, steps),
            st.builds(Exponential, st.sampled_from([0.05, 0.1]), st.sampled_from([0.9, 0.97])),
        ),
        st.builds(
            Cosine, st.just(0.1), st.just(0.001), st.integers(1, steps), st.sampled_from([1.0, 2.0])
        ),
        st.builds(
            CyclicLR,
            st.just(0.01),
            st.sampled_from([0.1, 0.2]),
            st.integers(1, 20),
            st.integers(1, 20),
        ),
    )


@st.composite
def configs(draw: st.DrawFn, steps: int) -> HPConfig:
    one_milestone = st.integers(1, steps).map(lambda milestone: [milestone])
    batch_size = draw(
        st.one_of(
            st.sampled_from([8, 16, 32, 64]).map(Constant),
            st.builds(MultiStep, st.sampled_from([8, 16, 32]), one_milestone, st.just(2)),
        )
    )
    momentum = draw(
        st.one_of(
            st.sampled_from([0.0, 0.5, 0.9]).map(Constant),
            st.builds(MultiStep, st.just(0.9), one_milestone, st.just(0.5)),
        )
    )
    return {"lr": draw(lr_functions(steps)), "batch_size": batch_size, "momentum": momentum}


@st.composite
def split_runs(draw: st.DrawFn) -> tuple[HPConfig, list[int], int]:
    steps = draw(st.integers(1, MAX_STEPS))
    config = draw(configs(steps))
    boundaries = sorted(draw(st.lists(st.integers(0, steps), max_size=4)))
    return config, boundaries, steps


@settings(deadline=None, max_examples=15)
@given(split_runs())
def test_split_and_resume_equals_straight_through(run: tuple[HPConfig, list[int], int]) -> None:
    config, boundaries, steps = run
    assert_same_training(straight(config, steps), chunked(config, boundaries, steps))


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_branches_from_a_shared_prefix_equal_independent_runs(device: str) -> None:
    prefix_steps, steps = 20, 45
    shared = {"lr": Constant(0.1), "batch_size": Constant(32), "momentum": Constant(0.9)}
    branch_a = {
        "lr": MultiStep(0.1, [prefix_steps], 0.1),
        "batch_size": Constant(32),
        "momentum": Constant(0.9),
    }
    branch_b = {
        "lr": Warmup(0.1, prefix_steps, Exponential(0.1, 0.95)),
        "batch_size": MultiStep(32, [prefix_steps], 2),
        "momentum": MultiStep(0.9, [30], 0.5),
    }
    prefix = straight(shared, prefix_steps, device=device).save()
    for branch in (branch_a, branch_b):
        resumed = new_session(device=device)
        resumed.load(prefix)
        resumed.train(branch, steps)
        assert_same_training(straight(branch, steps, device=device), resumed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("at", [0, 20])
def test_a_trainer_trained_on_one_branch_loads_another_without_a_build_bit_for_bit(device: str, at: int) -> None:
    """``load(rebuild=False)``, as a worker that built the trainer with the same seed loads a
    sibling's source: momentum buffers, weights, gradients and tuned values of the branch it
    trained are all replaced, also by a checkpoint taken before any step (no optimizer state);
    the training that follows equals a fresh build's, bit for bit."""
    steps = 45
    shared = {"lr": Constant(0.1), "batch_size": Constant(32), "momentum": Constant(0.9)}
    branch_a = {"lr": MultiStep(0.1, [at + 5], 0.1), "batch_size": Constant(32), "momentum": MultiStep(0.9, [30], 0.5)}
    branch_b = {"lr": MultiStep(0.1, [at + 5], 0.3), "batch_size": MultiStep(32, [at + 3], 2),
                "momentum": Constant(0.9)}
    trainer = CountedBuilds()
    session = TrainingSession(trainer, 7, device)
    session.start_fresh()
    session.train(shared, at)
    prefix = session.save()
    session.train(branch_a, steps)  # this trainer now holds branch a's state, gradients included
    assert trainer.builds == 1 and trainer.optimizer.state
    for branch in (branch_b, branch_a):
        resumed = TrainingSession(trainer, 7, device)
        resumed.load(prefix, rebuild=False)
        assert trainer.builds == 1
        assert all(p.grad is None for p in trainer.model.parameters())
        assert resumed.save() == prefix
        resumed.train(branch, steps)
        reference = new_session(device=device)
        reference.load(prefix)
        reference.train(branch, steps)
        assert_same_training(reference, resumed)
        assert_same_training(straight(branch, steps, device=device), resumed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rebuild", [False, True], ids=["into-the-built-trainer", "built-again"])
def test_a_load_from_a_mapped_checkpoint_leaves_the_trainer_nothing_of_its_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rebuild: bool, device: str) -> None:
    """A load through the local store, decoded by mapping the memory file it read into (from 1
    MiB, here from 1 byte), copies every tensor into the trainer's own or into copies of their
    own, momentum buffers included (which the optimizer's ``load_state_dict`` keeps as given,
    and which a trainer built again has none of yet): nothing stays mapped, so the store reads
    the next object into the same memory. The training that follows equals that after a load
    of the bytes, bit for bit."""
    monkeypatch.setattr(checkpoint, "_BESIDE_BYTES", 1)
    store = LocalCheckpointStore(tmp_path)
    config = {"lr": Constant(0.1), "batch_size": Constant(32), "momentum": Constant(0.9)}
    session = straight(config, 20, device=device)
    ref = store.put(session.save()).ref
    session.train(config, 30)  # the trainer's momentum buffers now hold other values
    assert session.trainer.optimizer.state
    resumed = TrainingSession(session.trainer, 7, device)
    store.load(ref, lambda loaded: resumed.load(loaded.decode, rebuild=rebuild))
    assert store._memory._file is not None and not store._memory._file.mapped_privately()
    resumed.train(config, 45)
    reference = new_session(device=device)
    reference.load(store.get(ref))
    reference.train(config, 45)
    assert_same_training(reference, resumed)
    assert_same_training(straight(config, 45, device=device), resumed)


class InferenceStatistic(digits.DigitsTrainer):
    """The digits trainer with a tensor made under ``torch.inference_mode`` in its state (a
    statistic its evaluation keeps), which cannot be written in place outside that mode."""

    def build(self, seed: int, device: torch.device) -> None:
        super().build(seed, device)
        with torch.inference_mode():
            self.statistic = torch.zeros(4)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "statistic": self.statistic}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert all(t.device.type == "cpu" for t in state["model"].values())  # the Trainer's contract
        super().load_state_dict(state)
        with torch.inference_mode():
            self.statistic = state["statistic"].clone()


def test_a_load_into_the_built_trainer_hands_it_cpu_tensors_and_spares_its_inference_tensors() -> None:
    """The copy into the trainer's own tensors (:meth:`TrainingSession.load`) leaves tensors it
    cannot write in place (made under inference mode) to a copy of their own, and the trainer
    gets CPU tensors as the Trainer's contract says; the training equals a fresh build's."""
    config = {"lr": Constant(0.1), "batch_size": Constant(32), "momentum": Constant(0.9)}
    trainer = InferenceStatistic()
    session = TrainingSession(trainer, 7)
    session.start_fresh()
    session.train(config, 5)
    data = session.save()
    session.train(config, 12)
    resumed = TrainingSession(trainer, 7)
    resumed.load(data, rebuild=False)
    assert resumed.save() == data
    resumed.train(config, 12)
    reference = TrainingSession(InferenceStatistic(), 7)
    reference.load(data)
    reference.train(config, 12)
    assert_same_training(reference, resumed)


@pytest.mark.parametrize("pooled", [False, True], ids=["fresh", "pooled-buffers"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_encodes_to_the_checkpoint_and_stays_as_it_was_while_training_goes_on(device: str,
                                                                                         pooled: bool) -> None:
    config = {"lr": Constant(0.05), "batch_size": Constant(16), "momentum": Constant(0.9)}
    session = straight(config, 6, device=device)
    data = session.save()
    # what a worker hands to its writer thread (on CUDA, the tensors are copied on the device)
    snapshot = session.snapshot(SnapshotBuffers(min_bytes=0) if pooled else None).state
    assert encode_state(snapshot) == data
    session.train(config, 9)  # the weights and momentum buffers change in place
    assert session.save() != data
    assert encode_state(snapshot) == data
    resumed = new_session(device=device)
    resumed.load(encode_state(snapshot))
    resumed.train(config, 9)
    assert resumed.save() == session.save()


def test_checkpoint_bytes_are_a_function_of_the_state() -> None:
    config = {"lr": Constant(0.05), "batch_size": Constant(16), "momentum": Constant(0.9)}
    first, second = straight(config, 12), straight(config, 12)
    data = first.save()
    assert first.save() == data
    assert second.save() == data
    reloaded = new_session()
    reloaded.load(data)
    assert reloaded.save() == data
    state = decode_state(data)
    assert state["format"] == 1 and state["step"] == 12
    assert state["hp"] == {"batch_size": 16, "lr": 0.05, "momentum": 0.9}
    assert straight(config, 12, seed=8).save() != data


def test_evaluate_between_steps_changes_nothing() -> None:
    config = {"lr": Constant(0.1), "batch_size": Constant(32), "momentum": Constant(0.9)}
    plain = straight(config, 30)
    interleaved = new_session()
    interleaved.start_fresh()
    for stop in (10, 20, 30):
        interleaved.train(config, stop)
        rng = torch.get_rng_state()
        metrics = interleaved.evaluate()
        assert torch.equal(torch.get_rng_state(), rng)
        assert set(metrics) == {"val_acc", "val_loss"}
        assert all(type(value) is float for value in metrics.values())
    assert_same_training(plain, interleaved)


def test_setup_receives_changed_values_then_all_after_load() -> None:
    class Recording(digits.DigitsTrainer):
        def __init__(self) -> None:
            self.calls: list[tuple[int, dict[str, float | int]]] = []
            self._step = 0

        def setup(self, hp: dict[str, float | int]) -> None:
            self.calls.append((self._step, dict(hp)))
            super().setup(hp)

        def train_step(self, indices: torch.Tensor, step: int) -> None:
            self._step = step + 1
            super().train_step(indices, step)

    config = {"lr": MultiStep(0.1, [3], 0.1), "batch_size": Constant(8), "momentum": Constant(0.9)}
    trainer = Recording()
    session = TrainingSession(trainer, 7)
    session.start_fresh()
    session.train(config, 5)
    assert trainer.calls == [
        (0, {"batch_size": 8, "lr": 0.1, "momentum": 0.9}),
        (3, {"lr": 0.1 * 0.1}),
    ]
    resumed_trainer = Recording()
    resumed = TrainingSession(resumed_trainer, 7)
    resumed.load(session.save())
    resumed.train(config, 6)
    assert resumed_trainer.calls == [(0, {"batch_size": 8, "lr": 0.1 * 0.1, "momentum": 0.9})]


def test_default_batch_size_when_the_config_does_not_set_it() -> None:
    session = straight({"lr": Constant(0.1), "momentum": Constant(0.0)}, 3)
    sampler = decode_state(session.save())["sampler"]
    assert sampler["position"] == 3 * digits.DigitsTrainer.default_batch_size


class SelfSampling(digits.DigitsTrainer):
    """Draws its own mini-batches from the step-seeded global RNG."""

    hyperparameters = ("lr", "momentum")
    batch_size_hp = None

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        assert indices.dtype == torch.int64 and indices.shape == (0,)
        super().train_step(torch.randint(0, self.train_size(), (24,)), step)


def test_trainer_without_framework_batches_resumes_bit_for_bit() -> None:
    config = {"lr": MultiStep(0.1, [9], 0.5), "momentum": Constant(0.9)}
    whole = TrainingSession(SelfSampling(), 3)
    whole.start_fresh()
    whole.train(config, 20)
    first = TrainingSession(SelfSampling(), 3)
    first.start_fresh()
    first.train(config, 7)
    second = TrainingSession(SelfSampling(), 3)
    second.load(first.save())
    second.train(config, 20)
    assert_same_training(whole, second)
    assert decode_state(whole.save())["sampler"]["position"] == 0


def test_digits_trainer_learns() -> None:
    config = {"lr": Constant(0.1), "batch_size": Constant(32), "momentum": Constant(0.9)}
    session = straight(config, 150)
    metrics = session.evaluate()
    assert metrics["val_acc"] > 0.85
    assert session.trainer.train_size() == 1438
    assert session.trainer.val_labels.shape == (359,)


def test_seed_fixes_split_and_initial_weights() -> None:
    a, b, c = new_session(1), new_session(1), new_session(2)
    for session in (a, b, c):
        session.start_fresh()
    assert torch.equal(a.trainer.val_labels, b.trainer.val_labels)
    assert torch.equal(a.trainer.model.fc.weight, b.trainer.model.fc.weight)
    assert not torch.equal(a.trainer.val_images, c.trainer.val_images)
    assert not torch.equal(a.trainer.model.fc.weight, c.trainer.model.fc.weight)


def test_session_rejects_bad_calls() -> None:
    config = {"lr": Constant(0.1), "batch_size": Constant(32), "momentum": Constant(0.9)}
    session = new_session()
    with pytest.raises(RuntimeError, match="start_fresh"):
        session.train(config, 1)
    session.start_fresh()
    session.train(config, 5)
    with pytest.raises(ValueError, match="to_step"):
        session.train(config, 4)
    with pytest.raises(ValueError, match="'weight_decay'"):
        session.train({**config, "weight_decay": Constant(0.0)}, 6)
    with pytest.raises(ValueError, match="differ"):
        session.train({"lr": Constant(0.1)}, 6)
    with pytest.raises(ValueError, match="'batch_size'.*2.5"):
        session.train({**config, "batch_size": Constant(2.5)}, 6)
    assert session.step == 5
    with pytest.raises(ValueError, match="seed"):
        TrainingSession(digits.DigitsTrainer(), -1)


def test_step_seed_is_stable_and_63_bit() -> None:
    # Pinned values: the seeds of every step must be the same in every process, on every
    # platform and Python version, or a resumed run trains other bits (issue 11 item 18).
    assert step_seed(7, 3) == 277536969457835854
    assert step_seed(0, 0) == 7267929194294395901
    assert step_seed(2**63 - 1, 10**9) == 5323819536072168373
    seeds = {step_seed(seed, step) for seed in range(4) for step in range(50)}
    assert len(seeds) == 200
    assert all(0 <= value < 2**63 for value in seeds)


def test_trainer_fingerprint_and_name() -> None:
    trainer = digits.DigitsTrainer()
    assert trainer.name == "DigitsTrainer"
    assert trainer.fingerprint() == digits.DigitsTrainer().fingerprint()
    assert len(trainer.fingerprint()) == 64

    class Bumped(digits.DigitsTrainer):
        name = "DigitsTrainer"
        version = "2"

    assert Bumped().fingerprint() != trainer.fingerprint()

    class BadConstants(digits.DigitsTrainer):
        def constants(self) -> dict[str, object]:
            return {"dropout": float("nan")}

    with pytest.raises(ValueError, match="constants"):
        BadConstants().fingerprint()
    assert issubclass(digits.DigitsTrainer, Trainer)


# --- ResumableSampler -------------------------------------------------------


@settings(deadline=None, max_examples=50)
@given(
    st.integers(1, 40),
    st.integers(0, 2**63 - 1),
    st.lists(st.integers(1, 50), min_size=1, max_size=30),
)
def test_sampler_covers_each_index_once_per_permutation(
    n: int, seed: int, batch_sizes: list[int]
) -> None:
    sampler = ResumableSampler(n, seed)
    batches = [sampler.next_batch(size) for size in batch_sizes]
    for batch, size in zip(batches, batch_sizes):
        assert batch.dtype == torch.int64 and batch.shape == (size,)
    drawn = torch.cat(batches)
    full = len(drawn) // n
    for epoch in range(full):
        assert sorted(drawn[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    rest = drawn[full * n :].tolist()
    assert len(set(rest)) == len(rest)
    assert sampler.epoch == (len(drawn) - 1) // n
    assert sampler.position == len(drawn) - sampler.epoch * n


@settings(deadline=None, max_examples=50)
@given(
    st.integers(1, 40),
    st.integers(0, 2**32),
    st.lists(st.integers(1, 50), max_size=10),
    st.lists(st.integers(1, 50), min_size=1, max_size=10),
)
def test_sampler_state_round_trip(
    n: int, seed: int, before: list[int], after: list[int]
) -> None:
    sampler = ResumableSampler(n, seed)
    for size in before:
        sampler.next_batch(size)
    restored = ResumableSampler(n, seed + 1)
    restored.load_state_dict(decode_state(encode_state(sampler.state_dict())))
    for size in after:
        assert torch.equal(sampler.next_batch(size), restored.next_batch(size))
    assert encode_state(sampler.state_dict()) == encode_state(restored.state_dict())


def test_sampler_is_a_function_of_the_seed() -> None:
    def first_epoch(seed: int) -> torch.Tensor:
        return ResumableSampler(100, seed).next_batch(100)

    assert torch.equal(first_epoch(3), first_epoch(3))
    assert not torch.equal(first_epoch(3), first_epoch(4))


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        ResumableSampler(0, 1)
    with pytest.raises(ValueError, match="seed .*-1"):
        ResumableSampler(5, -1)
    sampler = ResumableSampler(5, 1)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        sampler.next_batch(0)
    with pytest.raises(ValueError, match="batch_size must be an int, got 2.0"):
        sampler.next_batch(2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be 6, got 5"):
        ResumableSampler(6, 1).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="position .* 9"):
        sampler.load_state_dict({**sampler.state_dict(), "position": 9})


class LabelSmoothing(digits.DigitsTrainer):
    """The digits CNN whose *evaluation* depends on a tuned value: ``val_loss`` is the
    cross-entropy with ``label_smoothing`` (issue 11 item 1)."""

    hyperparameters = ("lr", "batch_size", "momentum", "label_smoothing")

    def build(self, seed: int, device: torch.device) -> None:
        super().build(seed, device)
        self.smoothing = 0.0  # the build default: what a session that never called setup uses

    def setup(self, hp: dict[str, float | int]) -> None:
        super().setup(hp)
        if "label_smoothing" in hp:
            self.smoothing = float(hp["label_smoothing"])

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        logits = self.model(self.val_images)
        self.model.train()
        loss = torch.nn.functional.cross_entropy(logits, self.val_labels, label_smoothing=self.smoothing)
        return {"val_loss": loss.item()}


SMOOTHED = {"lr": Constant(0.1), "batch_size": Constant(16), "momentum": Constant(0.0),
            "label_smoothing": Constant(0.3)}


def test_evaluate_right_after_load_sees_the_tuned_values() -> None:
    """An evaluation-only stage loads a checkpoint and evaluates without training a step: the
    session must hold the values of step s-1 applied, as a straight run does at s."""
    session = TrainingSession(LabelSmoothing(), 7)
    session.start_fresh()
    session.train(SMOOTHED, 6)
    expected = session.evaluate()
    resumed = TrainingSession(LabelSmoothing(), 7)
    resumed.load(session.save())
    assert resumed.evaluate() == expected
    build_default = TrainingSession(LabelSmoothing(), 7)
    build_default.load(session.save())
    build_default.trainer.smoothing = 0.0
    assert build_default.evaluate() != expected  # the test would see the defect


def test_an_evaluation_only_dispatch_reports_what_a_straight_run_reports(tmp_path: Path) -> None:
    """Through the path executor: a checkpoint exists at step 6 but its metrics do not (a later
    study asks for a step an earlier one only checkpointed); the evaluation-only stage reports
    the straight run's metrics bit for bit."""
    from events.models import CheckpointSource, MetricsReported, StageDispatched, StageSpec
    from gpu_worker.checkpoint import LocalCheckpointStore
    from gpu_worker.executor import PathExecutor

    session = TrainingSession(LabelSmoothing(), 7)
    session.start_fresh()
    session.train(SMOOTHED, 6)
    expected = session.evaluate()
    store = LocalCheckpointStore(tmp_path)
    ref = store.put(session.save())
    dispatch = StageDispatched(dispatch_id="d0", worker_id="w0", plan_key="p", seed=7, decided_at=0,
                               source=CheckpointSource(node_id="n0", step=6, ref=ref.ref),
                               stages=[StageSpec(node_id="n0", hp=SMOOTHED, from_step=6, to_step=6, evaluate=True)])
    events: list = []
    PathExecutor(LabelSmoothing(), "w0", store, torch.device("cpu")).run(dispatch, events.extend)
    (metrics,) = [e for e in events if isinstance(e, MetricsReported)]
    assert metrics.metrics == expected


def test_determinism_is_set_without_importing_torchs_compiler() -> None:
    """set_determinism has the effect of torch.use_deterministic_algorithms(True) without its
    import of torch._inductor and torch._dynamo (seconds and hundreds of MB per worker); a
    trainer importing inductor later (torch.compile) still gets its deterministic flag."""
    import subprocess

    code = ("import sys, torch\n"
            "def compiler(): return {m for m in sys.modules if m.startswith(('torch._inductor', 'torch._dynamo'))}\n"
            "before = compiler()  # nothing from torch 2.6 on; torch 2.5 imports inductor's config itself\n"
            "from gpu_worker.session import set_determinism\n"
            "set_determinism()\n"
            "assert torch.are_deterministic_algorithms_enabled()\n"
            "assert compiler() == before, sorted(compiler() - before)\n"
            "import torch._inductor.config as c\n"
            "assert getattr(c, 'deterministic', True) is True  # the flag exists from torch 2.6 on\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr


def test_steps_seed_the_cpu_generator_as_torch_manual_seed_does_without_queuing_accelerator_seeds() -> None:
    """A CPU session's per-step seeding (``seed_global_rng``) draws what ``torch.manual_seed``
    draws, and queues no lazy seed for an accelerator this process never initialised
    (``torch.manual_seed`` formats the caller's whole stack for each: a fifth of a small step)."""
    import subprocess

    code = ("import torch\n"
            "from gpu_worker.session import TrainingSession, seed_global_rng\n"
            "torch.manual_seed(11); a = torch.rand(5)\n"
            "seed_global_rng(11, torch.device('cpu')); b = torch.rand(5)\n"
            "assert torch.equal(a, b), (a, b)\n"
            "tracker = torch.cuda._lazy_seed_tracker\n"
            "tracker.manual_seed_all_cb = tracker.manual_seed_cb = None; tracker.call_order = []\n"
            "queued = len(torch.cuda._queued_calls)\n"
            "import sys; sys.path.insert(0, 'examples')\n"
            "from digits import DigitsTrainer\n"
            "from events.hp import Constant\n"
            "s = TrainingSession(DigitsTrainer(), 3)\n"
            "s.start_fresh()\n"
            "s.train({'lr': Constant(0.1), 'batch_size': Constant(8), 'momentum': Constant(0.0)}, 20)\n"
            "assert tracker.call_order == [] and tracker.manual_seed_all_cb is None, tracker.call_order\n"
            "assert len(torch.cuda._queued_calls) == queued\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "ok", out.stderr
