"""An engine's checkpoint: everything a resumed run needs. Generator states only in
reproducible mode: a secret run's randomness never reaches disk (a resumed secret run draws a
fresh root, so replayed steps get fresh noise and are charged again)."""

from __future__ import annotations

import copy

from widedp.trainer.engine.recalibration import install_logit_range


def engine_state(engine) -> dict:
    """Everything a resumed run needs. Generator states only in reproducible mode: a secret
    run's randomness never reaches disk (a resumed secret run draws a fresh root)."""
    engine.store_pending_noise()  # lazy DP-SGD noise: stored in a logged round before the shards' states are read
    state = {
        "step": engine.step_count,
        # Copies: a checkpoint held in memory must not change as training continues.
        "model": copy.deepcopy(engine.model.state_dict()),
        "dense_optimizer": copy.deepcopy(engine.dense.optimizer.state_dict()),
        "shards": engine.shards.broadcast("state_dict"),
        "ledger": engine.ledger.state_dict() if engine.ledger is not None else None,
        "fixed_rows": engine.fixed_rows,
        "reproducible": engine.randomness.reproducible,
        "recalibrated_at": engine.recalibrated_at,
    }
    if engine.pre_recalibration is not None:
        state["pre_recalibration"] = {n: v.clone() for n, v in engine.pre_recalibration.items()}
    if engine.logit_range is not None:  # the released model clamps its logit (trainer/engine/recalibration.py)
        state["logit_range"] = list(engine.logit_range)
    if engine.dense.mix_previous is not None:  # ModelMix's θ_{t-2} of the dense parameters (a released state)
        state["mix_previous"] = {n: v.clone() for n, v in engine.dense.mix_previous.items()}
    if engine.dense.ema is not None:
        # the released model, with the averaged dense parameters (the shards' states carry
        # the averaged tables as "averaged_weights"); also all a resume needs of the average
        state["averaged_model"] = {**copy.deepcopy(engine.model.state_dict()),
                                   **{n: v.clone() for n, v in engine.dense.ema.items()}}
    if engine.randomness.reproducible:
        state["rng"] = {
            "sampler": engine.sampler.state_dict(),
            "selection_rng": engine.selection_rng.bit_generator.state,
            "noise_gen": engine.noise_gen.state_dict(),
            "clip_rng": engine.clip_rng.bit_generator.state,
        }
    return state


def load_engine_state(engine, state: dict) -> None:
    """Restore a checkpoint. Generator states are reused only when both the checkpoint and
    this engine are reproducible (bit-identical replay); otherwise this engine keeps its
    fresh secret streams, so replayed steps get fresh noise (and are charged again)."""
    engine.step_count = state["step"]
    engine.model.load_state_dict(state["model"])
    engine.dense.optimizer.load_state_dict(state["dense_optimizer"])
    engine.shards.call("load_state_dict", [(s,) for s in state["shards"]])
    rng = state.get("rng")
    if rng is not None and engine.randomness.reproducible:
        if not isinstance(rng.get("noise_gen"), dict):
            raise ValueError("the checkpoint's generator states are torch generator states (an older widedp, "
                             "32-bit seeds): its reproducible replay cannot continue; start a new run")
        # The counter-based keys (DP-SGD rows, shard selection, ModelMix) derive from the root
        # again; the sequential generators continue from their states.
        engine.sampler.load_state_dict(rng["sampler"])
        engine.selection_rng.bit_generator.state = rng["selection_rng"]
        engine.noise_gen.load_state_dict(rng["noise_gen"])
        engine.clip_rng.bit_generator.state = rng["clip_rng"]
    if engine.ledger is not None and state["ledger"] is not None:
        engine.ledger.load_state_dict(state["ledger"])
    engine.budget.limit = None
    engine.fixed_rows = state["fixed_rows"]
    engine.recalibrated_at = state.get("recalibrated_at")
    saved = state.get("pre_recalibration")
    engine.pre_recalibration = None if saved is None else {n: v.clone() for n, v in saved.items()}
    install_logit_range(engine, state.get("logit_range"))
    previous = state.get("mix_previous")
    engine.dense.mix_previous = None if previous is None else {n: v.clone() for n, v in previous.items()}
    if engine.dense.ema is not None:
        if "averaged_model" not in state:
            raise ValueError("the checkpoint has no averaged parameters but train.ema_decay > 0: "
                             "resume with the checkpoint's train.ema_decay")
        engine.dense.ema = {n: state["averaged_model"][n].clone() for n in engine.dense.ema}
