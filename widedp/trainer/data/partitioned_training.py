"""A partitioned training set as a run uses it (trainer/data/format/partitioned.py has the
on-disk format): the coordinator's handle, which holds the data set's public shape and no
example (`PartitionedTrainSet`), and each trainer's share — its parts and the streams it samples
them with (`TrainerShare`, `TrainerShares`).

Privacy assumption: trainer/data/sampler.py `PartitionSampler`'s — every part sampled at the one
rate q from a stream of its own, so the union over the trainers is a global Poisson(q) sample.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
from widedp.trainer.data.errors import DataError
from widedp.trainer.data.format.meta import DatasetMeta
from widedp.trainer.data.format.partitioned import (MANIFEST_FILE, PartsView, manifest_sha256, open_part, part_dir,
                                                    part_of, read_manifest, read_part_meta)
from widedp.trainer.data.format.remote import local_path, refuse_staged_copy, remote_dir
from widedp.trainer.data.sampler import PartitionSampler


class PartitionedTrainSet:
    """The coordinator's handle on a partitioned training split: its public shape only (n, U,
    the parts' sizes, the data set's metadata), never an example. Trainers open their own parts
    (`open_parts`).

    Args:
        directory: the partitioned data set: a local path, or a URI (trainer/data/format/remote.py;
            each trainer then stages its own parts into `stage_dir`).
        max_examples_per_unit: user level (privacy.unit = "user", users sampled): the public
            cap k on a sampled user's examples; None: example level.
        stage_dir: where a trainer stages its parts of a data set at a URI (None: the default,
            `remote.default_stage_root()` on the trainer's node).

    `len()` is n; `unit_level` whether a run samples users (then `num_units` is U)."""

    partitioned = True

    def __init__(self, directory, max_examples_per_unit: Optional[int] = None, stage_dir: Optional[str] = None):
        remote = remote_dir(directory)
        self.location = remote.uri if remote is not None else str(local_path(directory))
        self.directory = remote.where("") if remote is not None else local_path(directory)  # as shown
        if remote is None:
            refuse_staged_copy(self.directory)
        self.stage_dir = stage_dir or None
        self.manifest = read_manifest(self.location)
        #: the partitioning this run trains on: every trainer refuses parts of another
        self.manifest_sha256 = manifest_sha256(self.location)
        unit_level = max_examples_per_unit is not None
        self.max_examples_per_unit = max_examples_per_unit
        if unit_level and self.manifest.partition_by != "unit":
            raise DataError(f"{self.directory}/{MANIFEST_FILE}: privacy.unit = \"user\" needs a data set partitioned "
                            "by unit (`widedp convert partition --by unit`), so that each user's examples stay in "
                            f"one part; this one is partitioned by {self.manifest.partition_by}")
        self.unit_level = bool(unit_level)
        self.meta: DatasetMeta = dataclasses.replace(read_part_meta(self.location, self.manifest),
                                                     num_examples=self.manifest.num_examples)
        self.name = "train"

    def __len__(self) -> int:
        return self.manifest.num_examples

    def __repr__(self) -> str:
        return f"PartitionedTrainSet({self.directory}, parts={self.manifest.num_parts}, n={len(self)})"

    @property
    def num_units(self) -> Optional[int]:
        return self.manifest.num_units

    def parts_of_trainer(self, trainer: int, num_trainers: int) -> list[int]:
        """The parts trainer `trainer` of `num_trainers` reads: j with j mod N = trainer."""
        if num_trainers > self.manifest.num_parts:
            raise ValueError(f"{self.directory}: {num_trainers} trainers but only {self.manifest.num_parts} parts; "
                             "each trainer reads whole parts (partition the data set into at least as many parts)")
        return [j for j in range(self.manifest.num_parts) if j % num_trainers == trainer]

    def trainer_shares(self, num_trainers: int, sample_rate: float, part_generator) -> "TrainerShares":
        """Every trainer's `TrainerShare` (what the engine hands its trainers)."""
        return TrainerShares(self, num_trainers, sample_rate, part_generator, self.max_examples_per_unit)

    def take(self, indices):
        raise RuntimeError("a partitioned training set is read by the trainers that own its parts, "
                           "never by the coordinator")

    def units(self):
        return None  # the coordinator holds no unit column; trainers read theirs


@dataclasses.dataclass
class TrainerShare:
    """What one trainer needs to read and sample its own parts, and nothing of the others:
    the data set's directory (or URI), its part indices, q, the cap on a unit's examples (user
    level; None at example level) and one generator per part (`PartitionSampler`'s streams).
    Sent to a trainer actor, which opens its parts itself (`open`)."""

    directory: str
    parts: list
    sample_rate: float
    generators: list
    max_examples_per_unit: Optional[int] = None
    num_parts: int = 0  # K of the whole data set (user level: each unit's part is checked against it)
    stage_dir: Optional[str] = None  # a data set at a URI: where this trainer stages its parts
    manifest_sha256: Optional[str] = None  # the coordinator's partitioning (another one is refused)

    def open(self):
        """(the trainer's parts as one split, its `PartitionSampler`). A data set at a URI: the
        trainer's own parts are staged first (downloaded once per node; no other part is read).
        A manifest other than the coordinator's is refused (the data set was replaced)."""
        remote = remote_dir(self.directory)
        if remote is not None:
            manifest = read_manifest(self.directory)
            index = {manifest.parts[j].directory: j for j in self.parts}
            local, splits = remote.stage(list(index), self.stage_dir, expected_manifest_sha256=self.manifest_sha256,
                                         opener=lambda root, rel: open_part(root, index[rel]))
        else:
            local = local_path(self.directory)
            if self.manifest_sha256 is not None and manifest_sha256(local) != self.manifest_sha256:
                raise DataError(f"{local}/{MANIFEST_FILE}: not the manifest this run started with: the data set was "
                                "replaced; a run trains on one data set")
            splits = [open_part(local, j) for j in self.parts]
        view = PartsView(splits)
        units = None
        if self.max_examples_per_unit is not None:
            units = [s.units() for s in splits]
            if any(u is None for u in units):
                raise DataError(f"{self.directory}: privacy.unit = \"user\" needs the parts' unit column")
            for j, labels in zip(self.parts, units):  # every user in the part its label hashes to: in one part only
                wrong = np.flatnonzero(part_of(labels, self.num_parts) != j)
                if wrong.size:
                    raise DataError(f"{local / part_dir(j)}: example {int(wrong[0])} has unit "
                                    f"{int(labels[wrong[0]])}, whose part is {int(part_of(labels[wrong[:1]], self.num_parts)[0])} "
                                    "of the manifest's parts: a user's examples must all be in one part (written by "
                                    "`widedp convert partition --by unit`), else one user moves two parts' sums")
        sampler = PartitionSampler(view.part_sizes(), self.sample_rate, self.generators, units,
                                   self.max_examples_per_unit)
        return view, sampler


class TrainerShares:
    """Every trainer's `TrainerShare` of a partitioned training set: `share(i, restart)` is
    trainer i's; a trainer restored after a death (`restart` r > 0) samples from streams of its
    own (the run's "sampler" key derived with (part, restart)), so no coin is ever drawn twice.

    Args:
        train_set: the coordinator's `PartitionedTrainSet`.
        num_trainers: N; trainer i reads parts j with j mod N = i.
        sample_rate: q.
        part_generator: (part index, restart) -> numpy Generator, independent for every pair.
        max_examples_per_unit: user level: k; None at example level.
    """

    partitioned_shares = True

    def __init__(self, train_set: PartitionedTrainSet, num_trainers: int, sample_rate: float, part_generator,
                 max_examples_per_unit: Optional[int] = None):
        self.train_set, self.num_trainers, self.sample_rate = train_set, int(num_trainers), float(sample_rate)
        self.part_generator, self.max_examples_per_unit = part_generator, max_examples_per_unit
        for i in range(self.num_trainers):
            train_set.parts_of_trainer(i, self.num_trainers)  # refuses N > K

    @property
    def meta(self) -> DatasetMeta:
        return self.train_set.meta

    def __len__(self) -> int:
        return len(self.train_set)

    def share(self, trainer: int, restart: int = 0) -> TrainerShare:
        parts = self.train_set.parts_of_trainer(trainer, self.num_trainers)
        return TrainerShare(self.train_set.location, parts, self.sample_rate,
                            [self.part_generator(j, restart) for j in parts], self.max_examples_per_unit,
                            self.train_set.manifest.num_parts, self.train_set.stage_dir,
                            self.train_set.manifest_sha256)
