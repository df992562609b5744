"""The SLO autoscaler: moves workers to the phase that misses its latency target (off unless the deploy config's
`autoscaler.enabled` is true).

    settings.py   the `autoscaler:` config section, validated (deploy/config.py parses it)
    policy.py     pure: one window's TTFT/TPOT p90s + the pools' sizes -> new targets and why (the hysteresis)
    loop.py       the thread that feeds the policy from the routers' latency windows and asks the controller

Who owns what: the controller (deploy.controller) owns pool targets and alone creates and drains workers; the
autoscaler only decides, through the controller's `scale` (router.scaling.Scaler), the same call Admin.Scale makes.
The latency comes from the routers' own windows (router.recent_latency).
"""
