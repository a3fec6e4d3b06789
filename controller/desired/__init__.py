"""Desired state in one place: what each node should run, pushed to agents by every replica.

* ``effects``: the heartbeat rule (:func:`~controller.desired.effects.heartbeat_effects`), pure, applied by the
  single-row writer (``controller.assignments.advance_phases``), the batch writer (``controller.switches``)
  and the fast path (``snapshot.Snapshot.fast_path``);
* ``generation``: the counter, and which writes change desired state (declared at the write, with the rows
  when known: a patch);
* ``snapshot``: the immutable, copy-on-write snapshot of the fleet's desired state;
* ``store``, ``listener``, ``waiters``, ``liveness``, ``writers`` and ``hub``: one replica's push (see
  ``controller.desired.hub``).

The package imports nothing at its top so ``controller.assignments`` can use ``effects`` and ``generation``.
"""
