"""One bundle per op on a node: which other active bundles already provide a candidate's ops.

A node serves each op from the one active bundle that provides it (``kernelpack.runtime``), so bundles of
different names can be rolled out independently (an attention bundle, a norm bundle). Two active bundles that
provide the same op would leave the node nothing to choose by: ``rollout start`` refuses such a candidate
(:func:`op_clashes`, 409). A bundle is active on a stratum when it is stable there or an active rollout of it
reaches the stratum; other versions of the candidate's own name are its baseline, not a clash.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.db.models import Bundle, Rollout, RolloutStratum, StableVersion
from kernelctl.vocab import ACTIVE_STATES


def provided_ops(manifest: dict[str, Any] | None) -> set[str]:
    """The ops a bundle's manifest lists."""
    return {k["op"] for k in (manifest or {}).get("kernels", []) if isinstance(k, dict) and "op" in k}


def op_clashes(session: Session, bundle: Bundle, strata: Iterable[str]) -> list[str]:
    """One line per other bundle, active on one of ``strata``, that provides one of ``bundle``'s ops."""
    strata = set(strata)
    mine = provided_ops(bundle.manifest)
    where: dict[int, set[str]] = {}  # other bundle id -> strata where it is active
    for bid, stratum in session.execute(select(StableVersion.bundle_id, StableVersion.stratum).where(
            StableVersion.bundle_name != bundle.name, StableVersion.stratum.in_(strata))):
        where.setdefault(bid, set()).add(f"{stratum} (stable)")
    for bid, stratum in session.execute(
            select(Rollout.bundle_id, RolloutStratum.stratum)
            .join(RolloutStratum, RolloutStratum.rollout_id == Rollout.id)
            .join(Bundle, Bundle.id == Rollout.bundle_id)
            .where(Bundle.name != bundle.name, RolloutStratum.stratum.in_(strata),
                   RolloutStratum.state.in_(ACTIVE_STATES))):
        where.setdefault(bid, set()).add(f"{stratum} (rolling out)")
    out = []
    for bid, on in sorted(where.items()):
        other = session.get(Bundle, bid)
        both = sorted(mine & provided_ops(other.manifest if other is not None else None))
        if other is not None and both:
            out.append(f"{other.ref} provides {', '.join(both)} on {', '.join(sorted(on))}")
    return out
