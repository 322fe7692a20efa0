"""The divergence rule of an epoch (docs/data.md, "Divergence"): when a run whose loss is still
finite has blown up, climbed far from its own best epoch, or collapsed to chance."""

from __future__ import annotations

import math


DIVERGE_UNIFORM = 10.0
"""An epoch whose mean training loss is above this many times ln(classes) has diverged."""
DIVERGE_BEST = 4.0
"""An epoch whose mean training loss is above this many times the best epoch's so far, and above
it by DIVERGE_MARGIN x ln(classes), has diverged."""
DIVERGE_MARGIN = 0.25
"""The least rise over the best epoch's loss, in units of ln(classes), that counts: a loss of
0.0004 after a best of 0.0001 is four times as large and still nothing (noise near zero)."""
LEARNED = 0.5
"""A run has learned once its best test accuracy is at least this far from chance (1/classes)
to 1: only then can its accuracy collapse."""
COLLAPSE = 0.5
"""An epoch whose test accuracy fell back more than this fraction of the way from the best
epoch's accuracy to chance has collapsed (diverged)."""


def divergence(loss: float, best: float | None, classes: int, acc: float | None = None,
               best_acc: float | None = None) -> str | None:
    """The divergence rule of an epoch (docs/data.md, "Divergence"): why the epoch whose mean
    training loss is `loss` (finite) and whose test accuracy is `acc` (None when not evaluated)
    has diverged, or None when it has not.  best, best_acc: the lowest mean training loss and the
    highest test accuracy of the earlier whole epochs of this run's history (resumed ones
    included), None for the first.  C = classes, u = ln(C), the cross-entropy of guessing
    uniformly, the loss an untrained model starts near:

    - loss > 10 u: blown up (lr = 1e6 reaches 1e29 in its first epoch);
    - loss > 4 best and loss > best + u / 4: the run climbed far from its own best epoch;
    - best_acc - 1/C >= (1 - 1/C) / 2 (it had learned) and acc < 1/C + (best_acc - 1/C) / 2:
      its test accuracy fell more than halfway back to chance.

    Tuned on the examples' loss curves (tests/data/loss_curves.json), on which it never fires,
    nor on noisy runs at high constant rates that still learn; it fires on the epoch where a run
    whose rate doubles each epoch collapses (92% -> 21% test accuracy at a loss of 1.6 < u)."""
    if classes < 2 or not math.isfinite(loss):
        return None
    uniform = math.log(classes)
    if loss > DIVERGE_UNIFORM * uniform:
        return (f"its train loss {loss:.4g} is above {DIVERGE_UNIFORM:g} x ln({classes}) = "
                f"{DIVERGE_UNIFORM * uniform:.4g}, ten times the loss of guessing uniformly")
    if best is not None and loss > DIVERGE_BEST * best and loss > best + DIVERGE_MARGIN * uniform:
        return (f"its train loss {loss:.4g} is above {DIVERGE_BEST:g} times the best epoch's {best:.4g} (and above it "
                f"by more than {DIVERGE_MARGIN:g} x ln({classes}) = {DIVERGE_MARGIN * uniform:.3g})")
    chance = 1.0 / classes
    if acc is not None and best_acc is not None and math.isfinite(acc) \
            and best_acc - chance >= LEARNED * (1 - chance) and acc < chance + COLLAPSE * (best_acc - chance):
        return (f"its test accuracy {100 * acc:.2f}% fell more than halfway back from the best epoch's "
                f"{100 * best_acc:.2f}% to chance ({100 * chance:.2f}%)")
    return None

