"""The attributes an `EmbeddingShard` holds (set in its `__init__`, trainer/engine/shard.py),
declared once for the classes that make it up (`ShardGradients`, `ShardSelection`,
`ShardUpdates`): the layout and this shard's row ranges, the TBE and its flat [R, D] storage,
the optimizer's and the average's state, and the per-step caches."""

from __future__ import annotations

from typing import Any, Callable


class ShardState:
    """Declarations only (no behaviour)."""

    layout: Any
    shard_index: Any
    optimizer: Any
    lr: Any
    adam_betas: Any
    eps: Any
    _current_lr: Any
    _last_call_id: Any
    _last_answer: Any
    _call_timings: Any
    device: Any
    ranges: Any
    starts: Any
    feature_table: Any
    tables_unshared: Any
    channel_table: Any
    num_channels: Any
    feature_channel: Any
    feature_channel_t: Any
    update_channel: Any
    row_base: Any
    max_rows: Any
    tbe: Any
    feature_rows: Any
    flat: Any
    adam_state: Any
    _caches: Any
    _row_sum_parts: Any
    _step_row_sums: Any
    ema_decay: Any
    step: Any
    ema: Any
    _ema_current_at: Any
    mix_previous: Any
    ema_through: Any
    # methods one part calls on another (defined there)
    _adagrad_state: Callable[..., Any]
    _ids_never_repeat: Callable[..., Any]
    _row_groups: Callable[..., Any]
    averaged_weights_flat: Callable[..., Any]
    select_rows: Callable[..., Any]
