"""A config names the user's own dense model by import path (`model.name =
"package.module:Class"`, `[model.kwargs]`): `widedp train` accepts it, `widedp export` writes
it, and the export scores the test split like `widedp evaluate` in a Python that can import
neither widedp nor the user's module."""

import json
import textwrap

import numpy as np
import pytest
import torch

from test_export import SCORER, _isolated_python, _split_npz
from widedp.trainer.cli import main
from widedp.trainer.config import ConfigError, load_config
from widedp.trainer.models import build_model, model_class

USER_MODULE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn

    from widedp.trainer.models import DenseModel


    class TwoLayer(DenseModel):
        """The pooled embeddings and dense features concatenated, one hidden layer, a logit."""

        def __init__(self, features, embedding_dim, num_dense, hidden=16):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(len(features) * embedding_dim + num_dense, hidden), nn.ReLU(),
                                     nn.Linear(hidden, 1))

        def forward(self, pooled, dense):
            return self.net(torch.cat([pooled.flatten(1), dense], 1)).squeeze(-1)

        def loss(self, outputs, labels):
            return F.binary_cross_entropy_with_logits(outputs, labels, reduction="none")

        def metrics(self, outputs, labels):
            return {"logloss": float(self.loss(outputs, labels).mean())}

        def logit_layer(self):
            return self.net[-1]


    NOT_A_MODEL = 3
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "team_models.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    return "team_models"


def test_a_model_named_by_import_path_trains_exports_and_scores_like_evaluate(user_module, ctr_dir, tmp_path,
                                                                            capsys):
    config = tmp_path / "own.toml"
    config.write_text(textwrap.dedent(f'''
        [data]
        path = "{ctr_dir}"
        [model]
        name = "{user_module}:TwoLayer"
        embedding_dim = 4
        [model.kwargs]
        hidden = 8
        [train]
        steps = 4
        batch_size = 64
        [cluster]
        backend = "local"
        num_shards = 2
    '''))
    run, out = tmp_path / "run", tmp_path / "release"
    assert main(["train", "--config", str(config), "--run-dir", str(run), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert 0 < summary["epsilon"] <= 8.0 and "logloss" in summary["test_metrics"]
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["name"] == f"{user_module}:TwoLayer" and saved["model"]["kwargs"] == {"hidden": 8}
    assert main(["export", str(run), str(out)]) == 0
    capsys.readouterr()
    spec = json.loads((out / "model.json").read_text())
    assert spec["model_class"] == f"{user_module}:TwoLayer" and spec["model_kwargs"] == {"hidden": 8}
    assert spec["output"]["kind"] == "logit"
    # scored where neither widedp nor the user's module can be imported (dense.pt2 holds the program)
    _split_npz(run, tmp_path / "test.npz")
    job = {"export": str(out), "data": str(tmp_path / "test.npz"), "out": str(tmp_path / "scores.npy"),
           "with_last": True}
    proc = _isolated_python(tmp_path, SCORER, json.dumps([job]))
    assert proc.returncode == 0, proc.stderr
    outputs = torch.from_numpy(np.load(tmp_path / "scores.npy"))
    labels = torch.from_numpy(np.load(tmp_path / "test.npz")["labels"])
    model = build_model(spec["model_class"], features=[f["name"] for f in spec["features"]],
                        embedding_dim=spec["embedding_dim"], num_dense=spec["num_dense"], kwargs=spec["model_kwargs"])
    assert main(["evaluate", "--run-dir", str(run)]) == 0
    want = json.loads(capsys.readouterr().out)["test_metrics"]
    assert model.metrics(outputs, labels) == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_a_bad_import_path_is_refused_naming_model_name(user_module, ctr_dir):
    def check(name, *extra):
        return load_config(None, [f"data.path={ctr_dir}", f"model.name={name}", *extra]).validate()

    with pytest.raises(ConfigError, match=r"model.name = 'no_such_module:X': cannot import 'no_such_module'"):
        check("no_such_module:X")
    with pytest.raises(ConfigError, match=rf"'{user_module}' has no attribute 'Missing'"):
        check(f"{user_module}:Missing")
    with pytest.raises(ConfigError, match=r"is 3, not a subclass of widedp.trainer.models.DenseModel"):
        check(f"{user_module}:NOT_A_MODEL")
    with pytest.raises(ConfigError, match=r"or an import path 'package.module:Class', got 'two tower'"):
        check("two tower")
    with pytest.raises(ConfigError, match=r"model.kwargs is for a model named by import path"):
        check("dlrm", 'model.kwargs={"hidden": 3}')
    assert model_class(f"{user_module}:TwoLayer").__name__ == "TwoLayer"
    with pytest.raises(ValueError, match=r"TwoLayer\(features=..., embedding_dim=..., num_dense=..., \*\*model.kwargs = "
                                         r"\{'width': 3\}\) failed"):
        build_model(f"{user_module}:TwoLayer", features=["a"], embedding_dim=2, num_dense=1, kwargs={"width": 3})


def test_the_cli_fast_check_accepts_an_import_path_without_importing_it(ctr_dir, tmp_path, capsys):
    """The light pass (before torch loads) checks the form only; the full check imports it."""
    from widedp.trainer.config import light_names

    with light_names():
        load_config(None, [f"data.path={ctr_dir}", "model.name=not_imported_yet.models:Tower"]).validate()
    config = tmp_path / "c.toml"
    config.write_text(f'[data]\npath = "{ctr_dir}"\n[model]\nname = "not_imported_yet.models:Tower"\n')
    code = main(["train", "--config", str(config), "--run-dir", str(tmp_path / "r"), "--no-progress",
                 "--set", "cluster.backend=local"])
    assert code == 2 and "cannot import 'not_imported_yet.models'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
