"""Every draw a privacy guarantee relies on is keyed with the full secret (docs/DESIGN.md §1
"Noise source"; selection/keyed_random.py, trainer/engine/randomness.py).

The attack these tests rule out: torch's CPU generator keeps the low 32 bits of `manual_seed`, so
a run whose noise came from `torch.Generator().manual_seed(s)` could be brute-forced over 2^32
seeds, its noise regenerated and subtracted. Here each path is run twice with keys that differ in
ONE bit, at positions 0, 33, 65 and 127: a path that dropped the key's high bits anywhere on the
way into its generator (32- or 64-bit seeding) draws the same values for bits 33/65/127 and fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from widedp.adaptive_clipping.dp_stat import dp_stat
from widedp.selection import NoiseKey, exponential_top_k, gaussian_noise, noisy_step
from widedp.selection.keyed_random import KEY_BITS, GaussianStream, generator_family
from widedp.trainer.data.sampler import PoissonSampler
from widedp.trainer.engine.layout import row_block_normal, row_block_uniform
from widedp.trainer.data.sampler import trimmed_positions
from widedp.trainer.engine.randomness import DOMAINS, PrivacyRandomness
from widedp.trainer.engine.recalibration import noisy_histogram

REPO = Path(__file__).resolve().parents[1]
BITS = (0, 33, 65, 127)
KEY = 0x9E3779B97F4A7C15_F39CC0605CEDC834  # an arbitrary 128-bit key


# ---- what each privacy path draws from a key (one function per path, as the run calls it) -------

def _selected_row_and_dense_noise(key: NoiseKey) -> np.ndarray:
    """The engine's Gaussian step (selected rows, then the dense gradients) from `noise_gen`."""
    step = noisy_step(torch.zeros(3, 4), {"w": torch.zeros(5)}, 1.0, 1.0, 10.0, None, GaussianStream(key),
                      secure=key.secure)
    return np.concatenate([step.rows.numpy().ravel(), step.dense["w"].numpy()])


def _dpsgd_row_noise(key: NoiseKey) -> np.ndarray:
    """DP-SGD's (and dense tables') per-row noise, counter-based on the shards, and the lazy
    noise's one draw per pending interval (trainer/engine/shard_update.py), point-addressed."""
    from widedp.selection.keyed_random import interval_normals
    from widedp.trainer.engine.shard_update import LAZY_DOMAIN, ROW_BITS

    rows = (1 << ROW_BITS) + np.arange(1000, 1100)
    lazy = interval_normals(key.derive(LAZY_DOMAIN), rows, np.full(100, 2), np.full(100, 9), 4).numpy()
    return np.concatenate([row_block_normal(key, "dpsgd", 3, 1, 1000, 1100, 4, 1.0).numpy().ravel(), lazy.ravel()])


def _modelmix_weights(key: NoiseKey) -> np.ndarray:
    return row_block_uniform(key, "modelmix", 3, 1, 0, 64, 4).numpy()


def _poisson_batches(key: NoiseKey) -> np.ndarray:
    sampler = PoissonSampler(10_000, 0.01, seed=key.generator())
    return np.concatenate([sampler.sample() for _ in range(3)])


def _selection(key: NoiseKey) -> np.ndarray:
    """Exponential-mechanism top-k over a vocabulary of 10^5 rows (coordinator selection)."""
    ids, _ = exponential_top_k(np.arange(50), np.linspace(0.0, 1.0, 50), 100_000, 20, 1.0, 1.0, key.generator())
    return np.sort(ids)


def _shard_selection(key: NoiseKey) -> np.ndarray:
    """A shard's own stream at (step, shard): `key.generator(step, shard)`."""
    return key.generator(7, 2).standard_normal(16)


def _dp_stat_noise(key: NoiseKey) -> np.ndarray:
    """DP-STAT's choices on 40 calls with heavy count noise (small ρ), so they vary with the noise."""
    rng = key.generator()
    return np.array([dp_stat(np.linspace(0.1, 50.0, 200), theta=0.1, num_doublings=10, rho=0.005, rng=rng).index
                     for _ in range(40)])


def _recalibration_noise(key: NoiseKey) -> np.ndarray:
    """The recalibration histogram's noise after step 7 (`PrivacyRandomness.recalibration_rng`)."""
    hist = noisy_histogram(np.linspace(-3.0, 3.0, 50), np.arange(50) % 2, 1.0, key.generator(7))
    return np.concatenate([hist.totals, hist.positives])


PATHS = {
    "recalibration": _recalibration_noise,
    "noise": _selected_row_and_dense_noise,
    "dpsgd": _dpsgd_row_noise,
    "modelmix": _modelmix_weights,
    "sampler": _poisson_batches,
    "selection": _selection,
    "shard-selection": _shard_selection,
    "clip": _dp_stat_noise,
    "user-trim": lambda key: trimmed_positions(np.repeat(np.arange(20), 10), 3, key.generator()),
}


def test_every_randomness_domain_has_a_path_here():
    assert set(PATHS) == set(DOMAINS)


@pytest.mark.parametrize("secure", [False, True], ids=["philox", "chacha"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("bit", BITS)
def test_flipping_one_bit_of_a_paths_key_changes_its_draws(path, bit, secure):
    draw = PATHS[path]
    key = NoiseKey(KEY, secure)
    same = draw(NoiseKey(KEY, secure))
    np.testing.assert_array_equal(draw(key), same)  # a function of the key (replayable) ...
    assert not np.array_equal(draw(NoiseKey(KEY ^ (1 << bit), secure)), same)  # ... of all of it


@pytest.mark.parametrize("bit", BITS)
def test_flipping_one_bit_of_the_runs_root_changes_every_derived_stream(bit):
    """The root → domain key derivation (keyed BLAKE2b) keeps every root bit."""
    a, b = PrivacyRandomness.from_seed(KEY), PrivacyRandomness.from_seed(KEY ^ (1 << bit))
    for domain in DOMAINS:
        ka, kb = a.key(domain), b.key(domain)
        assert ka.key != kb.key and ka.key < (1 << KEY_BITS)
        assert not np.array_equal(PATHS[domain](ka), PATHS[domain](kb)), domain


def test_the_32_bit_torch_seed_this_replaces_would_fail_the_bit_test():
    """Why the tests above flip high bits: the generator we no longer use ignores them."""
    def torch_draw(seed: int) -> torch.Tensor:
        return torch.randn(8, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(torch_draw(5), torch_draw(5 + (1 << 32)))
    assert not np.array_equal(_dpsgd_row_noise(NoiseKey(5)), _dpsgd_row_noise(NoiseKey(5 + (1 << 32))))


def test_domains_are_independent_streams_and_the_root_is_never_printed():
    r = PrivacyRandomness.from_seed(KEY)
    keys = {d: r.key(d).key for d in DOMAINS}
    assert len(set(keys.values())) == len(DOMAINS)
    assert str(KEY) not in repr(r) and all(str(k) not in repr(r.key(d)) for d, k in keys.items())
    with pytest.raises(ValueError, match="unknown randomness domain"):
        r.key("nois")


def test_secure_runs_draw_every_stream_from_chacha20():
    r = PrivacyRandomness.fresh(secure=True)
    assert r.noise_generator().secure and not PrivacyRandomness.fresh().noise_generator().secure
    for rng in (r.sampler_rng(), r.selection_rng(), r.clip_rng(),
                r.dpsgd_noise_key().generator(1), r.shard_selection_key().generator(1, 0), r.mix_key().generator(1), r.recalibration_rng(3)):
        assert generator_family(rng) == "secure"
    fast = PrivacyRandomness.fresh()
    assert generator_family(fast.selection_rng()) == "fast" and generator_family(fast.sampler_rng()) == "fast"
    with pytest.raises(ValueError, match="exclude each other"):
        PrivacyRandomness(1, reproducible=True, secure=True)


def test_keys_carry_their_full_width_and_refuse_more():
    assert NoiseKey.fresh().key < (1 << 128) and NoiseKey.fresh(secure=True).key < (1 << 256)
    NoiseKey((1 << 128) - 1)
    with pytest.raises(ValueError, match="at most 128 bits"):
        NoiseKey(1 << 128)  # a fast (Philox) key cannot hold more: nothing is silently dropped
    NoiseKey(1 << 255, secure=True)
    with pytest.raises(ValueError, match="noise_seed must be an integer"):
        PrivacyRandomness.from_seed(1 << 128)


def test_gaussian_noise_refuses_a_torch_generator():
    with pytest.raises(TypeError, match="keyed GaussianStream"):
        gaussian_noise((3,), 1.0, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("secure", [False, True], ids=["philox", "chacha-4-draw"])
def test_gaussian_noise_is_standard_normal_times_std(secure):
    """The noise is N(0, std²) in either family (KS test on 200,000 draws, fixed key)."""
    from scipy import stats

    z = gaussian_noise((200_000,), 2.5, GaussianStream(NoiseKey(KEY, secure)), secure=secure).double().numpy() / 2.5
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert abs(z.var() - 1.0) < 0.02


# ---- no generator narrower than the key on a privacy path ------------------------------------------

PRIVACY_PACKAGES = ("selection", "accounting", "trainer", "sparse_learners", "adaptive_clipping")
# Public draws that may use torch's generators: model initialization from train.seed (train.py)
# and the example input of an exported model (export.py). Nothing else may.
PUBLIC_TORCH_DRAWS = {"trainer/run/train.py", "trainer/release/export.py"}
TORCH_DRAWS = {"manual_seed", "Generator", "randn", "rand", "randint", "randperm", "normal", "bernoulli",
               "multinomial", "poisson", "normal_", "uniform_", "exponential_", "bernoulli_", "seed", "initial_seed"}


def _torch_draws(path: Path, root: Path = REPO) -> list[str]:
    """`torch.X(...)` / `torch.random.X(...)` / `x.normal_(...)`-style calls of a draw in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TORCH_DRAWS:
            base = ast.unparse(node.func.value)
            in_place = node.func.attr.endswith("_")
            if base in ("torch", "torch.random", "torch.cuda") or in_place or node.func.attr == "manual_seed":
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node.func)}")
    return found


def test_no_torch_generator_on_any_privacy_path():
    offending = []
    for package in PRIVACY_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if str(path.relative_to(REPO)) not in PUBLIC_TORCH_DRAWS:
                offending += _torch_draws(path)
    assert not offending, "privacy paths must draw from selection.keyed_random, not torch's generators:\n" + \
        "\n".join(offending)


def test_the_scan_sees_a_manual_seed(tmp_path):
    """The scan above can fail: it flags the line this change removed from trainer/engine/layout.py."""
    bad = tmp_path / "layout.py"
    bad.write_text("import torch\ngen = torch.Generator().manual_seed(5)\nx = torch.randn(3)\nw.normal_(0, 1)\n")
    assert len(_torch_draws(bad, tmp_path)) == 4


# ---- the keystream and the values made from it -----------------------------------------------------

@pytest.mark.parametrize("secure", [False, True], ids=["aes128", "aes256"])
def test_the_keystream_is_aes_of_the_counter_under_the_whole_key(secure):
    """Word 2c, 2c+1 = AES_key(c) (128-bit big-endian counter block): the definition of CTR mode,
    checked against the block cipher itself (ECB on the counter)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from widedp.selection.keyed_random import keystream_words

    key = NoiseKey(KEY if not secure else KEY << 100 | 12345, secure)
    block = Cipher(algorithms.AES(int(key.key).to_bytes(key.key_bytes, "little")), modes.ECB()).encryptor()
    want = np.frombuffer(block.update((7).to_bytes(16, "big")), "<u8")
    np.testing.assert_array_equal(keystream_words(key, 14, 2), want)
    np.testing.assert_array_equal(keystream_words(key, 0, 300_000)[99_999:200_001], keystream_words(key, 99_999, 100_002))


@pytest.mark.parametrize("secure", [False, True], ids=["fast", "secure"])
def test_values_are_addressable_however_a_range_is_split(secure):
    from widedp.selection.keyed_random import standard_normals, uniforms

    key = NoiseKey(KEY, secure)
    whole = standard_normals(key, 0, 200_001)
    parts = torch.cat([standard_normals(key, 0, 7), standard_normals(key, 7, 131_070), standard_normals(key, 131_077, 68_924)])
    assert torch.equal(whole, parts)
    stream = GaussianStream(key)
    assert torch.equal(torch.cat([stream.standard_normal(5), stream.standard_normal(1000)]), whole[:1005])
    assert torch.equal(uniforms(key, 0, 50)[13:], uniforms(key, 13, 37))


def test_fast_values_reach_the_documented_tail():
    """The smallest radius uniform (top 40 bits zero) gives |z| = √(2·40·ln 2) ≈ 7.45, beyond
    torch's float32 normal (5.77), and a unit angle cos gives z0 = r."""
    from widedp.selection.keyed_random import _fast_pairs

    out = torch.empty((2, 2))
    _fast_pairs(torch.tensor([0, (1 << 24) * 12345 + 7], dtype=torch.int64), out)
    assert out[0, 0].item() == pytest.approx(np.sqrt(2 * 40 * np.log(2)), rel=1e-6) and out[0, 1].item() == 0.0
    assert np.isfinite(out.numpy()).all()
