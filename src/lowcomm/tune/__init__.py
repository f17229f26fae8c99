"""What the link costs and the settings that fit it, shared by the ``lowcomm train`` job (its
``--tune-link``), ``lowcomm plan`` and ``lowcomm simulate``; it imports none of them.

* :mod:`~lowcomm.tune.collective_cost` and :mod:`~lowcomm.tune.cost`: the α-β cost model of
  collectives over tiers of links, and each algorithm's overlap rule
  (:func:`~lowcomm.tune.cost.step_time`);
* :mod:`~lowcomm.tune.evidence`: what each algorithm was measured to learn per token at each
  setting (the studies' evidence);
* :mod:`~lowcomm.tune.choose`: the settings a job chooses from its link and its inner step
  (:func:`~lowcomm.tune.choose.choose_sync_settings`).
"""
