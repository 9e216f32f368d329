"""The preference wing: offline DPO family, KTO, ORPO, SimPO, CPO and reward models.

Modules: ``config`` (``PreferenceConfig``, ``check_config``), ``data`` (records → encoded
splits → batches), ``losses`` (model losses and the frozen reference pass), ``trainer``
(``PreferenceTrainer``), ``run`` (``run(cfg)``). The loss math itself is the loss layer's
(``jaxrl_llm.preference``).
"""
