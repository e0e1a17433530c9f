"""`widedp.make_private` (trainer/private/): a user's TorchRec tables, dense module and loss
trained by the engine `widedp train` uses — the same run bit for bit, refusals that name what is
wrong, a coupled loss refused before anything is spent, and the tables handed back in the
user's EmbeddingBagCollection."""

import re

import numpy as np
import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from widedp.accounting import PrivacyLedger
from widedp.trainer.config import load_config
from widedp.trainer.models import DLRM
from widedp.trainer.private import KJTDataset, make_private
from widedp.trainer.private.dense import CoupledLossError
from widedp.trainer.run.train import build_run

D = 8


def _ebc(dims=(D, D)):
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="item_table", embedding_dim=dims[0], num_embeddings=300,
                           feature_names=["item", "last_item"]),  # one table read by two features
        EmbeddingBagConfig(name="user_table", embedding_dim=dims[1], num_embeddings=100, feature_names=["user"],
                           pooling=PoolingType.MEAN)])


def _data(n=2000, seed=0, history=True):
    """Clicks whose label is planted in the item id; `last_item` a bag of 0..3 ids."""
    rng = np.random.default_rng(seed)
    item, user = rng.integers(0, 300, n), rng.integers(0, 100, n)
    hist_len = rng.integers(0, 4, n) if history else np.ones(n, np.int64)
    hist = rng.integers(0, 300, int(hist_len.sum()))
    labels = ((item % 5) < 2).astype(np.float32)
    kjt = KeyedJaggedTensor(keys=["item", "last_item", "user"],
                            values=torch.from_numpy(np.concatenate([item, hist, user])),
                            lengths=torch.from_numpy(np.concatenate([np.ones(n), hist_len, np.ones(n)]).astype(np.int32)))
    return KJTDataset(kjt, torch.from_numpy(labels), dense=torch.from_numpy(rng.normal(size=(n, 3)).astype(np.float32)),
                      units=user)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3 * D + 3, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, pooled, dense):
        return self.mlp(torch.cat([pooled["item"], pooled["last_item"], pooled["user"], dense], 1)).squeeze(-1)


def bce(outputs, labels):
    return nn.functional.binary_cross_entropy_with_logits(outputs, labels, reduction="none")


SETTINGS = ["train.lr=0.05", "train.dense_lr=0.01", "train.optimizer=adagrad"]


@pytest.mark.parametrize("mode", ["sparse", "dpsgd", "nonprivate"])
def test_a_user_ebc_and_tower_train_and_spend_what_the_ledger_says(mode, tmp_path):
    torch.manual_seed(0)
    ledger_file = tmp_path / "ledger.json"
    with make_private(_ebc(), Tower(), bce, _data(), mode=mode, target_epsilon=4.0, batch_size=100, steps=30,
                      config=SETTINGS, ledger_path=ledger_file) as trainer:
        assert trainer.train() == 30 and trainer.step() is None  # the planned steps, then no more
        metrics = trainer.evaluate(_data(seed=1))
        if mode == "nonprivate":
            assert trainer.ledger is None and trainer.epsilon() == 0.0
            assert metrics["auc"] > 0.95
        else:
            assert trainer.ledger.steps == 30 and 0 < trainer.epsilon() <= 4.0 + 1e-9
            saved = PrivacyLedger.load(ledger_file)  # written before each release
            assert saved.steps == 30 and saved.epsilon() == pytest.approx(trainer.epsilon())
        assert {"auc", "logloss", "ece"} <= set(metrics)


def test_the_tables_go_back_into_the_users_ebc_and_score_what_the_trainer_scores():
    torch.manual_seed(0)
    ebc, tower = _ebc(), Tower()
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    data = _data(n=600)
    with make_private(ebc, tower, bce, data, mode="sparse", target_epsilon=8.0, batch_size=60, steps=5,
                      config=SETTINGS) as trainer:
        start = trainer.embedding_state_dict()
        assert all(torch.equal(start[k], before[k]) for k in before)  # the user's initial tables are the start
        trainer.train()
        released = trainer.embedding_state_dict()
        predicted = trainer.predict(data)
    assert any(not torch.equal(released[k], before[k]) for k in before)
    ebc.load_state_dict(released)
    batch = data.take(np.arange(len(data)))
    pooled = ebc(batch.sparse).to_dict()
    with torch.no_grad():
        assert torch.allclose(tower(pooled, batch.dense), predicted, atol=1e-5)


def test_the_built_in_dlrm_through_make_private_is_the_run_widedp_train_builds(ctr_dir):
    """One step implementation: `build_run` (widedp train) and `make_private` over the same
    split, config and reproducible seed release the same tables, dense parameters and ε."""
    settings = [f"data.path={ctr_dir}", "cluster.backend=local", "cluster.num_shards=2", "train.steps=4",
                "train.batch_size=64", "model.embedding_dim=8", "train.recalibrate=false",
                "privacy.reproducible=true", "privacy.noise_seed=11", "privacy.target_epsilon=6"]
    cfg = load_config(None, settings).validate()
    with build_run(cfg) as run:
        for _ in range(4):
            assert run.engine.step() is not None
        want_tables = run.engine.shards.broadcast("state_dict")
        want_dense = {k: v.clone() for k, v in run.engine.model.state_dict().items()}
        want_eps = run.engine.ledger.epsilon()
        meta, train_set = run.meta, run.train_set
        everything = train_set.take(np.arange(len(train_set)))
    configs = [EmbeddingBagConfig(name=t, embedding_dim=8, num_embeddings=int(rows),
                                  feature_names=[f for f in meta.features if meta.feature_tables[f] == t])
               for t, rows in meta.table_sizes.items()]
    torch.manual_seed(cfg.train.seed)  # what build_run does before it builds the model
    dlrm = DLRM(features=list(meta.features), embedding_dim=8, num_dense=meta.num_dense,
                bottom_mlp=list(cfg.model.bottom_mlp), top_mlp=list(cfg.model.top_mlp))
    data = KJTDataset(everything.sparse, everything.labels, everything.dense)
    with make_private(configs, dlrm, dlrm.loss, data, pooled_as="tensor", num_shards=2,
                      config=[s for s in settings if not s.startswith(("data.", "cluster.", "model."))]) as trainer:
        assert trainer.train() == 4
        got_tables = trainer.engine.shards.broadcast("state_dict")
        got_eps = trainer.epsilon()
    for want, got in zip(want_tables, got_tables):
        for a, b in zip(want["weights"], got["weights"]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name, value in dlrm.state_dict().items():
        torch.testing.assert_close(value, want_dense[name], rtol=0, atol=0)
    assert got_eps == want_eps


class InBatchNegatives(nn.Module):
    """A two-tower retrieval loss with the batch's other items as negatives: one example's loss
    depends on every other example of the batch."""

    def __init__(self):
        super().__init__()
        self.user = nn.Linear(D, D)

    def forward(self, pooled, dense):
        scores = self.user(pooled["user"]) @ pooled["item"].T  # [B, B]
        return torch.log_softmax(scores, dim=1)


def test_a_loss_that_couples_examples_is_refused_before_anything_is_spent():
    def diagonal_nll(outputs, labels):
        return -outputs.diagonal()

    with make_private(_ebc(), InBatchNegatives(), diagonal_nll, _data(n=400), target_epsilon=4.0, batch_size=40,
                      steps=3) as trainer:
        with pytest.raises(CoupledLossError, match="couples examples.*in-batch negatives"):
            trainer.step()
        assert trainer.ledger.steps == 0 and trainer.steps_taken == 0


def test_the_coupling_probe_can_fail_only_when_examples_are_coupled():
    """Its broken twin: BatchNorm in training mode couples examples through the batch's mean."""
    class WithBatchNorm(Tower):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(3)

        def forward(self, pooled, dense):
            return super().forward(pooled, self.norm(dense))

    with make_private(_ebc(), WithBatchNorm(), bce, _data(n=400), target_epsilon=4.0, batch_size=40,
                      steps=2) as trainer:
        with pytest.raises(CoupledLossError, match="BatchNorm"):
            trainer.step()
    with make_private(_ebc(), Tower(), bce, _data(n=400), target_epsilon=4.0, batch_size=40, steps=2) as trainer:
        assert trainer.step() is not None


def test_user_level_samples_units_and_needs_them():
    with make_private(_ebc(), Tower(), bce, _data(n=800), target_epsilon=4.0, batch_size=20, steps=3,
                      config=["privacy.unit=user", "privacy.max_examples_per_user=16"]) as trainer:
        assert trainer.train() == 3
        assert trainer.privacy.unit == "user" and trainer.privacy.num_units == 100
    d = _data(n=200)
    no_units = KJTDataset(d.take(np.arange(200)).sparse, d.labels, d.dense)
    with pytest.raises(ValueError, match="privacy.unit = \"user\" needs the KJTDataset's units"):
        make_private(_ebc(), Tower(), bce, no_units, target_epsilon=4.0, batch_size=20, steps=3,
                     config=["privacy.unit=user"])


def test_bad_inputs_name_the_table_feature_or_example():
    data = _data(n=200)
    with pytest.raises(ValueError, match=r"tables of different widths \{'item_table': 8, 'user_table': 4\} with "
                                         r"train.optimizer = \"adagrad\""):
        make_private(_ebc(dims=(D, 4)), Tower(), bce, data, target_epsilon=4.0, batch_size=20, steps=3,
                     config=["train.optimizer=adagrad"])
    small = [EmbeddingBagConfig(name="item_table", embedding_dim=D, num_embeddings=10,
                                feature_names=["item", "last_item"]),
             EmbeddingBagConfig(name="user_table", embedding_dim=D, num_embeddings=100, feature_names=["user"])]
    items = data.take(np.arange(200)).sparse["item"].values().numpy()  # one id per example
    top = int(items.argmax())
    with pytest.raises(ValueError, match=rf"feature 'item', example {top}: id {items[top]} is outside table "
                                         r"'item_table' of 10 rows"):
        make_private(small, Tower(), bce, data, target_epsilon=4.0, batch_size=20, steps=3)
    missing = [EmbeddingBagConfig(name="t", embedding_dim=D, num_embeddings=10, feature_names=["clicks"])]
    with pytest.raises(ValueError, match=r"features \['clicks'\] are not in the data set"):
        make_private(missing, Tower(), bce, data, target_epsilon=4.0, batch_size=20, steps=3)
    with make_private(_ebc(), Tower(), lambda o, y: bce(o, y).mean(), data, target_epsilon=4.0, batch_size=20,
                      steps=3) as trainer:
        with pytest.raises(ValueError, match=r"one loss per example, shape \[\d+\], got \(\): use reduction='none'"):
            trainer.step()
    with pytest.raises(ValueError, match="labels has 5 entries, the KeyedJaggedTensor 200 examples"):
        KJTDataset(data.take(np.arange(200)).sparse, torch.zeros(5))
    with pytest.raises(TypeError, match="data must be a widedp KJTDataset"):
        make_private(_ebc(), Tower(), bce, [1, 2], target_epsilon=4.0, batch_size=20, steps=3)


def test_kjt_dataset_take_returns_the_examples_asked_for():
    data = _data(n=50)
    full = data.take(np.arange(50))
    picked = data.take(np.array([7, 3, 7]))
    per = full.sparse.to_dict()
    for f, jt in picked.sparse.to_dict().items():
        want = [per[f].to_dense()[i].tolist() for i in (7, 3, 7)]
        assert [x.tolist() for x in jt.to_dense()] == want
    assert torch.equal(picked.labels, full.labels[[7, 3, 7]]) and torch.equal(picked.dense, full.dense[[7, 3, 7]])


@pytest.fixture
def own_ray():
    """Ray for one test: started here (embedded, as `widedp train` starts it) and shut down after,
    unless a cluster was already up in this process."""
    import ray

    started = not ray.is_initialized()
    yield
    if started and ray.is_initialized():
        ray.shutdown()


def test_on_ray_shard_actors_the_run_is_the_in_process_run(own_ray):
    """backend="ray": the tables live in Ray shard actors; with one reproducible seed the
    released tables and ε equal the in-process run's, bit for bit."""
    got = {}
    for backend in ("local", "ray"):
        torch.manual_seed(0)
        with make_private(_ebc(), Tower(), bce, _data(n=600), target_epsilon=4.0, batch_size=60, steps=3,
                          backend=backend, num_shards=2,
                          config=[*SETTINGS, "privacy.reproducible=true", "privacy.noise_seed=3"]) as trainer:
            assert trainer.train() == 3
            if backend == "ray":
                assert type(trainer.engine.shards).__name__ == "RayShardGroup"
            got[backend] = (trainer.embedding_state_dict(), trainer.epsilon())
    (local, eps_local), (ray_tables, eps_ray) = got["local"], got["ray"]
    assert eps_local == eps_ray
    for key in local:
        torch.testing.assert_close(local[key], ray_tables[key], rtol=0, atol=0)


def test_the_readme_block_trains_a_users_ebc_as_written(tmp_path):
    import subprocess
    import sys

    from readme_blocks import page_with

    text = page_with("<!-- own-model -->").read_text()
    block = re.search(r"<!-- own-model -->\n```python\n(.*?)```", text, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    eps, auc = map(float, out.stdout.split())
    assert 0 < eps <= 8.0 + 1e-9 and 0.5 < auc <= 1.0


def test_a_split_holds_out_examples_the_training_set_lacks():
    data = _data(n=100)
    train, test = data.split(test_fraction=0.2, seed=4)
    assert (len(train), len(test)) == (80, 20)
    key = lambda d: {tuple(r.tolist()) for r in torch.cat([d.dense, d.labels[:, None]], 1)}  # noqa: E731
    assert not key(train) & key(test) and key(train) | key(test) == key(data)
    assert set(train.units().tolist()) | set(test.units().tolist()) == set(data.units().tolist())


def test_what_preparing_the_data_spent_is_charged_first_and_planned_inside_the_target():
    from widedp.accounting import events as ev

    d = _data(n=600)
    spent = KJTDataset(d.take(np.arange(600)).sparse, d.labels, d.dense,
                       privacy_events=[("a DP vocabulary", ev.GaussianDpEvent(3.0))])
    with make_private(_ebc(), Tower(), bce, spent, target_epsilon=4.0, batch_size=60, steps=4) as trainer:
        assert trainer.ledger.steps == 1 and trainer.epsilon() > 0  # before any step
        first = trainer.epsilon()
        assert trainer.train() == 4 and first < trainer.epsilon() <= 4.0 + 1e-9
    with make_private(_ebc(), Tower(), bce, d, target_epsilon=4.0, batch_size=60, steps=4) as fresh:
        assert fresh.ledger.steps == 0
        assert fresh.privacy.noise_multiplier < trainer.privacy.noise_multiplier  # the data event took budget


def test_a_step_hands_back_no_raw_training_statistics_unless_asked():
    with make_private(_ebc(), Tower(), bce, _data(n=400), target_epsilon=4.0, batch_size=40, steps=2) as trainer:
        stats = trainer.step()
        assert np.isnan(stats.loss) and stats.batch_size == -1 and stats.rows_touched == -1
    with make_private(_ebc(), Tower(), bce, _data(n=400), target_epsilon=4.0, batch_size=40, steps=2,
                      config=["train.debug_metrics=true"]) as trainer:
        stats = trainer.step()
        assert np.isfinite(stats.loss) and stats.batch_size > 0 and stats.rows_touched > 0


def test_epochs_give_the_planned_steps_as_opacus_users_count_them():
    with make_private(_ebc(), Tower(), bce, _data(n=400), target_epsilon=4.0, batch_size=100, epochs=1.5) as trainer:
        assert trainer.config.train.steps == 6  # ⌈1.5 · 400 / 100⌉
    with pytest.raises(ValueError, match="epochs needs batch_size"):
        make_private(_ebc(), Tower(), bce, _data(n=400), target_epsilon=4.0, epochs=1)
    with pytest.raises(ValueError, match="give steps or epochs, not both"):
        make_private(_ebc(), Tower(), bce, _data(n=400), target_epsilon=4.0, batch_size=10, epochs=1, steps=3)


def test_a_named_logit_layer_gets_the_private_recalibration_inside_the_target():
    """logit_layer=: train.recalibrate runs after the planned steps (its event in the ledger,
    inside the target ε) and makes the model compute a·clip(z, ±8) + b (folded into that
    layer, its output clamped): the test logits are the uncalibrated model's, mapped by the
    released (a, b) — also where a diverged model's logits lie far outside the histogram's range,
    and after the trainer's state is loaded into a fresh one. A layer whose output is not the
    module's logit is refused before anything is spent."""
    data = _data(n=1500)
    train, test = data.split(0.2, seed=1)
    torch.manual_seed(0)
    tower = Tower()
    with make_private(_ebc(), tower, bce, train, target_epsilon=4.0, batch_size=100, steps=6, mode="dpsgd",
                      logit_layer=tower.mlp[-1], config=[*SETTINGS, "train.optimizer=sgd"]) as trainer:
        assert trainer.privacy.recalibration is not None
        while trainer.step() is not None:
            pass
        with torch.no_grad():  # a diverged model: logits of ±hundreds, far outside the public ±8
            tower.mlp[-1].weight.mul_(400.0)
        before = trainer.predict(test).double()
        assert (before.abs() > 8).float().mean() > 0.5
        steps = trainer.ledger.steps
        out = trainer.recalibrate()
        assert out is not None and trainer.ledger.steps == steps + 1 and trainer.epsilon() <= 4.0 + 1e-9
        assert trainer.recalibrate() is None  # once per step count
        reference = out["a"] * before.clamp(-8.0, 8.0) + out["b"]  # the function the histogram's fit saw
        assert out["logit_range"] == pytest.approx([out["b"] - 8 * out["a"], out["b"] + 8 * out["a"]])
        after = trainer.predict(test).double()
        torch.testing.assert_close(after, reference, rtol=1e-4, atol=1e-4)
        state = trainer.state_dict()
        unclamped = out["a"] * before + out["b"]  # the fold alone (the broken variant) differs there by
        assert (unclamped - reference).abs().max() > 100 * 1e-4  # a·(|z| − 8), a ≥ 1e-3: far past the tolerance
    torch.manual_seed(1)
    fresh_tower = Tower()
    with make_private(_ebc(), fresh_tower, bce, train, target_epsilon=4.0, batch_size=100, steps=6, mode="dpsgd",
                      logit_layer=fresh_tower.mlp[-1], config=[*SETTINGS, "train.optimizer=sgd"]) as resumed:
        resumed.load_state_dict(state)
        torch.testing.assert_close(resumed.predict(test).double(), reference, rtol=1e-4, atol=1e-4)
    class Squashed(Tower):  # the layer's output goes through tanh: not the logit returned
        def forward(self, pooled, dense):
            return 3 * torch.tanh(super().forward(pooled, dense))

    torch.manual_seed(0)
    tower = Squashed()
    with make_private(_ebc(), tower, bce, train, target_epsilon=4.0, batch_size=100, steps=2, mode="dpsgd",
                      logit_layer=tower.mlp[-1], config=SETTINGS) as trainer:
        with pytest.raises(ValueError, match="logit_layer's output is not the logit dense_module returns"):
            trainer.step()
        assert trainer.steps_taken == 0
    with pytest.raises(ValueError, match="logit_layer must be an nn.Linear with one output"):
        make_private(_ebc(), Tower(), bce, train, target_epsilon=4.0, batch_size=100, steps=2,
                     logit_layer=nn.ReLU())


def test_the_trainer_carries_the_forecast_of_its_plan():
    """make_private's trainer forecasts like `widedp train` (trainer/config/forecast.py): a few
    steps on a small set cannot outgrow the noise; a non-private trainer has nothing to forecast."""
    from widedp.trainer.config.forecast import forecast

    train, _ = _data(n=1500).split(0.2, seed=1)
    with make_private(_ebc(), Tower(), bce, train, target_epsilon=4.0, batch_size=100, steps=6, mode="dpsgd",
                      config=SETTINGS) as trainer:
        f = trainer.forecast
        assert f["unlikely_to_learn"] and "unlikely to learn" in f["warning"]
        assert f == forecast(noise_multiplier=trainer.privacy.noise_multiplier, expected_batch_size=trainer.engine.b,
                             steps=6, embedding_dim=trainer.layout.dim, units=len(trainer.train_set))
    with make_private(_ebc(), Tower(), bce, train, target_epsilon=4.0, batch_size=100, steps=6, mode="nonprivate",
                      config=SETTINGS) as trainer:
        assert trainer.forecast == {"unlikely_to_learn": False, "rule": "non-private: no noise to forecast"}
