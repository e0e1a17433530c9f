"""Your own loader feeding the private step (trainer/private/loader.py): `sample()` hands out the
run's Poisson sample, the user's pipeline loads those examples, `step(batch)` trains on them —
the same run, bit for bit, as widedp reading the data set itself (example and user level), and
refusals that name what is wrong."""

import numpy as np
import pytest
import torch

from test_make_private import SETTINGS, Tower, _data, _ebc, bce
from widedp.trainer.private import KJTDataset, LoaderData, make_private

RUN = [*SETTINGS, "privacy.reproducible=true", "privacy.noise_seed=11"]


def _tables(trainer):
    return trainer.embedding_state_dict(), {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_same(a, b):
    for got, want in zip(a, b):
        assert got.keys() == want.keys()
        for key in got:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


@pytest.mark.parametrize("unit", ["example", "user"])
def test_a_loader_fed_run_is_the_run_widedp_samples_itself(unit):
    data = _data(n=600)
    extra = ["privacy.unit=user", "privacy.max_examples_per_user=4"] if unit == "user" else []
    torch.manual_seed(0)
    with make_private(_ebc(), Tower(), bce, data, target_epsilon=4.0, batch_size=60, steps=4,
                      config=[*RUN, *extra]) as trainer:
        assert trainer.train() == 4
        want, want_eps = _tables(trainer), trainer.epsilon()
    torch.manual_seed(0)
    shape = LoaderData(len(data), units=data.units() if unit == "user" else None, num_dense=data.num_dense)
    seen = []
    with make_private(_ebc(), Tower(), bce, shape, target_epsilon=4.0, batch_size=60, steps=4,
                      config=[*RUN, *extra]) as trainer:
        while (idx := trainer.sample()) is not None:
            assert np.array_equal(trainer.sample(), idx)  # asking again: the same draw
            picked = data.take(idx)  # "the user's pipeline": exactly those examples, in that order
            assert trainer.step((picked.sparse, picked.labels, picked.dense)) is not None
            seen.append(idx.size)
        assert len(seen) == 4 and trainer.sample() is None and trainer.epsilon() == want_eps
        _assert_same(_tables(trainer), want)


def test_loader_mode_refuses_what_it_cannot_check_or_do():
    data = _data(n=300)
    shape = LoaderData(len(data), num_dense=data.num_dense)
    with make_private(_ebc(), Tower(), bce, shape, target_epsilon=4.0, batch_size=40, steps=3, config=RUN) as trainer:
        with pytest.raises(ValueError, match=r"step\(batch\) needs this step's sample first"):
            trainer.step(data.subset(np.arange(5)))
        with pytest.raises(ValueError, match="with your own loader loop"):
            trainer.train()
        idx = trainer.sample()
        with pytest.raises(ValueError, match=rf"the batch holds {idx.size + 1} examples, this step's sample {idx.size}"):
            trainer.step(data.subset(np.arange(idx.size + 1)))
        with pytest.raises(TypeError, match=r"batch must be a KJTDataset or a tuple \(KeyedJaggedTensor, labels"):
            trainer.step([1, 2, 3])
        wrong = data.take(idx)
        with pytest.raises(ValueError, match="0 dense features per example, LoaderData says 3"):
            trainer.step((wrong.sparse, wrong.labels))
        assert trainer.steps_taken == 0 and np.array_equal(trainer.sample(), idx)  # nothing spent, same draw
        # an id outside its table is named with the example's index in the user's data
        bad = wrong.sparse.values().clone()
        bad[0] = 10_000
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = KeyedJaggedTensor(keys=wrong.sparse.keys(), values=bad, lengths=wrong.sparse.lengths(),
                                stride=wrong.sparse.stride())
        with pytest.raises(ValueError, match=rf"feature 'item', dataset example {idx[0]}: id 10000 is outside table"):
            trainer.step((kjt, wrong.labels, wrong.dense))
    with make_private(_ebc(), Tower(), bce, data, target_epsilon=4.0, batch_size=40, steps=3, config=RUN) as trainer:
        with pytest.raises(ValueError, match="sample\\(\\) feeds your own loader"):
            trainer.sample()
        with pytest.raises(ValueError, match=r"step\(batch\) is for your own loader"):
            trainer.step(data.subset(np.arange(5)))
    with pytest.raises(ValueError, match="selects once over the whole data set"):
        make_private(_ebc(), Tower(), bce, shape, target_epsilon=4.0, batch_size=40, steps=3,
                     config=[*RUN, "train.selection=fest-threshold"])
    with pytest.raises(ValueError, match=r"trainer actors \(cluster.trainer_placement\) read the training set"):
        make_private(_ebc(), Tower(), bce, shape, target_epsilon=4.0, batch_size=40, steps=3, backend="ray",
                     config=[*RUN, "cluster.trainer_placement=actors", "cluster.num_trainers=2"])
    with pytest.raises(ValueError, match='privacy.user_sampling = "examples" trims each user'):
        make_private(_ebc(), Tower(), bce, LoaderData(len(data), units=data.units(), num_dense=3), target_epsilon=4.0,
                     batch_size=40, steps=3, config=[*RUN, "privacy.unit=user", "privacy.user_sampling=examples"])
    with pytest.raises(ValueError, match="num_examples must be an integer >= 1, got 0"):
        LoaderData(0)
    with pytest.raises(ValueError, match="units has 3 entries, num_examples is 300"):
        LoaderData(300, units=[1, 2, 3])
    assert isinstance(data, KJTDataset)


def test_a_loader_feeds_sequence_features_as_widedp_reads_them():
    from test_sequence_features import LENGTHS, SequenceModel, _data as sequences, _modules, bce as seq_bce

    data = sequences(n=300)
    settings = ["train.optimizer=sgd", "privacy.reproducible=true", "privacy.noise_seed=2", "train.selection=threshold"]
    got = []
    for fed in (False, True):
        torch.manual_seed(0)
        source = LoaderData(len(data), num_dense=data.num_dense) if fed else data
        with make_private(_modules(), SequenceModel(), seq_bce, source, target_epsilon=4.0, batch_size=40, steps=3,
                          max_sequence_length=LENGTHS, config=settings) as trainer:
            if fed:
                while (idx := trainer.sample()) is not None:
                    trainer.step(data.subset(idx))  # a KJTDataset of exactly those examples
            else:
                trainer.train()
            got.append((_tables(trainer), trainer.epsilon()))
    assert got[0][1] == got[1][1]
    _assert_same(got[1][0], got[0][0])
