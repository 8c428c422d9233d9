"""The trainer under a canary rollout: protected versions stay servable (also after a
restart), a rollback rewinds the weights exactly with a fresh optimiser, and samples of
retired versions are never trained, with the token books exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from harnessrl.services.trainer.archive import WEIGHTS, VersionArchive
from harnessrl.services.trainer.checkpoint import Checkpoints, TrainerState
from harnessrl.services.trainer.config import LoraSection, TrainerSection
from harnessrl.services.trainer.delivery import LedgerState
from harnessrl.services.trainer.distributed import World
from harnessrl.services.trainer.journal import StepJournal, lineage, read, trained
from harnessrl.services.trainer.policy import Policy
from harnessrl.services.trainer.rollout_watch import RolloutWatch
from harnessrl.trust.batching import Batcher
from harnessrl.trust.packing import SampleArrays
from harnessrl.v1 import events_pb2 as pb
from harnessrl.weights import WeightSyncServer, WeightSyncSettings
from harnessrl.weights.store import VersionStore, snapshot

VOCAB = 64
LORA = LoraSection(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Qwen2 saved as a model directory (what trainer.model names)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    directory = tmp_path_factory.mktemp("base")
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def _held(version: int) -> Any:
    tensors = {"w": torch.full((4,), float(version))}
    return snapshot(version, version, tensors, algorithm="xxh3_64", shared_memory=False)


def test_protected_versions_are_never_evicted_and_may_come_back_out_of_order() -> None:
    store = VersionStore(keep=2)
    for version in range(3):
        store.add(_held(version))
    assert store.versions == [1, 2]
    store.protect({1})
    for version in range(3, 7):
        store.add(_held(version))
    assert store.versions == [1, 5, 6]  # 1 kept besides the newest two
    store.protect({1, 3})  # a restarted trainer re-holds 3, older than what it holds
    store.add(_held(3))
    assert store.versions == [1, 3, 5, 6]
    with pytest.raises(ValueError, match="not newer"):
        store.add(_held(4))  # not protected: versions still increase
    store.protect({3})  # 1 is no longer needed: evicted at once
    assert store.versions == [3, 5, 6]
    assert store.latest is not None and store.latest.manifest.version == 6


def _announce(fold: RolloutWatch, version: int, base: int | None = None) -> None:
    fold.announced(pb.PolicyVersion(version=version, base=base))


def _decide(action: Any, version: int, stable: int, share: float = 0.0) -> pb.RolloutDecision:
    return pb.RolloutDecision(
        decision_id=f"{action}-{version}", action=action, version=version, stable=stable,
        share=share, actor="canary",
    )  # fmt: skip


async def test_stable_and_candidate_are_archived_and_served_again_after_a_restart(
    tmp_path: Path,
) -> None:
    archive = VersionArchive(tmp_path / "versions")
    watch = RolloutWatch(archive)
    server = WeightSyncServer(WeightSyncSettings(port=0, keep_versions=1))
    published = {}
    for version in range(3):
        tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64)}
        published[version] = await server.publish(version, version * 10, tensors)
        _announce(watch, version)
        await watch.keep(server)
    assert watch.decided(_decide(pb.ROLLOUT_ACTION_START, 2, stable=0, share=0.2))
    await watch.keep(server)
    assert watch.needed() == {0, 2} and archive.versions() == [0, 2]
    await server.publish(3, 30, {"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.int64)})
    assert server.versions == [0, 2, 3]  # keep_versions=1, plus the protected two
    await server.stop()

    # A restarted trainer: a new server, the rollout folded again from hrl.policy.
    again = RolloutWatch(VersionArchive(tmp_path / "versions"))
    for version in range(4):
        _announce(again, version)
    again.decided(_decide(pb.ROLLOUT_ACTION_START, 2, stable=0, share=0.2))
    fresh = WeightSyncServer(WeightSyncSettings(port=0, keep_versions=1))
    await fresh.publish(4, 40, {"a": torch.ones(3, 5), "b": torch.ones(7, dtype=torch.int64)})
    assert await again.restore(fresh) == [0, 2]
    assert fresh.versions == [0, 2, 4]
    for version in (0, 2):
        manifest = fresh.manifest(version)
        assert manifest is not None
        assert manifest.manifest_checksum == published[version].manifest_checksum
        assert manifest.step == version * 10
    # Promoted: 2 is stable, 0 stays (the one stable before it), nothing else is archived.
    assert again.decided(_decide(pb.ROLLOUT_ACTION_PROMOTE, 2, stable=0))
    await again.keep(fresh)
    assert again.needed() == {0, 2}
    await fresh.stop()


def test_the_fold_retires_a_rolled_back_candidate_and_its_descendants(tmp_path: Path) -> None:
    watch = RolloutWatch(VersionArchive(tmp_path))
    for version in range(4):
        _announce(watch, version)
    assert watch.decided(_decide(pb.ROLLOUT_ACTION_START, 2, stable=0, share=0.5))
    premature = _decide(pb.ROLLOUT_ACTION_PROMOTE, 1, stable=0)
    assert not watch.decided(premature)  # refused: candidate 2 is pending
    assert watch.decided(_decide(pb.ROLLOUT_ACTION_ROLLBACK, 2, stable=0))
    assert not watch.decided(_decide(pb.ROLLOUT_ACTION_ROLLBACK, 2, stable=0))  # applied before
    assert [v for v in range(4) if watch.retired(v)] == [2, 3]
    # Seen again (history at start, then the consumer's offsets): refused the first time, it
    # stays refused, though it would apply now.
    assert not watch.decided(premature) and watch.state.stable == 0
    premature.decision_id = "operator-again"
    assert watch.decided(premature) and watch.state.stable == 1
    _announce(watch, 4, base=1)  # the trainer's first version after its rewind
    assert not watch.retired(4)
    assert watch.needed() == {0, 1}  # stable, and the one before it


def _sample(sample_id: str, low: int, high: int) -> pb.Sample:
    return pb.Sample(
        sample_id=sample_id, episode_id=sample_id, token_ids=[1, 2, 3, 4],
        loss_mask=[False, True, True, True], behavior_logprobs=[0.0, -1.0, -1.0, -1.0],
        advantage=1.0, temperature=1.0, policy_version_min=low, policy_version_max=high,
    )  # fmt: skip


def test_samples_of_retired_versions_are_dropped_at_arrival_and_when_taken(
    tmp_path: Path,
) -> None:
    watch = RolloutWatch(VersionArchive(tmp_path))
    for version in range(4):
        _announce(watch, version)
    batcher = Batcher(batch_groups=8, batch_tokens=None, max_staleness=10, retired=watch.retired)
    waiting = pb.GroupSamples(group_id="g1", samples=[_sample("g1/a", 2, 2), _sample("g1/b", 1, 1)])
    assert batcher.add(waiting, version=3, trained=set()) == ["g1/a", "g1/b"]
    watch.decided(_decide(pb.ROLLOUT_ACTION_START, 2, stable=0, share=0.5))
    watch.decided(_decide(pb.ROLLOUT_ACTION_ROLLBACK, 2, stable=0))
    arriving = pb.GroupSamples(
        group_id="g2",
        samples=[
            _sample("g2/a", 1, 3),  # its calls span the retired 2 and 3
            _sample("g2/b", 3, 0),  # policy_version_max unset: its one version, 3
            _sample("g2/c", 0, 1),
        ],
    )
    assert batcher.add(arriving, version=3, trained=set()) == ["g2/c"]
    assert batcher.dropped["rolled_back"] == 2 and batcher.dropped_tokens["rolled_back"] == 6
    batch = batcher.take(version=3)
    assert [s.sample_id for s in batch.samples] == ["g1/b", "g2/c"]
    assert batch.stale == ["g1/a"]  # produced by 2 before its rollback: dropped when taken
    assert batcher.dropped["rolled_back"] == 3 and batcher.dropped_tokens["rolled_back"] == 9


def test_the_lineage_after_a_rewind_leaves_the_retired_steps_out(tmp_path: Path) -> None:
    journal = StepJournal(tmp_path, resumed_from=0)
    for step in range(1, 5):
        journal.record(step, step, [f"s{step}"])
    journal.rewind(4, 2)  # versions 3 and 4 were rolled back; the weights are 2's
    journal.record(5, 5, ["s5"])
    records = read(tmp_path / "steps.jsonl")
    assert [(r.step, r.version) for r in lineage(records)] == [(1, 1), (2, 2), (5, 5)]
    # The books: samples trained into retired versions stay trained.
    assert [r.step for r in trained(records)] == [1, 2, 3, 4, 5]
    # A crash after step 5, resumed from the checkpoint written right after the rewind.
    StepJournal(tmp_path, resumed_from=4)
    records = read(tmp_path / "steps.jsonl")
    assert [r.step for r in lineage(records)] == [1, 2]
    assert [r.step for r in trained(records)] == [1, 2, 3, 4]


def test_a_checkpoint_saved_after_a_rewind_replaces_the_one_of_its_step(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path, keep=2)

    def write(weights: str) -> Any:
        return lambda directory: (directory / "weights").write_text(weights)

    state = TrainerState(step=4, policy_version=4, ledger=LedgerState({}))
    checkpoints.save(write("retired"), state)
    with pytest.raises(FileExistsError):
        checkpoints.save(write("stable"), state)
    rewound = TrainerState(4, 4, LedgerState({}), extra={"weights": 2, "base": 1})
    path = checkpoints.save(write("stable"), rewound, replace=True)
    assert checkpoints.latest() == path and (path / "weights").read_text() == "stable"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]
    loaded = checkpoints.load(path, lambda _: None, restore_rng=False)
    assert loaded.extra == {"weights": 2, "base": 1}


def _samples(seed: int) -> list[SampleArrays]:
    generator = np.random.default_rng(seed)
    samples = []
    for row in range(3):
        tokens = generator.integers(0, VOCAB, 12).astype(np.int64)
        mask = np.zeros(tokens.size, dtype=np.bool_)
        mask[4:] = True
        samples.append(
            SampleArrays(
                sample_id=f"s{row}", episode_id=f"e{row}", token_ids=tokens, loss_mask=mask,
                behavior=np.where(mask, -4.0, 0.0).astype(np.float32),
                advantage=1.0 if row % 2 else -1.0, temperature=1.0, policy_version_min=0,
            )
        )  # fmt: skip
    return samples


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
async def test_a_rewind_restores_the_stable_weights_exactly_with_a_fresh_optimiser(
    base_dir: Path, tmp_path: Path, lora: LoraSection | None
) -> None:
    settings = TrainerSection(model=base_dir, device="cpu", dtype="float32", lora=lora, lr=1e-2)
    policy = Policy.load(settings, World())
    policy.step(_samples(0))
    server = WeightSyncServer(WeightSyncSettings(port=0))
    manifest = await server.publish(1, 1, policy.state_dict())
    stable = {k: v.clone() for k, v in policy.model.state_dict().items()}
    published = server.published(1)
    assert published is not None
    archive = VersionArchive(tmp_path / "versions")
    archive.save(*published)
    for seed in (1, 2):  # the candidate's line, later rolled back
        policy.step(_samples(seed))
    assert policy.optimizer.state
    assert any(not torch.equal(v, stable[k]) for k, v in policy.model.state_dict().items())

    policy.rewind(archive.path(1) / WEIGHTS)
    assert all(torch.equal(v, stable[k]) for k, v in policy.model.state_dict().items())
    assert not policy.optimizer.state  # fresh: no moments of the retired line
    optimised = [p for group in policy.optimizer.param_groups for p in group["params"]]
    assert {p.data_ptr() for p in optimised} == {
        p.data_ptr() for p in policy.model.parameters() if p.requires_grad
    }
    again = await server.publish(2, 2, policy.state_dict())
    assert again.manifest_checksum == manifest.manifest_checksum  # what is served is 1's
    policy.step(_samples(3))  # and it trains on from there
    await server.stop()


def test_a_rewind_to_weights_of_another_model_changes_nothing(
    base_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    settings = TrainerSection(model=base_dir, device="cpu", dtype="float32", lora=LORA)
    policy = Policy.load(settings, World())
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    wrong = {name: torch.zeros(2, 2) for name in before}
    save_file(wrong, str(tmp_path / WEIGHTS))
    with pytest.raises(ValueError, match="mis-shaped"):
        policy.rewind(tmp_path / WEIGHTS)
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())


async def test_a_needed_version_published_after_it_was_needed_is_archived_then(
    tmp_path: Path,
) -> None:
    """At start the consumer may fold the trainer's version before it is served again."""
    archive = VersionArchive(tmp_path / "versions")
    watch = RolloutWatch(archive)
    _announce(watch, 0)
    server = WeightSyncServer(WeightSyncSettings(port=0))
    await watch.keep(server)
    assert archive.versions() == []
    await server.publish(0, 0, {"a": torch.ones(2)})
    await watch.keep(server)
    assert archive.versions() == [0]
    manifest, tensors = archive.load(0)
    assert manifest.version == 0 and torch.equal(tensors["a"], torch.ones(2))
    await server.stop()


def test_a_lora_trainer_resumes_from_its_checkpoint(base_dir: Path, tmp_path: Path) -> None:
    """The checkpoint holds the adapters only: loading it restores them and their moments,
    and the frozen base (not in it) is no missing key."""
    settings = TrainerSection(model=base_dir, device="cpu", dtype="float32", lora=LORA, lr=1e-2)
    policy = Policy.load(settings, World())
    policy.step(_samples(0))
    policy.save_tensors(tmp_path)
    resumed = Policy.load(settings, World())
    resumed.load_tensors(tmp_path)
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in resumed.state_dict().items())
    assert len(resumed.optimizer.state) == len(policy.optimizer.state) > 0
