"""The numeric contract a candidate may not loosen by itself: tolerances, domains and golden vectors.

Compared op by op with each stratum's stable version (the baseline), from the signed manifests: a candidate
that raises an ``atol`` or ``rtol``, drops a dtype's tolerance, changes an op's domain (dtypes, dimension
ranges, contiguity) or drops or replaces a golden vector is a *contract change*. ``rollout start`` refuses it
(:class:`ContractChange`, 409) unless the operator accepts it with a reason (``--accept-contract-change``),
which the changelog records. Ops the candidate does not ship are not a change (serving uses PyTorch there);
the trial additionally judges the candidate under the stricter tolerances and the stable golden vectors.
"""

from __future__ import annotations

from typing import Any

from controller.errors import Conflict


class ContractChange(Conflict):
    """The candidate loosens the numeric contract of the stable version and nobody accepted it."""


def _kernels(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k["op"]: k for k in manifest.get("kernels", []) if isinstance(k, dict) and "op" in k}


def _goldens(manifest: dict[str, Any]) -> dict[tuple[str, str], str | None]:
    files = manifest.get("files", {})
    return {(g["op"], g["dtype"]): (files.get(g["path"]) or {}).get("sha256") for g in manifest.get("golden", [])}


def _domain(limitations: dict[str, Any] | None) -> dict[str, Any]:
    lim = dict(limitations or {})
    lim.pop("notes", None)  # prose, not the contract
    return lim


def contract_changes(candidate: dict[str, Any], stable: dict[str, Any]) -> list[str]:
    """One line per loosening of ``stable``'s numeric contract by ``candidate`` (manifest documents)."""
    out: list[str] = []
    cand, base = _kernels(candidate), _kernels(stable)
    for op in sorted(set(cand) & set(base)):
        ct, st = cand[op].get("tolerances", {}), base[op].get("tolerances", {})
        for dtype, tol in sorted(st.items()):
            mine = ct.get(dtype)
            if mine is None:
                out.append(f"{op} {dtype}: tolerance dropped (stable atol={tol['atol']:g} rtol={tol['rtol']:g})")
                continue
            for k in ("atol", "rtol"):
                if float(mine[k]) > float(tol[k]):
                    out.append(f"{op} {dtype}: {k} loosened {tol[k]:g} -> {mine[k]:g}")
        if _domain(cand[op].get("limitations")) != _domain(base[op].get("limitations")):
            out.append(f"{op}: domain changed")
    cg, sg = _goldens(candidate), _goldens(stable)
    for (op, dtype), digest in sorted(sg.items()):
        if op not in cand:
            continue
        if (op, dtype) not in cg:
            out.append(f"{op} {dtype}: golden vectors dropped")
        elif cg[(op, dtype)] != digest:
            out.append(f"{op} {dtype}: golden vectors replaced")
    return out
