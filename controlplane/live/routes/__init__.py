"""A route as the live service answers it: one room for its three parts.

* :mod:`.calls`: one route and its cancellation over the driver (``route_once``,
  ``cancel_route``), what the service's ``route`` and ``cancel_route`` run;
* :mod:`.ledger`: the answers remembered by request id, per tenant, so that a retried
  route answers what the first call did (``RouteLedger``, journalled);
* :mod:`.claims`: a request id claimed at the shard it hashes to before routing, so one id
  names one session's route across shards (``RequestIdClaims``).

The routing decision itself is the core's (:mod:`kvprefetch.controlplane.core.router`).
"""
