"""A run's privacy budget as the engine spends it: the ledger, the target ε, the step's event,
and the rule that a step is never taken past the target (docs/DESIGN.md §1).

Privacy assumption: every event charged here is charged *before* anything that depends on the
mechanism's output is released (`charge`, then `persist`: trainer/run/records.py writes
ledger.json and the journal), so a crash can only over-count. Events are accounted for a group
of `group_size` examples at user level by example sampling (`accounted`).
"""

from __future__ import annotations

from typing import Callable, Optional

from widedp.accounting import PrivacyLedger
from widedp.accounting import events as ev


class PrivacyBudget:
    """The ledger, the target ε and the step event of one engine."""

    #: Without `plan_steps`: the least number of steps certified at once.
    BUDGET_CHUNK = 64

    def __init__(self, ledger: Optional[PrivacyLedger], target_epsilon: float, group_size: int = 1,
                 persist: Optional[Callable[[PrivacyLedger], None]] = None):
        """`persist`: called with the ledger after each charge, before the release it pays for."""
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
        self.ledger, self.target_epsilon, self.group_size, self.persist = ledger, target_epsilon, group_size, persist
        self.step_event: Optional[ev.DpEvent] = None  # set by the engine (`plan.step_event_of`)
        # The run's planned number of steps (train.steps), if the driver told (`plan_steps`):
        # what the budget check certifies at once (`would_exceed`).
        self.planned_steps: Optional[int] = None
        self.limit: Optional[int] = None  # step_count past which certifying found no room

    def accounted(self, event: ev.DpEvent) -> ev.DpEvent:
        """`event` as this run charges it: for a group of `group_size` examples (k > 1), else itself."""
        return ev.grouped(event, self.group_size)

    def charge(self, event: ev.DpEvent, whole_unit: bool = False) -> None:
        """Record an event and persist the ledger, before anything that depends on that
        mechanism's output is used. `whole_unit`: the event already bounds a whole user (per-user
        data statistics): charged as it is, not for a group (`accounted`)."""
        if self.ledger is None:
            raise RuntimeError("charge() needs a privacy ledger (a nonprivate run has none)")
        self.ledger.record(event if whole_unit else self.accounted(event))
        if self.persist is not None:
            self.persist(self.ledger)

    def plan_steps(self, total_steps: int) -> None:
        """Tell the budget check the run's planned number of steps (train.steps, counted from
        step 0 as the engine's `step_count` is): it then certifies the remaining steps in one
        accountant call (`would_exceed`). Optional: without it the check certifies in growing
        chunks."""
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"total_steps must be an integer >= 0, got {total_steps!r}")
        self.planned_steps = total_steps

    def would_exceed(self, step_count: int) -> bool:
        """Whether one more step (after `step_count`) would spend past the target ε (then the
        step is not taken).

        The ledger answers for free while a certificate covers the step (accounting/ledger.py:
        ε(ledger + n steps) ≤ target computed once covers each of those n steps, as ε only
        grows with composition). Without one, this certifies the steps still planned
        (`plan_steps`; else a chunk of max(BUDGET_CHUNK, step_count) steps), or as many of them
        as fit (bisection, ~log2 n accountant calls), so a run costs a few accountant calls in
        all instead of one per step; when not even one more step fits, the ledger computes the
        answer as before (raising the accountant's error, if its bound does not hold)."""
        event, ledger = self.step_event, self.ledger
        if event is None or ledger is None:
            return False
        if ledger.certified(event, self.target_epsilon):
            return False
        if self.limit is None or step_count < self.limit:
            if self.planned_steps is not None and self.planned_steps > step_count:
                wanted = self.planned_steps - step_count
            else:
                wanted = max(self.BUDGET_CHUNK, step_count)
            fits = ledger.certify_most(event, wanted, self.target_epsilon)
            if fits < wanted:  # a hint only (the ledger decides below): no need to search again there
                self.limit = step_count + fits
            if fits > 0:
                return False
        return ledger.would_exceed(event, self.target_epsilon)

    def record_step(self, ran: ev.DpEvent) -> None:
        """Charge the event a step ran, which must be the one budgeted (`step_event`) — before
        anything of the step is released."""
        if self.accounted(ran) != self.step_event:
            raise RuntimeError(f"the step ran {ran!r} but the budget was checked for {self.step_event!r}; "
                               "nothing was recorded or released")
        self.charge(ran)
