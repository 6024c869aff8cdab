"""The lab: many runs of the library and the evidence they produce.

    python -m experiments <verb> [options]      # `python -m experiments --help` lists the verbs

Sweeps, ablations, reports, the results summary, reproduction, profiles, DDP and loader
measurements; `experiments.bench` (kernels against peers) and `experiments.tuning` (launch
configs). Imports the library (pipeline, models, kernels, data_gen); nothing there imports this.
"""
