"""`widedp synth logs`: synthetic RAW click logs with users and a planted per-user model.

    widedp synth logs OUT_DIR [--users 2000] [--days 3] [--seed 0] [--start-date 2026-11-01]
                              [--examples-per-user-median 4] [--examples-per-user-sigma 1.5]
                              [--max-examples-per-user 5000] [--items 20000] [--topics 20]
                              [--history-length 20]

What a team would have before any conversion (not a widedp data set): day-partitioned Parquet
click logs, for user-level privacy tests and benchmarks. ``widedp convert table`` turns them
into a data set with the schema written beside them::

    widedp convert table 'OUT_DIR/day=*/*.parquet' DATA --schema OUT_DIR/schema.toml \\
        --test-after <last day>        # training: days 1..D-1, test split: the last day

Layout of OUT_DIR (written to a temporary directory beside it, renamed into place at the end:
nothing half-written is left on an error; an existing non-empty OUT_DIR is refused)::

    day=YYYY-MM-DD/part-B.parquet   the logs, one file per (day, block of USER_BLOCK users);
                                    rows in time order within a file
    schema.toml                     `convert table` schema (unit = "user_id", timestamp = "ts")
    device_vocab.txt                the public device vocabulary the schema names
    truth.json                      generator parameters, seed, per-day counts, base rate,
                                    per-user count statistics, the evaluation day's Bayes AUC
                                    and log loss
    truth/day=YYYY-MM-DD/part-B.parquet   per log row, same order: the true logit and p
    truth/users.parquet             per user: user_id, topic, latent, offset, examples, ...
    truth/items.parquet             per item: item, topic, latent, effect, campaign + effect

Log columns: ``user_id`` (string ``u00000042``), ``ts`` (timestamp[ms, UTC]), ``label`` (int8
0/1), dense ``price`` (float64, log-normal: heavy-tailed), ``position`` (int32, 1..8),
``session_depth`` (int32, Zipf: heavy-tailed), ``account_age_days`` (float64, null for the
users whose age is unknown), categorical ``ad_id`` (string ``i123``), ``campaign`` (int64),
``device`` (string, 4 values) and the list ``history`` (list<string>: the user's last
``history_length`` items viewed before the impression, most recent first; empty for a user
with no views yet), from the same item space as ``ad_id`` (shared table ``item``).

Generative model. Items i < I belong to topic ``i % K`` (within-topic popularity rank
``i // K``); topic centres c_t ~ N(0, I_k / k) (k = ``latent_dim``). Item latent
v_i = c_{i % K} + item_spread · N(0, I_k / k), item effect β_i ~ N(0, ad_effect_std²),
campaign(i) = 1000 + splitmix64(i + campaign_key) mod C with effect δ_c ~ N(0,
campaign_effect_std²), device effect η_dev ~ N(0, device_effect_std²). Each user u: topic
t_u ~ Uniform(K), latent w_u = c_{t_u} + user_spread · N(0, I_k / k), a per-user offset
a_u ~ N(0, user_offset_std²), a primary device, an account age (unknown, i.e. null, with
probability ``age_missing``), a total example count

    n_u = clip(round(median · exp(sigma · Z)), 1, max_examples_per_user)   (log-normal: heavy tail)

spread over the D days by Multinomial(n_u, Dirichlet-like day weights Gamma(2) normalised),
each example at a uniform millisecond of its day. Items (viewed or shown) are drawn, with
probability ``history_topic_mix`` (views) / ``ad_topic_mix`` (ads), from the user's topic by
Zipf(``item_zipf_exponent``) over the topic's items, else from the global Zipf popularity over
all items (rank = id). Before each impression the user views Poisson(``views_per_impression``)
new items; a user starts with min(L, Geometric) earlier views (L = history_length), carried over
from day to day, so ``history`` reveals the user's topic and hence most of w_u. Then::

    logit = bias + a_u + β_ad + δ_campaign(ad) + η_device + interaction_scale · <w_u, v_ad>
            + Σ_j dense_weight_j · f_j(x_j)
    p = sigmoid(logit),   label ~ Bernoulli(p)

where f_j is exactly the transform schema.toml applies to dense column j (so the dense part is
linear in the converted features): standardize(log1p(price)), standardize(position),
clip(log1p(session_depth), 0, 7), clip(log1p(account_age_days, missing -> 0), 0, 10). The
standardization statistics are the generator's exact (public, data-independent) moments, not
estimates from the data. a_u is visible to a model only through the user's identity (which a
user-level DP model must not memorize); the interaction only through ``history``.

truth.json's ``evaluation_day`` block: ``bayes_auc`` is the EXPECTED AUC of the true p over the
label draw (``expected_auc``: positives weighted p, negatives 1 - p, exact given the day's
rows; no sampling error), ``empirical_auc`` the AUC of the true p against the sampled labels,
``bayes_logloss`` the mean binary entropy of p (the expected log loss of the true p) and
``empirical_logloss`` its log loss on the sampled labels; ``auc_without_user_offset`` the
expected AUC of logit - a_u (the true model without its per-user offset). These are oracle
numbers: the true p uses the latents (w_u, a_u) that the logs reveal only in part, so no
model of the logged features can beat them in expectation.

Randomness: ``default_rng(SeedSequence([seed, stream, ...]))``: global tables from their own
streams, each block of ``USER_BLOCK`` users (and each of its days) from ``[seed, stream,
block(, day)]``. Deterministic in (parameters, seed); memory is O(items + USER_BLOCK users'
rows of one day), whatever the number of users.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from widedp.trainer.data._util import Zipf, auc, expected_auc, splitmix64
from widedp.trainer.data.errors import DataError

USER_BLOCK = 1 << 15  # users per RNG block and per part file
DEVICES = ("ios", "android", "web", "tv")
DEVICE_SHARES = (0.45, 0.35, 0.15, 0.05)
POSITIONS = 8  # ad slot 1..8, uniform
SESSION_DEPTH_MAX = 1000
SESSION_DEPTH_EXPONENT = 1.3
DEPTH_CLIP = (0.0, 7.0)
AGE_CLIP = (0.0, 10.0)
DEFAULT_START = "2026-11-01"
MAX_ITEMS = 1 << 22
_DAY_MS = 86_400_000
_S_TOPICS, _S_ITEMS, _S_EFFECTS, _S_USERS, _S_DAY = 1, 2, 3, 4, 5
TRUTH_FILE, SCHEMA_FILE, DEVICE_VOCAB_FILE, TRUTH_DIR = "truth.json", "schema.toml", "device_vocab.txt", "truth"


@dataclass(frozen=True)
class LogsParams:
    """Every parameter of the generator (recorded in truth.json)."""

    users: int = 2000
    days: int = 3
    seed: int = 0
    start_date: str = DEFAULT_START
    examples_per_user_median: float = 4.0
    examples_per_user_sigma: float = 1.5
    max_examples_per_user: int = 5000
    items: int = 20_000
    topics: int = 20
    history_length: int = 20
    latent_dim: int = 8
    item_zipf_exponent: float = 1.05
    item_spread: float = 0.5
    user_spread: float = 0.5
    history_topic_mix: float = 0.8
    ad_topic_mix: float = 0.3
    views_per_impression: float = 1.0
    initial_views_mean: float = 6.0
    primary_device_share: float = 0.9
    age_missing: float = 0.1
    age_log_mean: float = 5.0
    age_log_std: float = 1.5
    price_log_mean: float = 2.0
    price_log_std: float = 1.0
    bias: float = -4.5
    user_offset_std: float = 0.7
    ad_effect_std: float = 0.5
    campaign_effect_std: float = 0.3
    device_effect_std: float = 0.3
    interaction_scale: float = 1.5
    w_price: float = -0.3
    w_position: float = -0.25
    w_session_depth: float = 0.2
    w_account_age: float = 0.15

    @property
    def campaigns(self) -> int:
        return max(1, self.items // 40)

    def day_dates(self) -> list[str]:
        start = _dt.date.fromisoformat(self.start_date)
        return [(start + _dt.timedelta(days=d)).isoformat() for d in range(self.days)]


def check_params(p: LogsParams) -> None:
    """ValueError naming the first bad parameter (the CLI's option names)."""
    def integer(name: str, v, low: int, high: Optional[int] = None) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low or (high is not None and v > high):
            raise ValueError(f"{name} must be an integer from {low} to {high}, got {v!r}" if high is not None
                             else f"{name} must be an integer >= {low}, got {v!r}")

    def real(name: str, v, low: float, strict: bool = False, high: Optional[float] = None) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low \
                or (strict and v == low) or (high is not None and v > high):
            rng = f"{'>' if strict else '>='} {low}" + (f" and <= {high}" if high is not None else "")
            raise ValueError(f"{name} must be a finite number {rng}, got {v!r}")

    integer("--users", p.users, 1, 100_000_000)
    integer("--days", p.days, 2, 3660)
    integer("--seed", p.seed, 0)
    try:
        _dt.date.fromisoformat(p.start_date)
    except (TypeError, ValueError):
        raise ValueError(f"--start-date must be an ISO date YYYY-MM-DD, got {p.start_date!r}") from None
    if len(p.start_date) != 10:
        raise ValueError(f"--start-date must be an ISO date YYYY-MM-DD, got {p.start_date!r}")
    real("--examples-per-user-median", p.examples_per_user_median, 0.0, strict=True)
    real("--examples-per-user-sigma", p.examples_per_user_sigma, 0.0, high=5.0)
    integer("--max-examples-per-user", p.max_examples_per_user, 1, 10_000_000)
    if p.max_examples_per_user < p.examples_per_user_median:
        raise ValueError(f"--max-examples-per-user ({p.max_examples_per_user}) must be >= "
                         f"--examples-per-user-median ({p.examples_per_user_median:g})")
    integer("--items", p.items, 2, MAX_ITEMS)
    integer("--topics", p.topics, 1)
    if p.topics > p.items:
        raise ValueError(f"--topics ({p.topics}) must be <= --items ({p.items})")
    integer("--history-length", p.history_length, 1, 1000)
    integer("latent_dim", p.latent_dim, 1, 256)
    for name in ("history_topic_mix", "ad_topic_mix", "primary_device_share", "age_missing"):
        real(name, getattr(p, name), 0.0, high=1.0)
    for name in ("item_zipf_exponent", "item_spread", "user_spread", "views_per_impression", "initial_views_mean",
                 "age_log_std", "price_log_std", "user_offset_std", "ad_effect_std", "campaign_effect_std",
                 "device_effect_std"):
        real(name, getattr(p, name), 0.0)
    for name in ("age_log_mean", "price_log_mean", "bias", "interaction_scale", "w_price", "w_position",
                 "w_session_depth", "w_account_age"):
        real(name, getattr(p, name), -math.inf)


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _pow2_at_least(n: int) -> int:
    return 1 << max(10, int(n - 1).bit_length())


def price_statistics(p: LogsParams) -> tuple[float, float]:
    """Exact mean and std of log1p(price), price = exp(N(μ, σ²)) (Gauss-Hermite, 80 nodes):
    public moments of the generator, not estimates from the data."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    weights = weights / weights.sum()
    y = np.logaddexp(0.0, p.price_log_mean + p.price_log_std * nodes)  # log1p(exp(x)), stable
    mean = float(weights @ y)
    return mean, float(math.sqrt(max(float(weights @ (y - mean) ** 2), 1e-12)))


def position_statistics() -> tuple[float, float]:
    return (POSITIONS + 1) / 2.0, math.sqrt((POSITIONS ** 2 - 1) / 12.0)


# ---- the global tables -----------------------------------------------------------------------------

@dataclass
class _World:
    item_latent: np.ndarray  # [I, k] float64
    item_effect: np.ndarray  # [I]
    item_campaign: np.ndarray  # [I] int64 (1000 + c)
    campaign_effect: np.ndarray  # [C]
    topic_center: np.ndarray  # [K, k]
    device_effect: np.ndarray  # [4]
    campaign_key: int
    global_zipf: Zipf
    topic_zipfs: dict
    topic_size: np.ndarray  # [K]
    depth_zipf: Zipf


def _world(p: LogsParams) -> _World:
    k, K, n_items = p.latent_dim, p.topics, p.items
    centers = _rng(p.seed, _S_TOPICS).standard_normal((K, k)) / math.sqrt(k)
    r = _rng(p.seed, _S_ITEMS)
    latent = centers[np.arange(n_items) % K] + p.item_spread * r.standard_normal((n_items, k)) / math.sqrt(k)
    effect = p.ad_effect_std * r.standard_normal(n_items)
    e = _rng(p.seed, _S_EFFECTS)
    campaign_key = int(e.integers(0, 2 ** 62))
    campaign_effect = p.campaign_effect_std * e.standard_normal(p.campaigns)
    device_effect = p.device_effect_std * e.standard_normal(len(DEVICES))
    campaign = (splitmix64(np.arange(n_items, dtype=np.uint64) + np.uint64(campaign_key))
                % np.uint64(p.campaigns)).astype(np.int64)
    sizes = np.array([(n_items - t + K - 1) // K for t in range(K)], dtype=np.int64)
    return _World(item_latent=latent, item_effect=effect, item_campaign=campaign + 1000,
                  campaign_effect=campaign_effect, topic_center=centers, device_effect=device_effect,
                  campaign_key=campaign_key, global_zipf=Zipf(n_items, p.item_zipf_exponent),
                  topic_zipfs={int(s): Zipf(int(s), p.item_zipf_exponent) for s in set(sizes.tolist())},
                  topic_size=sizes, depth_zipf=Zipf(SESSION_DEPTH_MAX, SESSION_DEPTH_EXPONENT))


def _draw_items(w: _World, rng: np.random.Generator, topics: np.ndarray, mix: float, K: int) -> np.ndarray:
    """One item per entry of ``topics``: from that topic w.p. ``mix`` (Zipf within the topic),
    else from the global Zipf popularity (rank = id)."""
    n = len(topics)
    u = rng.random(n)
    from_topic = rng.random(n) < mix
    items = w.global_zipf.sample(u)
    tsize = w.topic_size[topics]
    for size, zipf in w.topic_zipfs.items():
        sel = from_topic & (tsize == size)
        if sel.any():
            items[sel] = zipf.sample(u[sel]) * K + topics[sel]
    return items


# ---- one block of users ------------------------------------------------------------------------

@dataclass
class _Users:
    first: int  # global index of the block's first user
    topic: np.ndarray
    latent: np.ndarray
    offset: np.ndarray
    device: np.ndarray
    age0: np.ndarray  # NaN = unknown
    total: np.ndarray
    per_day: np.ndarray  # [n, D]
    carry: np.ndarray  # [n, L] items, right-aligned, -1 = none
    carry_len: np.ndarray


def _users(p: LogsParams, w: _World, block: int) -> _Users:
    first = block * USER_BLOCK
    n = min(USER_BLOCK, p.users - first)
    r = _rng(p.seed, _S_USERS, block)
    k, L, D = p.latent_dim, p.history_length, p.days
    topic = r.integers(0, p.topics, n)
    latent = w.topic_center[topic] + p.user_spread * r.standard_normal((n, k)) / math.sqrt(k)
    offset = p.user_offset_std * r.standard_normal(n)
    device = r.choice(len(DEVICES), size=n, p=DEVICE_SHARES)
    age0 = np.exp(p.age_log_mean + p.age_log_std * r.standard_normal(n))
    age0[r.random(n) < p.age_missing] = np.nan
    raw = p.examples_per_user_median * np.exp(p.examples_per_user_sigma * r.standard_normal(n))
    total = np.clip(np.floor(raw + 0.5), 1, p.max_examples_per_user).astype(np.int64)
    weights = r.gamma(2.0, size=(n, D))
    per_day = np.zeros((n, D), dtype=np.int64)
    left, mass = total.copy(), weights.sum(axis=1)
    for d in range(D):  # Multinomial(total, weights / Σ weights) as a chain of binomials
        if d == D - 1:
            per_day[:, d] = left
        else:
            q = np.clip(weights[:, d] / np.maximum(mass, 1e-300), 0.0, 1.0)
            per_day[:, d] = r.binomial(left, q)
            left -= per_day[:, d]
            mass -= weights[:, d]
    carry_len = np.minimum(L, r.geometric(1.0 / (1.0 + p.initial_views_mean), n) - 1)
    carry = np.full((n, L), -1, dtype=np.int64)
    owner = np.repeat(np.arange(n), carry_len)
    items = _draw_items(w, r, topic[owner], p.history_topic_mix, p.topics)
    slot = L - np.repeat(carry_len, carry_len) + (np.arange(len(owner)) - np.repeat(np.cumsum(carry_len) - carry_len,
                                                                                     carry_len))
    carry[owner, slot] = items
    return _Users(first, topic, latent, offset, device, age0, total, per_day, carry, carry_len)


def _day_rows(p: LogsParams, w: _World, us: _Users, block: int, day: int, day_start_ms: int) -> dict:
    """One (block, day): every column, in time order (ties: the user's order), plus truth."""
    r = _rng(p.seed, _S_DAY, block, day)
    n, L, K = len(us.topic), p.history_length, p.topics
    counts = us.per_day[:, day]
    R = int(counts.sum())
    user = np.repeat(np.arange(n), counts)
    ms = r.integers(0, _DAY_MS, R)
    order = np.lexsort((ms, user))  # by user, then time: each user's impressions in sequence
    ms = ms[order]
    # history: a per-user buffer [carry (L slots) | the day's new views]; row j's history is
    # the last <= L entries before its position, most recent first
    views = r.poisson(p.views_per_impression, R)
    V = np.bincount(user, weights=views, minlength=n).astype(np.int64)
    seg_len = L + V
    seg_start = np.cumsum(seg_len) - seg_len
    buf = np.empty(int(seg_len.sum()), dtype=np.int64)
    buf[(seg_start[:, None] + np.arange(L)).reshape(-1)] = us.carry.reshape(-1)
    viewer = np.repeat(np.arange(n), V)
    rank = np.arange(len(viewer)) - np.repeat(np.cumsum(V) - V, V)
    buf[seg_start[viewer] + L + rank] = _draw_items(w, r, us.topic[viewer], p.history_topic_mix, K)
    cv = np.cumsum(views) - np.repeat(np.cumsum(V) - V, counts)
    end = seg_start[user] + L + cv  # exclusive
    valid_from = seg_start[user] + L - us.carry_len[user]
    hist_len = np.minimum(L, end - valid_from)
    hist_off = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(hist_len, out=hist_off[1:])
    hist = buf[np.repeat(end, hist_len) - 1 - (np.arange(int(hist_off[-1])) - np.repeat(hist_off[:-1], hist_len))]
    tail = seg_start + L + V
    us.carry = buf[tail[:, None] - L + np.arange(L)]
    us.carry_len = np.minimum(L, us.carry_len + V)

    ad = _draw_items(w, r, us.topic[user], p.ad_topic_mix, K)
    device = np.where(r.random(R) < p.primary_device_share, us.device[user], r.integers(0, len(DEVICES), R))
    price = np.exp(p.price_log_mean + p.price_log_std * r.standard_normal(R))
    position = r.integers(1, POSITIONS + 1, R)
    depth = w.depth_zipf.sample(r.random(R)) + 1
    age = us.age0[user] + (day + ms / _DAY_MS)
    pm, ps = price_statistics(p)
    qm, qs = position_statistics()
    dense = (p.w_price * (np.log1p(price) - pm) / ps + p.w_position * (position - qm) / qs
             + p.w_session_depth * np.clip(np.log1p(depth), *DEPTH_CLIP)
             + p.w_account_age * np.clip(np.log1p(np.nan_to_num(age, nan=0.0)), *AGE_CLIP))
    campaign = w.item_campaign[ad]
    interaction = p.interaction_scale * np.einsum("ij,ij->i", us.latent[user], w.item_latent[ad])
    logit = (p.bias + us.offset[user] + w.item_effect[ad] + w.campaign_effect[campaign - 1000]
             + w.device_effect[device] + interaction + dense)
    prob = _sigmoid(logit)
    label = (r.random(R) < prob).astype(np.int8)
    t = np.argsort(ms, kind="stable")  # the log's order: time (ties keep the user order)
    return {"user": user[t], "ms": day_start_ms + ms[t], "label": label[t], "price": price[t],
            "position": position[t].astype(np.int32), "depth": depth[t].astype(np.int32), "age": age[t],
            "ad": ad[t], "campaign": campaign[t], "device": device[t], "hist_len": hist_len[t],
            "hist_off": hist_off, "hist": hist, "order": t, "logit": logit[t], "p": prob[t],
            "offset": us.offset[user][t]}


def _log_table(rows: dict, user_names, item_names):
    import pyarrow as pa

    t = rows["order"]
    offsets = np.zeros(len(t) + 1, dtype=np.int32)
    np.cumsum(rows["hist_len"], out=offsets[1:])
    # the flat history values, gathered in the log's (time) order
    starts = rows["hist_off"][:-1][t]
    idx = np.repeat(starts, rows["hist_len"]) + (np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], rows["hist_len"]))
    history = pa.ListArray.from_arrays(pa.array(offsets), item_names.take(pa.array(rows["hist"][idx])))
    devices = pa.array(list(DEVICES), pa.string())
    age = rows["age"]
    return pa.table({
        "user_id": user_names.take(pa.array(rows["user"])),
        "ts": pa.array(rows["ms"], pa.timestamp("ms", tz="UTC")),
        "label": pa.array(rows["label"], pa.int8()),
        "price": pa.array(rows["price"], pa.float64()),
        "position": pa.array(rows["position"], pa.int32()),
        "session_depth": pa.array(rows["depth"], pa.int32()),
        "account_age_days": pa.array(age, pa.float64(), mask=np.isnan(age)),
        "ad_id": item_names.take(pa.array(rows["ad"])),
        "campaign": pa.array(rows["campaign"], pa.int64()),
        "device": devices.take(pa.array(rows["device"])),
        "history": history,
    })


# ---- the schema ------------------------------------------------------------------------------------

def schema_text(p: LogsParams) -> str:
    """The `convert table` schema of these logs (public constants only: no data-derived value)."""
    item_hash = _pow2_at_least(4 * p.items)
    campaign_hash = _pow2_at_least(4 * p.campaigns)
    pm, ps = price_statistics(p)
    qm, qs = position_statistics()
    last = p.day_dates()[-1]
    return f"""# Schema of the synthetic click logs written by `widedp synth logs` (trainer/data/synthetic/synth_logs.py).
#   widedp convert table 'LOGS/day=*/*.parquet' DATA --schema LOGS/schema.toml --test-after {last}
# trains on the first {p.days - 1} day(s) and tests on {last}. Standardization statistics are the
# generator's exact public moments (no DP estimate: nothing is charged for them).
format = "parquet"
label = "label"
unit = "user_id"
timestamp = "ts"

[dense.price]                 # log-normal: heavy-tailed
transform = ["log1p", "standardize"]
mean = {pm!r}
std = {ps!r}

[dense.position]
transform = "standardize"
mean = {qm!r}
std = {qs!r}

[dense.session_depth]         # Zipf counts: heavy-tailed
transform = ["log1p", "clip"]
clip = [{DEPTH_CLIP[0]!r}, {DEPTH_CLIP[1]!r}]

[dense.account_age_days]      # null for users of unknown age -> fill
transform = ["log1p", "clip"]
clip = [{AGE_CLIP[0]!r}, {AGE_CLIP[1]!r}]
fill = 0.0

[categorical.ad]
column = "ad_id"
table = "item"
hash_size = {item_hash}

[categorical.history]         # the user's last {p.history_length} items viewed, most recent first
table = "item"                # shared with ad
hash_size = {item_hash}
list = true
pooling = "mean"
max_length = {p.history_length}

[categorical.campaign]
hash_size = {campaign_hash}

[categorical.device]
vocabulary = "{DEVICE_VOCAB_FILE}"
"""


# ---- writing -----------------------------------------------------------------------------------------

def _refuse_existing(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise DataError(f"{out_dir}: not empty; synthetic logs are never written over existing files: "
                        "write to a new directory")


def _expected_auc_of_scores(scores: np.ndarray, p: np.ndarray) -> float:
    """Expected AUC of ``scores`` when labels ~ Bernoulli(p) (pairs i != j, ties 1/2), as
    ``expected_auc`` (which is this with scores = p)."""
    order = np.argsort(scores, kind="stable")
    s, q = np.asarray(scores, dtype=np.float64)[order], np.asarray(p, dtype=np.float64)[order]
    first = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    pos, neg = np.add.reduceat(q, first), np.add.reduceat(1.0 - q, first)
    neg_below = np.cumsum(neg) - neg
    self_pairs = float(np.sum(q * (1.0 - q)))
    num = float(np.sum(pos * (neg_below + 0.5 * neg))) - 0.5 * self_pairs
    den = float(q.sum() * (1.0 - q).sum()) - self_pairs
    return num / den if den > 0 else float("nan")


def _logloss(p: np.ndarray, y: Optional[np.ndarray] = None) -> float:
    q = np.clip(p, 1e-15, 1 - 1e-15)
    if y is None:  # expected: the mean binary entropy
        return float(np.mean(-(q * np.log(q) + (1 - q) * np.log1p(-q))))
    return float(np.mean(-(y * np.log(q) + (1 - y) * np.log1p(-q))))


def synth_logs(out_dir, params: Optional[LogsParams] = None, **kw) -> dict:
    """Write the logs (see the module docstring) to ``out_dir``; returns truth.json's content.

    ``params`` or keyword arguments (LogsParams fields). ValueError/DataError on a bad parameter
    or an existing non-empty ``out_dir``; nothing is left behind on any error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    started = time.perf_counter()
    if params is not None and kw:
        raise TypeError("give params or keyword arguments, not both")
    p = params if params is not None else LogsParams(**kw)
    check_params(p)
    out = Path(os.fspath(out_dir))
    _refuse_existing(out)
    parent = out.absolute().parent
    created = []
    q = parent
    while not q.exists():
        created.append(q)
        q = q.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.synth-logs-", dir=parent))
    try:
        truth = _write(p, tmp, pa, pq)
        truth["seconds"] = round(time.perf_counter() - started, 3)
        truth["convert_command"] = (f"widedp convert table '{out}/day=*/*.parquet' DATA --schema {out}/{SCHEMA_FILE} "
                                    f"--test-after {truth['evaluation_day']['date']}")
        _write_text(tmp / TRUTH_FILE, json.dumps(truth, indent=2, allow_nan=False) + "\n")
        os.chmod(tmp, 0o755)
        _refuse_existing(out)  # again: something may have appeared meanwhile
        if out.is_dir():
            out.rmdir()  # empty (checked): replaced
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:  # deepest first; only if still empty
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return truth


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def _write(p: LogsParams, root: Path, pa, pq) -> dict:
    w = _world(p)
    dates = p.day_dates()
    start_ms = int(_dt.datetime.fromisoformat(p.start_date).replace(tzinfo=_dt.timezone.utc).timestamp()) * 1000
    for date in dates:
        (root / f"day={date}").mkdir()
        (root / TRUTH_DIR / f"day={date}").mkdir(parents=True)
    item_names = pa.array([f"i{i}" for i in range(p.items)], pa.string())
    D = p.days
    rows_per_day = np.zeros(D, dtype=np.int64)
    positives_per_day = np.zeros(D, dtype=np.int64)
    p_sum_per_day = np.zeros(D)
    active_per_day = np.zeros(D, dtype=np.int64)
    totals = []
    last_p, last_y, last_scores = [], [], []
    blocks = -(-p.users // USER_BLOCK)
    users_schema = pa.schema([("user_id", pa.string()), ("topic", pa.int32()), ("offset", pa.float64()),
                              ("latent", pa.list_(pa.float32(), p.latent_dim)), ("primary_device", pa.string()),
                              ("account_age_days_at_start", pa.float64()), ("examples", pa.int64()),
                              ("examples_per_day", pa.list_(pa.int64(), D))])
    with pq.ParquetWriter(str(root / TRUTH_DIR / "users.parquet"), users_schema) as users_writer:
        for b in range(blocks):
            us = _users(p, w, b)
            n = len(us.topic)
            names = pa.array([f"u{i:08d}" for i in range(us.first, us.first + n)], pa.string())
            users_writer.write_table(pa.table({
                "user_id": names, "topic": pa.array(us.topic, pa.int32()), "offset": pa.array(us.offset),
                "latent": pa.FixedSizeListArray.from_arrays(pa.array(us.latent.astype(np.float32).reshape(-1)),
                                                            p.latent_dim),
                "primary_device": pa.array(list(DEVICES)).take(pa.array(us.device)),
                "account_age_days_at_start": pa.array(us.age0, mask=np.isnan(us.age0)),
                "examples": pa.array(us.total),
                "examples_per_day": pa.FixedSizeListArray.from_arrays(pa.array(us.per_day.reshape(-1)), D),
            }, schema=users_schema))
            totals.append(us.total)
            active_per_day += (us.per_day > 0).sum(axis=0)
            for d, date in enumerate(dates):
                rows = _day_rows(p, w, us, b, d, start_ms + d * _DAY_MS)
                pq.write_table(_log_table(rows, names, item_names), str(root / f"day={date}" / f"part-{b}.parquet"),
                               row_group_size=1 << 16)
                pq.write_table(pa.table({"logit": pa.array(rows["logit"]), "p": pa.array(rows["p"])}),
                               str(root / TRUTH_DIR / f"day={date}" / f"part-{b}.parquet"), row_group_size=1 << 16)
                rows_per_day[d] += len(rows["label"])
                positives_per_day[d] += int(rows["label"].sum())
                p_sum_per_day[d] += float(rows["p"].sum())
                if d == D - 1:
                    last_p.append(rows["p"])
                    last_y.append(rows["label"])
                    last_scores.append(rows["logit"] - rows["offset"])
    if int(rows_per_day[:-1].sum()) == 0 or int(rows_per_day[-1]) == 0:
        raise DataError(f"--users {p.users} over --days {p.days} gave "
                        f"{'no training rows' if rows_per_day[-1] else 'no rows on the last day'}: "
                        "use more users or a larger --examples-per-user-median")
    items_table = pa.table({
        "item": pa.array(np.arange(p.items)), "item_id": item_names,
        "topic": pa.array((np.arange(p.items) % p.topics).astype(np.int32)),
        "latent": pa.FixedSizeListArray.from_arrays(pa.array(w.item_latent.astype(np.float32).reshape(-1)),
                                                    p.latent_dim),
        "effect": pa.array(w.item_effect), "campaign": pa.array(w.item_campaign),
        "campaign_effect": pa.array(w.campaign_effect[w.item_campaign - 1000]),
    })
    pq.write_table(items_table, str(root / TRUTH_DIR / "items.parquet"))
    _write_text(root / SCHEMA_FILE, schema_text(p))
    _write_text(root / DEVICE_VOCAB_FILE, "".join(f"{d}\n" for d in DEVICES))

    total = np.concatenate(totals)
    lp, ly, ls = np.concatenate(last_p), np.concatenate(last_y).astype(np.float64), np.concatenate(last_scores)
    pm, ps = price_statistics(p)
    qm, qs = position_statistics()
    n_rows = int(rows_per_day.sum())
    top = np.sort(total)[::-1][:max(1, len(total) // 100)]
    return {
        "generator": "synth_logs",
        "seed": p.seed,
        "params": asdict(p),
        "model": {
            "logit": "bias + user_offset[u] + item_effect[ad] + campaign_effect[campaign(ad)] + device_effect[device] "
                     "+ interaction_scale * <user_latent[u], item_latent[ad]> + Σ_j dense_weight_j * f_j(x_j)",
            "dense_features": {
                "price": {"f": "(log1p(price) - mean) / std", "weight": p.w_price, "mean": pm, "std": ps},
                "position": {"f": "(position - mean) / std", "weight": p.w_position, "mean": qm, "std": qs},
                "session_depth": {"f": f"clip(log1p(session_depth), {DEPTH_CLIP[0]}, {DEPTH_CLIP[1]})",
                                  "weight": p.w_session_depth},
                "account_age_days": {"f": f"clip(log1p(account_age_days, null -> 0), {AGE_CLIP[0]}, {AGE_CLIP[1]})",
                                     "weight": p.w_account_age},
            },
            "device_effect": {d: float(e) for d, e in zip(DEVICES, w.device_effect)},
            "campaigns": p.campaigns, "campaign_key": w.campaign_key,
            "campaign_of_item": "1000 + splitmix64(item + campaign_key) mod campaigns",
            "item_names": "i<item>", "user_names": "u<8-digit index>", "topic_of_item": "item % topics",
            "per_row_truth": f"{TRUTH_DIR}/day=DATE/part-B.parquet (logit, p; the log file's row order)",
            "users_truth": f"{TRUTH_DIR}/users.parquet", "items_truth": f"{TRUTH_DIR}/items.parquet",
        },
        "files": {"logs": "day=YYYY-MM-DD/part-B.parquet", "schema": SCHEMA_FILE, "device_vocabulary": DEVICE_VOCAB_FILE,
                  "user_blocks": blocks, "users_per_block": USER_BLOCK},
        "num_users": p.users,
        "num_examples": n_rows,
        "base_rate": float(positives_per_day.sum() / n_rows),
        "expected_base_rate": float(p_sum_per_day.sum() / n_rows),
        "days": [{"date": date, "examples": int(rows_per_day[d]), "active_users": int(active_per_day[d]),
                  "positives": int(positives_per_day[d]), "base_rate": float(positives_per_day[d] / max(1, rows_per_day[d])),
                  "expected_base_rate": float(p_sum_per_day[d] / max(1, rows_per_day[d]))}
                 for d, date in enumerate(dates)],
        "examples_per_user": {"median": float(np.median(total)), "mean": float(total.mean()),
                              "p90": float(np.quantile(total, 0.9)), "p99": float(np.quantile(total, 0.99)),
                              "max": int(total.max()), "clipped_at_max": int((total == p.max_examples_per_user).sum()),
                              "share_of_examples_from_top_1pct_users": float(top.sum() / total.sum())},
        "evaluation_day": {
            "date": dates[-1], "examples": int(len(lp)), "base_rate": float(ly.mean()),
            "bayes_auc": expected_auc(lp),
            "bayes_auc_kind": "expected AUC of the true p over the label draw (exact given the day's rows)",
            "empirical_auc": auc(lp, ly),
            "empirical_auc_kind": "AUC of the true p against the sampled labels",
            "bayes_logloss": _logloss(lp),
            "bayes_logloss_kind": "mean binary entropy of the true p (its expected log loss)",
            "empirical_logloss": _logloss(lp, ly),
            "auc_without_user_offset": _expected_auc_of_scores(ls, lp),
        },
    }


def result(truth: dict, out_dir) -> dict:
    """The CLI's one JSON object."""
    ev = truth["evaluation_day"]
    return {"out_dir": str(out_dir), "kind": "logs", "num_examples": truth["num_examples"],
            "num_users": truth["num_users"], "days": len(truth["days"]), "test_day": ev["date"],
            "test_examples": ev["examples"], "base_rate": truth["base_rate"], "bayes_auc": ev["bayes_auc"],
            "max_examples_per_user": truth["examples_per_user"]["max"],
            "convert_command": truth["convert_command"], "seconds": truth["seconds"]}
