"""The dense part's reduction among the trainer actors (cluster.dense_reduction = "trainers"):
the trainers' dense clipped sums are summed by a reduce over torch.distributed's gloo backend
to trainer 0, which alone returns the sum to the coordinator. Trainer 0 also leads each round
for the coordinator (trainer/cluster/ray_trainers.py `_TrainerActor.lead`): the coordinator
sends it every trainer's sample and the dense parameters once and gets every part back in one
answer, so it makes one call, handles one dense sum and sends one dense state per round
whatever the number of trainers N, instead of N of each.

Privacy assumption: none of its own, and none changed. What is reduced is what the coordinator
would otherwise add: Σ_i Σ_{j ∈ trainer i} c_j ∇θ ℓ_j / b, un-noised, inside the trust
boundary (the trainers already hold their own parts of it); nothing leaves the trainers but the
sum, and the coordinator adds the Gaussian noise once, from its keyed stream, as before
(trainer/engine/noise_stage.py). The sum differs from the coordinator's trainer-order sum only in
floating-point rounding (float64 throughout: |error| ≲ N·2⁻⁵³ of the sum's terms), so the
released distribution is the same (tests/test_engine.py checks the run against the
coordinator's reduction).

Every tensor travels as float64 (float32 and integers up to 2⁵³ convert back exactly).
"""

from __future__ import annotations

import datetime
import socket
from typing import Optional

import torch

#: How long a trainer waits in a collective for the others (a dead peer ends it with an error).
COLLECTIVE_TIMEOUT_S = 120.0


def flatten(tensors: dict, names: list[str]) -> torch.Tensor:
    """The tensors `names` of `tensors`, in that order, as one float64 vector."""
    if not names:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([tensors[n].detach().reshape(-1).to(torch.float64) for n in names])


def unflatten(flat: torch.Tensor, like: dict, names: list[str]) -> dict:
    """`flatten`'s inverse: tensors shaped and typed as `like`'s."""
    out, at = {}, 0
    for n in names:
        template = like[n]
        size = template.numel()
        out[n] = flat[at: at + size].reshape(template.shape).to(template.dtype)
        at += size
    if at != flat.numel():
        raise ValueError(f"a dense vector of {flat.numel()} values for tensors of {at}")
    return out


def free_port(address: str) -> int:
    """A TCP port free on `address` now (the rendezvous of a new process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class DenseCollective:
    """One trainer's membership in the trainers' gloo process group (rank = trainer index)."""

    def __init__(self):
        self.rank: Optional[int] = None
        self.world = 1

    def join(self, address: str, port: int, rank: int, world: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> int:
        """Join (or re-join, after a restored trainer) the group of `world` trainers at
        tcp://address:port; blocks until all have joined. Returns this trainer's rank."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{int(port)}", rank=int(rank),
                                world_size=int(world), timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world = int(rank), int(world)
        return self.rank

    def _require(self) -> int:
        if self.rank is None:
            raise RuntimeError("this trainer has not joined the trainers' process group")
        return self.rank

    def reduce_sum(self, dense_sum: dict) -> dict:
        """Σ over the trainers of `dense_sum` (a dict of float64 tensors) at rank 0; {} elsewhere."""
        import torch.distributed as dist

        rank = self._require()
        names = list(dense_sum)
        flat = flatten(dense_sum, names)
        dist.reduce(flat, dst=0, op=dist.ReduceOp.SUM)
        return unflatten(flat, dense_sum, names) if rank == 0 else {}

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.rank = None
