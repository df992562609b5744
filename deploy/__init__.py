"""Deployment: the config file, the controller that runs the pools on Ray, `tandem serve`, `deploy.job`."""
