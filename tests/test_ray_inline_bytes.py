"""cluster.inline_bytes: the embedded Ray's inline-object limit, validated and passed to ray.init."""

from __future__ import annotations

import pytest

from widedp.trainer.cluster import ray_runtime
from widedp.trainer.config import load_config


@pytest.mark.parametrize("value", ["0", "-5", str(2 << 30)])
def test_inline_bytes_outside_the_range_is_refused_by_name(value):
    with pytest.raises(ValueError, match="cluster.inline_bytes"):
        load_config("configs/ctr.toml", [f"cluster.inline_bytes={value}"]).validate()


def test_the_system_config_carries_the_limit_and_room_for_two_objects():
    cfg = ray_runtime.local_system_config(3 * 1024 * 1024)
    assert cfg["max_direct_call_object_size"] == 3 * 1024 * 1024
    assert cfg["task_rpc_inlined_bytes_limit"] >= 2 * cfg["max_direct_call_object_size"]
    assert ray_runtime.LOCAL_SYSTEM_CONFIG == ray_runtime.local_system_config(ray_runtime.DEFAULT_INLINE_BYTES)
    assert load_config("configs/ctr.toml", []).cluster.inline_bytes == ray_runtime.DEFAULT_INLINE_BYTES


def test_ensure_ray_starts_the_embedded_ray_with_the_configured_limit(monkeypatch):
    import ray

    seen = {}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    ray_runtime.ensure_ray("", 1.0, inline_bytes=1024 * 1024)
    assert seen["_system_config"]["max_direct_call_object_size"] == 1024 * 1024
    seen.clear()
    ray_runtime.ensure_ray("", 1.0)
    assert seen["_system_config"] == ray_runtime.LOCAL_SYSTEM_CONFIG
